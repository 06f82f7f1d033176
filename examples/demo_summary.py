"""Print what happened in a demo run, from ft-launcher's --ft-summary-json file.

    python examples/demo_summary.py SUMMARY.json
    python examples/demo_summary.py PROCESS_SUMMARY.json INPROCESS_SUMMARY.json   # side by side
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ft_monitor.forensics import stacks


def innermost_frame(dump: str) -> str:
    """The innermost frame of the main thread (the one whose stack starts at a module's top
    level) in the file's first faulthandler dump, as faulthandler writes it."""
    thread = stacks.main_thread(stacks.parse(dump))
    if thread is None or not thread.frames:
        return "(no frame in the dump)"
    f = thread.frames[0]
    return f'File "{f.file}", line {f.line if f.line is not None else "???"} in {f.func}'


def pids(summary: dict[str, Any]) -> list[str]:
    """Each attempt's worker pids, rank order."""
    return [", ".join(str(p) for _, p in sorted(a["pids"].items(), key=lambda kv: int(kv[0])))
            for a in summary.get("attempts", [])]


PHASES = ("notify", "to_stop", "stop", "rendezvous", "worker_start", "first_step")
"""A process restart's phases, as the summary's restarts rows carry them (docs/launcher.md)."""


def describe(summary: dict[str, Any]) -> None:
    if not summary["hangs"] and not summary.get("inprocess_restarts") and not summary.get("diagnoses"):
        print("no hang was detected")
    for failure in (r for r in summary["restarts"] if r.get("cause") == "failure"):
        print(f"failed      : {failure['message']} in attempt {failure['attempt']}; the group restarted")
    for hang, restart in zip(summary["hangs"], (r for r in summary["restarts"] if r.get("cause", "hang") == "hang")):
        late_ms = (hang["elapsed_s"] - hang["timeout_s"]) * 1000
        print(f"hung rank   : rank {hang['rank']} (pid {hang['pid']}) in attempt {hang['attempt']}")
        print(f"what        : {hang['message']}")
        if hang.get("reported_by"):
            print(f"reported by : rank {hang['reported_by']['rank']}'s monitor, whose rank waited for it")
        if hang.get("stack_dump_captured"):
            print(f"where       : {innermost_frame(Path(hang['stack_dump']).read_text())}")
            print(f"stack dump  : {hang['stack_dump']}")
        print(f"caught      : {late_ms:.1f} ms after the {hang['timeout_s']:.1f} s timeout expired")
        if hang.get("verdict"):
            print(f"verdict     : {hang['verdict']}")
            print(f"diagnosis   : {hang['diagnosis']}")
        if restart.get("total") is not None:
            parts = ", ".join(f"{k} {restart[k]:.2f}s" for k in PHASES if restart.get(k) is not None)
            print(f"restart     : all ranks back in their step loop {restart['total']:.2f} s after detection ({parts})")
        print(f"root cause  : {hang['error_file']}")
    for row in summary.get("diagnoses", []):
        if row.get("action") == "dump":
            print(f"diagnosed   : rank {row['rank']} in attempt {row['attempt']}, left running (on_hang: dump)")
            print(f"verdict     : {row['verdict']}")
            print(f"diagnosis   : {row['diagnosis']}")
    for row in summary.get("inprocess_restarts", []):
        print(f"fault       : rank {row['rank']} (pid {row['pid']}) in attempt {row['attempt']}: {row['message']}")
        report = json.loads(Path(row["report"]).read_text()) if row.get("report") else {}
        if report.get("stack_dump_captured"):
            print(f"where       : {innermost_frame(Path(report['stack_dump']).read_text())}")
        phases = row.get("phases") or {}
        if phases.get("total") is not None:
            parts = ", ".join(f"{k} {v:.3f}s" for k, v in phases.items() if k != "total" and v is not None)
            print(f"restart     : in-process (iteration {row['iteration']}), all ranks back in their step loop "
                  f"{phases['total']:.2f} s after detection ({parts})")
        if report:
            print(f"hang report : {row['report']}")
    attempts = pids(summary)
    if attempts:
        print("worker pids : " + "; ".join(f"attempt {i}: {p}" for i, p in enumerate(attempts)))
    obs = summary.get("observability") or {}
    if obs.get("goodput") is not None:
        print(f"goodput     : {obs['goodput']:.3f} ({obs['productive_s']:.1f} s productive step time of "
              f"{obs['wall_s']:.1f} s wall time; {obs['lost_s']:.1f} s lost to the hang)")
    if obs.get("metrics_url"):
        print(f"metrics     : {obs['metrics_url']} (served while the launcher ran)")
    if obs.get("metrics_textfile"):
        print(f"textfile    : {obs['metrics_textfile']} (Prometheus text format, as node-exporter reads it)")
    if obs.get("events"):
        from ft_monitor.views.report_html import write_report

        print(f"events      : {obs['events']}")
        print(f"report      : {write_report(Path(obs['events']).parent)} (ft-monitor report "
              f"{Path(obs['events']).parent})")
    print(f"exit code   : {summary['exit_code']}")


def restart_seconds(summary: dict[str, Any]) -> float | None:
    for restart in summary["restarts"]:
        if restart.get("total") is not None:
            return float(restart["total"])
    for row in summary.get("inprocess_restarts", []):
        if (row.get("phases") or {}).get("total") is not None:
            return float(row["phases"]["total"])
    return None


def compare(process: dict[str, Any], inprocess: dict[str, Any]) -> None:
    rows = [
        ("restart", "process restart", "in-process restart"),
        ("worker pids", " -> ".join(pids(process)) or "-", " -> ".join(pids(inprocess)) or "-"),
        ("attempts", str(len(process.get("attempts", []))), str(len(inprocess.get("attempts", [])))),
    ]
    a, b = restart_seconds(process), restart_seconds(inprocess)
    rows.append(("detected -> all ranks stepping", "-" if a is None else f"{a:.2f} s",
                 "-" if b is None else f"{b:.2f} s"))
    rows.append(("exit code", str(process["exit_code"]), str(inprocess["exit_code"])))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))


def main() -> int:
    summaries = [json.loads(Path(p).read_text()) for p in sys.argv[1:]]
    for i, summary in enumerate(summaries):
        title = "demo summary" if len(summaries) == 1 else ("process restart", "in-process restart")[min(i, 1)]
        print(f"\n=== {title} ===")
        describe(summary)
    if len(summaries) == 2:
        print("\n=== side by side ===")
        compare(*summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
