"""The client's overhead on a real training step: the demo's step with and without it.

One process (`--worker`) with a real daemon: the model, batch and optimizer of
examples/train_ddp.py (nn.Sequential(Linear(32, 64), ReLU, Linear(64, 1)), batches
of 64 x 32, SGD lr 0.01, MSE loss), one torch thread (as torchrun sets
OMP_NUM_THREADS=1 for several ranks per node). Single process, no process group,
no DDP: DDP's allreduce would add its own, much larger, noise and nothing the
client does. A step is forward + loss + zero_grad + backward + opt.step on one of
16 pre-made batches, timed with perf_counter_ns, in two modes:

* bare: the step alone;
* client: ``with client.section("step"): <step>`` then ``client.send_heartbeat()``
  (`step` is listed with a timeout, so both of its events are sent, as is the
  heartbeat: 3 events a step, plus an iteration report at most 5 times a second).

Blocks of BLOCK steps of each mode alternate ABBA (bare, client, client, bare, ...)
to cancel drift; each block is summarized by its median. Difference = median over
block pairs of (client block median - bare block median, the two adjacent blocks);
noise = median |difference| between consecutive blocks of the *same* mode. The
overhead is within noise when |difference| <= noise. The client calls' own time
inside the client-mode step (section enter + exit + heartbeat) is reported beside
it: the direct cost, without the noise of the step. Two variants: steps back to
back, and with a 1 ms untimed sleep between steps (the daemon goes idle between
steps, as with the demo's 50 ms steps, so each event pays for waking it).
Pinned like client_cost's cross-CPU placement: daemon on one CPU, rank on another.
Both progress modes, side by side: `record` (the default: the three calls are stores
into the shared-memory record) and `socket` (``--ft-progress-record false``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

from bench.harness import Daemon, Figure, Mode, Worker, cleanup, private_dir, say

SECTION = "step"
DAEMON_FLAGS = ("--ft-rank-heartbeat-timeout", "600", "--ft-rank-section-timeouts", f"{SECTION}:600")
VARIANTS = {"b2b": 0.0, "gap": 0.001}
"""Untimed sleep between steps, seconds."""
MODES: dict[str, tuple[str, ...]] = {"record": (), "socket": ("--ft-progress-record", "false")}


def run(mode: Mode, loop: str) -> list[Figure]:
    steps = mode.pick(2000, 300, 40)
    block = mode.pick(100, 50, 20)
    warmup = mode.pick(200, 100, 20)
    cpus = sorted(os.sched_getaffinity(0))
    pin = (cpus[0], cpus[1]) if len(cpus) >= 2 else None
    # --smoke (tests/test_bench.py; its figures mean nothing): both variants one after the other in
    # one rank process per progress mode; torch's import and first optimizer step are most of its CPU
    variants = list(VARIANTS.items())
    runs = [variants] if mode.name == "smoke" else [[v] for v in variants]
    out: list[Figure] = []
    for progress in MODES:
        for run_variants in runs:
            out += _run_one(loop, progress, run_variants, steps, block, warmup, pin)
    return out


def _run_one(loop: str, progress: str, variants: list[tuple[str, float]], steps: int, block: int, warmup: int,
             pin: tuple[int, int] | None) -> list[Figure]:
    """One daemon, one rank process: both modes of the step (bare, with the client) in it, for
    each of ``variants`` (name, seconds between steps) in turn."""
    d = private_dir()
    daemon = Daemon(d, loop, *DAEMON_FLAGS, *MODES[progress]).wait_ready()
    try:
        args = ["--socket", str(daemon.socket), "--steps", str(steps), "--block", str(block),
                "--warmup", str(warmup), "--gap", ",".join(str(gap) for _, gap in variants)]
        if pin is not None:
            os.sched_setaffinity(daemon.pid, {pin[0]})
            args += ["--cpu", str(pin[1])]
        w = Worker("bench.step_overhead", args, env={"OMP_NUM_THREADS": "1"})
        try:
            results = [w.recv(timeout=600) for _ in variants]
        finally:
            w.finish()
    finally:
        daemon.stop()
        cleanup(d)
    out: list[Figure] = []
    for (variant, gap), r in zip(variants, results, strict=True):
        if r["progress"] != progress:
            raise RuntimeError(f"the rank reported progress through the {r['progress']}, not the {progress}")
        out += figures(r, loop, variant, gap, steps, block, pin, progress)
    return out


def figures(r: dict[str, Any], loop: str, variant: str, gap: float, steps: int, block: int,
            pin: tuple[int, int] | None, progress: str = "record") -> list[Figure]:
    us = lambda xs: [x / 1000.0 for x in xs]  # noqa: E731
    bare_blocks = [statistics.median(b) / 1000 for b in r["bare"]]
    client_blocks = [statistics.median(b) / 1000 for b in r["client"]]
    diffs = [c - b for c, b in zip(client_blocks, bare_blocks)]
    same = [abs(y - x) for blocks in (bare_blocks, client_blocks) for x, y in zip(blocks, blocks[1:])]
    diff = statistics.median(diffs) if diffs else None
    noise = statistics.median(same) if same else None
    within = None if diff is None or noise is None else abs(diff) <= noise
    ci = None
    if len(diffs) >= 2:
        half = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5
        ci = [statistics.fmean(diffs) - half, statistics.fmean(diffs) + half]
    label = "back to back" if gap == 0 else f"{gap * 1000:g} ms idle between steps"
    how = (f"{steps} steps per mode in blocks of {block}, ABBA interleaved, one process, no process group/DDP, "
           f"1 torch thread; {label}; "
           + ("daemon and rank pinned to CPUs %d and %d" % pin if pin else "unpinned"))
    common = {"how": how, "variant": variant, "gap_s": gap, "placement": list(pin) if pin else None,
              "progress": progress}
    label = f"{progress}, {label}"
    variant = f"{progress}.{variant}"
    return [
        Figure(id=f"step.{variant}.bare", what=f"demo model step, no client ({label})", unit="us",
               samples=us(x for b in r["bare"] for x in b), loop=loop,
               details={**common, "block_medians_us": bare_blocks}),
        Figure(id=f"step.{variant}.client", what=f"demo model step + section + heartbeat ({label})", unit="us",
               samples=us(x for b in r["client"] for x in b), loop=loop,
               details={**common, "block_medians_us": client_blocks, "client_events_sent": r["events_sent"],
                        "connection_lost": r["lost"]}),
        Figure(id=f"step.{variant}.calls", what=f"the client calls themselves, per step ({label})", unit="us",
               samples=us(r["calls"]), loop=loop,
               details={**common, "how": how + "; inside the client-mode step: section enter + exit + heartbeat, "
                                              "each timed (two extra perf_counter_ns calls in that mode's step)"}),
        Figure(id=f"step.{variant}.noise", what=f"noise: same-mode block medians, abs. difference ({label})",
               unit="us", samples=same, loop=loop,
               details={**common, "how": how + "; abs(median of block j+1 - median of block j), both modes pooled"}),
        Figure(id=f"step.{variant}.overhead", what=f"client overhead per step, with - without ({label})",
               unit="us", samples=diffs, loop=loop, target="abs(median) <= noise median", met=within,
               details={**common, "difference_us": diff, "noise_us": noise, "mean_95ci_us": ci,
                        "how": how + "; per block pair: client block median - adjacent bare block median"}),
    ]


# -- worker side (the rank) --------------------------------------------------------
def worker(argv: list[str]) -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    a.add_argument("--steps", type=int, required=True)
    a.add_argument("--block", type=int, required=True)
    a.add_argument("--warmup", type=int, required=True)
    a.add_argument("--gap", required=True, help="seconds between steps; several, comma-separated: one run "
                   "after the other, one answer each")
    a.add_argument("--cpu", type=int, default=None)
    args = a.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    import torch
    from torch import nn

    from ft_client import RankMonitorClient

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = []
    for i in range(16):  # as the demo's batch(): x ~ N(0, 1), y = row sums
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(i))
        batches.append((x, x.sum(dim=1, keepdim=True)))
    mse = nn.functional.mse_loss

    client = RankMonitorClient(args.socket)
    client.init_workload_monitoring()
    if SECTION not in client._ipc:
        raise RuntimeError(f"section {SECTION!r} is not monitored: the daemon has {client.timeouts.to_wire()}")
    section, heartbeat = client.section, client.send_heartbeat
    pc, sleep = time.perf_counter_ns, time.sleep
    calls: list[int] = []

    def bare(n: int, k: int, gap: float) -> list[int]:
        out = [0] * n
        for i in range(n):
            x, y = batches[(k + i) % 16]
            t0 = pc()
            loss = mse(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out[i] = pc() - t0
            if gap:
                sleep(gap)
        return out

    def monitored(n: int, k: int, gap: float) -> list[int]:
        out = [0] * n
        for i in range(n):
            x, y = batches[(k + i) % 16]
            t0 = pc()
            with section(SECTION):
                t1 = pc()
                loss = mse(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                t2 = pc()
            heartbeat()
            t3 = pc()
            out[i] = t3 - t0
            calls.append(t1 - t0 + t3 - t2)  # the client's own calls: section enter, exit, heartbeat
            if gap:
                sleep(gap)
        return out

    for gap in (float(g) for g in args.gap.split(",")):
        bare(args.warmup, 0, gap)
        monitored(args.warmup, 0, gap)
        sent = 3 * args.warmup
        calls.clear()
        blocks = max(1, args.steps // args.block)
        res: dict[str, list[list[int]]] = {"bare": [], "client": []}
        for j in range(blocks):
            order = ("bare", "client") if j % 2 == 0 else ("client", "bare")
            for m in order:
                gc.collect()
                res[m].append(bare(args.block, j, gap) if m == "bare" else monitored(args.block, j, gap))
            sent += 3 * args.block
        lost = client.lost_reason
        progress = "record" if client._record is not None else "socket"
        say({**res, "calls": calls, "events_sent": sent, "lost": lost, "progress": progress})
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
