"""Print what happened in a demo run, from ft-launcher's --ft-summary-json file.

    python examples/demo_summary.py SUMMARY.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def innermost_frame(dump: str) -> str:
    """The innermost frame of the first thread in a faulthandler dump."""
    for line in dump.splitlines():
        line = line.strip()
        if line.startswith("File "):
            return line
    return "(no frame in the dump)"


def main() -> int:
    summary = json.loads(Path(sys.argv[1]).read_text())
    print("\n=== demo summary ===")
    if not summary["hangs"]:
        print("no hang was detected")
    for hang, restart in zip(summary["hangs"], summary["restarts"]):
        late_ms = (hang["elapsed_s"] - hang["timeout_s"]) * 1000
        print(f"hung rank   : rank {hang['rank']} (pid {hang['pid']}) in attempt {hang['attempt']}")
        print(f"what        : {hang['message']}")
        if hang.get("stack_dump_captured"):
            print(f"where       : {innermost_frame(Path(hang['stack_dump']).read_text())}")
            print(f"stack dump  : {hang['stack_dump']}")
        print(f"caught      : {late_ms:.1f} ms after the {hang['timeout_s']:.1f} s timeout expired")
        if restart.get("total") is not None:
            parts = ", ".join(f"{k} {v:.2f}s" for k, v in restart.items() if k != "total" and v is not None)
            print(f"restart     : all ranks back in their step loop {restart['total']:.2f} s after detection ({parts})")
        print(f"root cause  : {hang['error_file']}")
    print(f"exit code   : {summary['exit_code']}")
    obs = summary.get("observability") or {}
    if obs.get("goodput") is not None:
        print(f"goodput     : {obs['goodput']:.3f} ({obs['productive_s']:.1f} s productive step time of "
              f"{obs['wall_s']:.1f} s wall time; {obs['lost_s']:.1f} s lost to the hang)")
    if obs.get("metrics_url"):
        print(f"metrics     : {obs['metrics_url']} (served while the launcher ran)")
    if obs.get("metrics_textfile"):
        print(f"textfile    : {obs['metrics_textfile']} (Prometheus text format, as node-exporter reads it)")
    if obs.get("events"):
        from ft_monitor.report_html import write_report

        print(f"events      : {obs['events']}")
        print(f"report      : {write_report(Path(obs['events']).parent)} (ft-monitor report "
              f"{Path(obs['events']).parent})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
