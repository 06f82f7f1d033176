#!/usr/bin/env python3
"""Warm against cold restarts when the hang comes early (issue 42): the demo and a job with a
heavy import, hung at step 12 (as scripts/demo is: soon after ``--ft-preload auto`` has started
its template made again), at the machine's load and beside 2 and 4 busy loops, every
configuration in turn, run after run, so that all see the same load.

    .venv/bin/python bench/warm_vs_cold.py [--runs 5] [--busy 0,2,4] [--out FILE]

Prints a table (median and range of "detected -> every rank stepping again", and of the
worker-start phase) and writes JSON. Before issue 42 a restart waited up to 60 s for a
template still importing; now it forks from the ready one, or starts cold, never waiting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.restart_warm import _warm_one  # noqa: E402

CONFIGS = ("cold", "auto", "heavy_cold", "heavy_auto")
HANG_STEP = 12
HEAVY_S = 5.0


def _spin() -> None:
    while True:
        pass


def run(runs: int, busy_levels: list[int]) -> list[dict[str, Any]]:
    rows = []
    for busy in busy_levels:
        loops = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
        for p in loops:
            p.start()
        try:
            samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
            for i in range(runs):
                for c in CONFIGS:
                    s = _warm_one(c, i, HANG_STEP, HEAVY_S)
                    samples[c].append(s)
                    print(f"warm_vs_cold: busy {busy} run {i} {c}: total {s['total']:.2f} s, worker start "
                          f"{s['worker_start']:.2f} s, load {s['loadavg']:.1f}, forked {s['forked']}, "
                          f"fallbacks {len(s['fallbacks'])}", file=sys.stderr, flush=True)
        finally:
            for p in loops:
                p.terminate()
                p.join()
        for c in CONFIGS:
            xs = samples[c]
            rows.append({"busy_loops": busy, "config": c, "runs": len(xs),
                         "total_median_s": statistics.median(x["total"] for x in xs),
                         "total_range_s": [min(x["total"] for x in xs), max(x["total"] for x in xs)],
                         "worker_start_median_s": statistics.median(x["worker_start"] for x in xs),
                         "forked": sum(1 for x in xs if x["forked"]),
                         "loadavg_median": statistics.median(x["loadavg"] for x in xs),
                         "fallbacks": sorted({f for x in xs for f in x["fallbacks"]}),
                         "per_run": [{k: x[k] for k in ("total", "worker_start", "first_step", "forked", "loadavg")}
                                     for x in xs]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| busy loops | configuration | load (median) | detected -> all stepping (median, range) | "
           "worker start (median) | forked |", "|---:|---|---:|---|---:|---:|"]
    for r in rows:
        lo, hi = r["total_range_s"]
        out.append(f"| {r['busy_loops']} | {r['config']} | {r['loadavg_median']:.1f} | {r['total_median_s']:.2f} s "
                   f"({lo:.2f}-{hi:.2f}) | {r['worker_start_median_s']:.2f} s | {r['forked']}/{r['runs']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/warm_vs_cold.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--busy", default="0,2,4", help="busy loops beside the runs, comma-separated levels")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/warm-vs-cold-<time>.json)")
    args = p.parse_args(argv)
    rows = run(args.runs, [int(x) for x in args.busy.split(",")])
    print(table(rows))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / \
        f"warm-vs-cold-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": 1, "hang_step": HANG_STEP, "heavy_import_s": HEAVY_S, "cpus": os.cpu_count(),
                               "rows": rows}, indent=1))
    print(f"warm_vs_cold: JSON written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
