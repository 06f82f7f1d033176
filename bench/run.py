#!/usr/bin/env python3
"""Run the benchmark set, print a markdown table, save JSON.

    bench/run.py [--quick | --smoke] [--out FILE.json] [--loop auto|asyncio|uvloop|both] [--only NAME,...]

--quick finishes in under a minute, the full set in a few minutes; --smoke runs
every benchmark with minimal iterations (< 30 s, for tests/test_bench.py; its
figures mean nothing). --loop picks the daemon's event loop: figures 1, 4 and 5
run once per loop (`both` = uvloop and the stdlib loop), the others with the
first. Default: `both` for the full set, `auto` (what `ft-monitor serve` picks)
otherwise. See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"

if __name__ == "__main__":
    if VENV_PY.exists() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        os.execv(str(VENV_PY), [str(VENV_PY), *sys.argv])  # the project's interpreter, wherever we were started
    sys.path.insert(0, str(ROOT))

from bench import (  # noqa: E402
    client_cost,
    detection,
    diagnosis,
    fsdp2_snapshot,
    idle_cpu,
    import_time,
    ingest,
    lightning_cost,
    rdzv_restart,
    restart,
    restart_warm,
    sim_inprocess,
    sim_nodes,
    snapshot,
    stalled,
    startup,
    step_overhead,
)
from bench.harness import Figure, Mode, resolve_loop  # noqa: E402
from bench.report import loadavg, machine_info, markdown_table  # noqa: E402

# name -> (runs once per loop?, runner)
BENCHMARKS: dict[str, tuple[bool, Callable[..., list[Figure]]]] = {
    "import_time": (False, lambda mode, loop: import_time.run(mode)),
    "startup": (True, startup.run),
    "client_cost": (True, client_cost.run),
    "stalled": (False, stalled.run),
    "ingest": (True, ingest.run),
    "detection": (False, detection.run),
    "restart": (False, lambda mode, loop: restart.run(mode)),  # the launcher's daemons pick their own loop
    # cold vs --ft-warm-restart side by side (issue 27); the launcher's daemons pick their own loop
    "warm_restart": (False, lambda mode, loop: restart_warm.run_warm(mode)),
    # a restart's rendezvous with and without torch's first-run delay (ft_monitor/launcher/rdzv/rdzv_delay.py)
    "rdzv_restart": (False, lambda mode, loop: rdzv_restart.run(mode)),
    "step_overhead": (False, step_overhead.run),
    # issue 41: FtCallback's cost on a Lightning step, with and without it in one run
    "lightning_cost": (False, lightning_cost.run),
    "idle_cpu": (False, idle_cpu.run),
    "diagnosis": (False, lambda mode, loop: diagnosis.run(mode)),  # the launcher's daemons pick their own loop
    # the full set runs its quick variant (100 MB); the 1 GB rows: bench/snapshot.py
    "snapshot": (False, lambda mode, loop: snapshot.run(Mode("quick") if mode.name == "full" else mode, loop)),
    # issue 41: FSDP2 state (DTensors) saved and restored by snapshots, against dcp.save / dcp.load
    "fsdp2_snapshot": (False, lambda mode, loop: fsdp2_snapshot.run(Mode("quick") if mode.name == "full" else mode,
                                                                    loop)),
    # issue 28: the in-process restart's store protocol at N simulated ranks (before/after: --baseline REV there)
    "sim_inprocess": (False, lambda mode, loop: sim_inprocess.run(mode)),
    # issue 28: the launcher's store protocols at M simulated nodes, before and after (its own process: torch)
    "sim_nodes": (False, lambda mode, loop: sim_nodes.figures(mode)),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer iterations: under a minute")
    size.add_argument("--smoke", action="store_true", help="minimal iterations (tests only; figures meaningless)")
    p.add_argument("--out", default=None, help="JSON file to write (default bench/results/<mode>-<time>.json)")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop", "both"), default=None,
                   help="daemon event loop(s); default both for the full set, auto otherwise")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    args = p.parse_args(argv)

    mode = Mode("smoke" if args.smoke else "quick" if args.quick else "full")
    loop_arg = args.loop or ("both" if mode.name == "full" else "auto")
    loops = ["uvloop", "asyncio"] if loop_arg == "both" else [resolve_loop(loop_arg)]
    selected = list(BENCHMARKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in selected if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")

    started = time.time()
    t0 = time.monotonic()
    machine = machine_info(loops)
    figures: list[Figure] = []
    timings: dict[str, float] = {}
    for name in selected:
        per_loop, runner = BENCHMARKS[name]
        for loop in (loops if per_loop else loops[:1]):
            print(f"bench: {name} ({loop}) ...", file=sys.stderr, flush=True)
            t = time.monotonic()
            figures += runner(mode, loop)
            timings[f"{name}/{loop}"] = round(time.monotonic() - t, 2)
    machine["loadavg_end"] = loadavg()

    table = markdown_table(figures)
    print(table)
    result = {
        "schema": 1,
        "mode": mode.name,
        "loop": loop_arg,
        "loops": loops,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.monotonic() - t0, 2),
        "benchmark_seconds": timings,
        "machine": machine,
        "figures": [f.to_json() for f in figures],
        "table": table,
    }
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / \
        f"{mode.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nbench: {len(figures)} figures in {result['duration_s']:.0f} s; JSON written to {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
