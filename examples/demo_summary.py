"""After the demo's runs: each run's HTML report written (ft-monitor report), and two runs
side by side, from ft-launcher's --ft-summary-json files. What happened in each run is
ft-launcher's own closing summary, printed as the run ends; this adds no second one.

    python examples/demo_summary.py SUMMARY.json
    python examples/demo_summary.py PROCESS_SUMMARY.json INPROCESS_SUMMARY.json   # side by side
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def pids(summary: dict[str, Any]) -> list[str]:
    """Each attempt's worker pids, rank order."""
    return [", ".join(str(p) for _, p in sorted(a["pids"].items(), key=lambda kv: int(kv[0])))
            for a in summary.get("attempts", [])]


def report(summary: dict[str, Any]) -> Path | None:
    """The run's HTML report (what ``ft-monitor report`` writes), beside its events."""
    events = (summary.get("observability") or {}).get("events")
    if not events:
        return None
    from ft_monitor.views.report_html import write_report

    return write_report(Path(events).parent)


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
        print("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())


def main() -> int:
    summaries = [json.loads(Path(p).read_text()) for p in sys.argv[1:]]
    titles = ["run"] if len(summaries) == 1 else ["process restart", "in-process restart"]
    print()
    for title, summary in zip(titles, summaries):
        page = report(summary)
        if page is not None:
            print(f"demo: {title}: the report page is {page} (ft-monitor report {page.parent})")
    if len(summaries) == 2:
        print("\n=== side by side ===")
        compare(*summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
