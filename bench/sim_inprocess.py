#!/usr/bin/env python3
"""Scale of the in-process restart's store protocol (issue 28): N = 8 ... 1,024 simulated
ranks against one real TCPStore, driving the Wrapper's own code.

    bench/sim_inprocess.py [--quick | --smoke] [--ns 8,64,1024] [--incidents K]
                           [--baseline REV] [--out FILE.json] [--plot FILE.png]

Each simulated rank is a thread with what a rank of the Wrapper has in the store: a
`RestartStore` over its own TCPStore connection (a `CountingStore`, bench/simstore.py) and
the `Run` that clones a second connection for its watcher thread. Per iteration it does
what `wrapper._one_iteration` does around the store: writes the one address key that
gloo's ``init_process_group`` writes per rank on `CallWrapper.store` (the re-entry), starts
the real watcher (`interrupt.watch`: blocked in the store's wait while "training") and waits
on ``run.wake`` as the monitor thread does. One incident: one rank's monitor reports a hang
(`interrupt.on_reported_fault`, as the control thread does on ABORT; that rank was outside
every collective); every rank's watcher wakes it, it runs `interrupt.handle_fault` (the
abort notice and a no-op abort hook: there is no process group) and then
`recovery.rejoin` (the restart barrier, the `outside` claim, the old keys deleted, the step
into the next iteration), and enters the next iteration. What is not simulated: the abort
hook's and finalize's own work, gc, the signal to the main thread, and gloo's own
rendezvous after re-entry (torch's protocol, not ours).

Per incident (medians over K incidents per N): fault -> every rank notified (the last
rank's ``run.times["seen"]`` - the fault record's time), the barrier (last rank out - last
rank in) and its span (last out - first in), the total (fault -> every rank past the
barrier and the cleanup), store calls and payload bytes (all ranks, per rank, the busiest
rank), the server's CPU seconds and wire bytes (/proc), keys held in the store once every
rank is back in the next iteration and their growth per incident, and store calls and
server CPU during a quiet window while every rank "trains" (polling). Per N also: the
store's own fan-out (one set waking N waiters, each then reading the key: the floor of
any notification), and memory (RSS of the ranks' process and of the server, per rank).

The simulation runs in a worker process with its own store server and 2 connections per
rank made once (`Pool`: TCPStore connects stall here) and reused by every N, each N under
its own key prefix. ``--baseline REV`` starts a second worker with ft_client as of REV
(``git archive``) and the two take turns N by N: old vs new side by side under the same
load (``--old-max``: the old one only up to that N). ``FT_SIM_SWITCH_INTERVAL`` sets the
workers' GIL hand-over interval (``sys.setswitchinterval``), for experiments. Prints a table, writes JSON (default
bench/results/sim-inprocess-<time>.json) and draws the curves (matplotlib; default
docs/images/sim_inprocess.png). bench/run.py runs it as ``sim_inprocess`` (this tree only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    VENV_PY = ROOT / ".venv" / "bin" / "python"
    if not os.environ.get("FT_SIM_CHILD") and VENV_PY.exists() and \
            Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        os.execv(str(VENV_PY), [str(VENV_PY), *sys.argv])
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))

from bench.sim_inprocess_sim import worker  # noqa: E402 - the --worker process imports no more (its ft_client may be old)

NS = (8, 16, 32, 64, 128, 256, 512, 1024)


# -- bench/run.py -------------------------------------------------------------------------
def run(mode: Any, loop: str | None = None) -> list[Any]:
    from bench.harness import Figure
    from bench.sim_inprocess_report import TARGETS
    from bench.sim_inprocess_sweep import sweep

    ns = mode.pick(list(NS), [8, 64, 256], [8, 16])
    rows = sweep(ns, mode.pick(7, 3, 2), None)
    figures = []
    for r in rows:
        n = r["n"]
        big = n == 1024
        for key, what, unit in (("notify_ms", "fault -> every rank notified", "ms"),
                                ("barrier_ms", "restart barrier (last in -> last out)", "ms"),
                                ("total_ms", "store protocol of one restart", "ms")):
            samples = [i[key] for i in r["raw"]["incidents"]]
            target = f"<= {TARGETS[key]:g} ms at N=1024" if big else "-"
            figures.append(Figure(f"sim.inprocess.n{n}.{key.removesuffix('_ms')}", f"in-process sim N={n}: {what}",
                                  unit, samples, target=target, limit=TARGETS[key] if big else None))
        figures.append(Figure(f"sim.inprocess.n{n}.calls_per_rank", f"in-process sim N={n}: store calls per rank "
                              "per incident", "", [i["calls_per_rank"] for i in r["raw"]["incidents"]]))
        figures.append(Figure(f"sim.inprocess.n{n}.keys_growth", f"in-process sim N={n}: keys left per incident",
                              "", value=r["keys_growth"], target="0", met=r["keys_growth"] <= 0))
        figures.append(Figure(f"sim.inprocess.n{n}.quiet_calls", f"in-process sim N={n}: store calls while "
                              "training (polling)", "", value=r["quiet_calls"], target="0",
                              met=r["quiet_calls"] == 0, details={k: v for k, v in r.items() if k != "raw"}))
    return figures


def main(argv: list[str] | None = None) -> int:
    from bench.report import git
    from bench.sim_inprocess_report import plot, table
    from bench.sim_inprocess_sweep import sweep

    p = argparse.ArgumentParser(prog="bench/sim_inprocess.py", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="N = 8, 64, 256; 3 incidents")
    size.add_argument("--smoke", action="store_true", help="N = 8, 16; 2 incidents")
    p.add_argument("--ns", default=None, help="comma-separated N (default 8 ... 1024)")
    p.add_argument("--incidents", type=int, default=None, help="incidents per N (default 7)")
    p.add_argument("--baseline", default=None, help="a git revision: measure its ft_client too, N by N")
    p.add_argument("--old-incidents", type=int, default=None, help="incidents per N for the baseline")
    p.add_argument("--old-max", type=int, default=None, help="largest N for the baseline (its cost is O(N^2))")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/sim-inprocess-<time>.json)")
    p.add_argument("--plot", default=str(ROOT / "docs" / "images" / "sim_inprocess.png"), help="PNG file")
    args = p.parse_args(argv)
    ns = [int(x) for x in args.ns.split(",")] if args.ns else [8, 16] if args.smoke else [8, 64, 256] \
        if args.quick else list(NS)
    incidents = args.incidents or (2 if args.smoke else 3 if args.quick else 7)
    started = time.time()
    load_start = os.getloadavg()
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / \
        f"sim-inprocess-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(rows: list[dict[str, Any]]) -> str:
        load_end = os.getloadavg()
        text = table(rows)
        out.write_text(json.dumps({"schema": 1, "ns": ns, "incidents": incidents, "baseline": args.baseline,
                                   "loadavg_start": load_start, "loadavg_end": load_end, "cores": os.cpu_count(),
                                   "git_commit": git("rev-parse", "HEAD"), "rows": rows, "table": text},
                                  indent=1) + "\n")
        load = f"load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end"
        if rows:
            plot(rows, Path(args.plot), f"in-process restart store protocol, {os.cpu_count()} cores, {load}")
        return load

    rows = sweep(ns, incidents, args.baseline, args.old_incidents, args.old_max, write)
    load = write(rows)
    print(table(rows))
    print(f"\n{load}", file=sys.stderr)
    print(f"JSON written to {out}; curves to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker()
        os._exit(0)  # the ranks' daemon threads may still sit in store calls
    sys.exit(main())
