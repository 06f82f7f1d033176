"""A small real DDP training run (CPU, gloo) instrumented with ft_client.

    ft-launcher --nproc-per-node 2 --max-restarts 2 --ft-cfg-path examples/ft.yaml \\
        examples/train_ddp.py --ckpt-dir /tmp/ft-demo-ckpt --hang rank=1,step=12,attempt=0

What it shows:
* `step` and `ckpt` sections and a heartbeat per step;
* learned timeouts: at every checkpoint after the first the client learns the
  step and ckpt timeouts from what all ranks observed, and keeps them in the
  checkpoint (three lines: load_state_dict, calculate_and_set_section_timeouts,
  state_dict);
* resuming from the last checkpoint after a restart;
* ``--hang rank=R,step=S,attempt=A`` (or env FT_DEMO_HANG) makes rank R hang at
  step S of attempt A (TORCHELASTIC_RESTART_COUNT; -1: every attempt), in a function named
  ``write_metrics_to_stuck_filesystem`` so the stack dump says where;
* ``--inprocess``: the training function runs under ``ft_client.inprocess.Wrapper``. Run
  it with ``--ft-on-hang inprocess``: a hang then restarts the training function in the
  same processes (from an in-memory copy of the last checkpoint every rank holds), the
  process restart staying the fallback. The hang happens in the Wrapper's first iteration only.
* ``--snapshot-every K``: every K steps each rank saves its state into memory its monitor
  keeps (``ft_client.snapshot``); after a restart (a ``kill -9``, a hang, an in-process
  restart) the ranks resume from the newest snapshot all of them hold instead of the file
  checkpoint, and say how many steps were lost.
* ``--slow rank=R,ms=M`` makes rank R spend M ms more loading every batch (a `data`
  section, outside the step's all-reduce): ft-launcher flags it as a slow rank.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ft_client
from ft_client import RankMonitorClient, observer, snapshot
from ft_client.inprocess import CallWrapper, Wrapper


def parse_spec(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    parts = dict(item.split("=", 1) for item in text.split(","))
    return {k: int(parts[k]) for k in ("rank", "step", "attempt")}


def write_metrics_to_stuck_filesystem(mode: str = "sleep") -> None:
    """Stands for an NFS write or a data-loader worker that never returns. ``mode``:
    ``sleep`` (in Python), ``gil`` (in a C call that holds the GIL: no Python thread of the
    process runs any more), ``swallow`` (in Python, swallowing every exception, even the
    in-process restart's interrupt: a bug to recover from)."""
    if mode == "gil":
        libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call
        while True:
            libc.sleep(3600)
    while True:
        try:
            time.sleep(3600)
        except BaseException:  # noqa: B036 - on purpose, see above
            if mode != "swallow":
                raise


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt-dir", default="/tmp/ft-demo-ckpt")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds of 'work' per step")
    p.add_argument("--hang", default=os.environ.get("FT_DEMO_HANG"), help="rank=R,step=S,attempt=A")
    p.add_argument("--hang-mode", choices=("sleep", "gil", "swallow"), default="sleep",
                   help="how --hang hangs: in Python, in C holding the GIL, or in Python swallowing exceptions")
    p.add_argument("--hang-where", choices=("step", "between"), default="step",
                   help="where --hang hangs: inside the step section, or between steps (after the step's "
                        "heartbeat, outside every section: the ranks waiting for it in their next step's all-reduce "
                        "time out first)")
    p.add_argument("--crash", default=None, help="rank=R,step=S,attempt=A: raise an error there")
    p.add_argument("--die", default=None, help="rank=R,step=S,attempt=A: the rank SIGKILLs itself there")
    p.add_argument("--slow", default=None, metavar="rank=R,ms=M", help="rank R loads each batch M ms slower")
    p.add_argument("--late-init", default=None, metavar="rank=R,s=S",
                   help="after a restart, rank R starts its process group S seconds after the others (a busy node)")
    p.add_argument("--control", default=os.environ.get("FT_DEMO_CONTROL"), metavar="STEP:ACTION",
                   help="local rank 0 sends a workload control request (ShutdownWorkload, ExcludeThisNode) at "
                        "STEP of the first attempt (or env FT_DEMO_CONTROL, e.g. set for one node only)")
    p.add_argument("--wait-for", default=None, metavar="FILE",
                   help="every rank waits (up to 100 s) until FILE exists before it trains: a test puts "
                        "something in place (a forged store value) before anything can read it")
    p.add_argument("--wait-at", type=int, default=None, metavar="STEP",
                   help="with --wait-for: wait after STEP of attempt 0 instead, heartbeating: a test lets "
                        "something happen beside a running job (a template finish its imports) first")
    p.add_argument("--linger-until", default=None, metavar="FILE",
                   help="after the last step every rank keeps heartbeating (up to 100 s) until FILE exists: "
                        "a test reads the live view of ranks that are still running")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="K",
                   help="save an in-memory snapshot every K steps (kept by the monitor; 0: off) and resume from it")
    p.add_argument("--inprocess", action="store_true",
                   help="run the training function under ft_client.inprocess.Wrapper (use with --ft-on-hang "
                        "inprocess)")
    args = p.parse_args()
    client = RankMonitorClient()
    # the configured process_group_timeout (checked at launch against the monitor's timeouts)
    pg_timeout = ft_client.process_group_timeout()
    if args.late_init and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        late = {k: float(v) for k, v in (item.split("=", 1) for item in args.late_init.split(","))}
        if int(late["rank"]) == int(os.environ.get("RANK", "0")):
            time.sleep(late["s"])
    if not args.inprocess:
        dist.init_process_group("gloo", timeout=pg_timeout)
        train(args, client, {}, None)
        return
    memory: dict[int, dict[str, Any]] = {}  # step -> checkpoint, the last two kept in memory across restarts

    @Wrapper(soft_timeout=600, hard_timeout=660, barrier_timeout=60, completion_timeout=60)
    def run(call: CallWrapper) -> None:
        call.init_process_group("gloo", timeout=pg_timeout)
        train(args, client, memory, call)

    run()
    client.shutdown_workload_monitoring()


def restore_point(memory: dict[int, dict[str, Any]], call: CallWrapper | None) -> dict[str, Any] | None:
    """After an in-process restart, the latest in-memory checkpoint every rank holds: a fault
    may have stopped one rank just before a checkpoint and another just after it. A
    collective on the new process group; None: none in memory (load from disk)."""
    if call is None or call.iteration == 0:
        return None
    latest = torch.tensor([max(memory, default=-1)])
    dist.all_reduce(latest, op=dist.ReduceOp.MIN)
    return memory.get(int(latest.item()))


def lost_steps(start: int, ckpt_path: Path) -> str:
    """How many steps the fault cost: the steps this rank's previous process had completed (its
    monitor's last session, read from the monitor) less the snapshot's; and what the file
    checkpoint would have cost."""
    parts = []
    try:
        last = observer.status(os.environ["FT_RANK_MONITOR_IPC_SOCKET"]).get("last_iteration")
    except (OSError, KeyError, ft_client.FtError):
        last = None
    if isinstance(last, int) and last >= start:
        parts.append(f"lost {last - start} step(s): the previous process had completed {last}")
    if ckpt_path.exists():
        on_disk = torch.load(ckpt_path, weights_only=False)["step"]
        parts.append(f"the file checkpoint is at step {on_disk}: {start - on_disk} step(s) not redone")
    return "; " + "; ".join(parts) if parts else ""


def train(args: argparse.Namespace, client: RankMonitorClient, memory: dict[int, dict[str, Any]],
          call: CallWrapper | None) -> None:
    """The training function: called once, or under the Wrapper once per in-process iteration."""
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    iteration = call.iteration if call is not None else 0
    hang = parse_spec(args.hang)
    crash = parse_spec(args.crash)
    die = parse_spec(args.die)
    slow = {k: int(v) for k, v in (item.split("=", 1) for item in args.slow.split(","))} if args.slow else None
    ckpt_path = Path(args.ckpt_dir) / "ckpt.pt"
    where = f"attempt {attempt}" + (f" iteration {iteration}" if call is not None else "")
    if args.wait_for and args.wait_at is None and attempt == 0 and iteration == 0:
        end = time.monotonic() + 100
        while not os.path.exists(args.wait_for):
            if time.monotonic() > end:
                raise SystemExit(f"[rank {rank}] {args.wait_for} did not appear within 100 s")
            time.sleep(0.05)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    start = 0
    from_snapshot = None
    if args.snapshot_every:  # also at the first start: one line says there is nothing yet
        got = snapshot.restore()  # a collective: the newest step every rank's monitor holds
        from_snapshot = got[1] if got is not None else None
    in_memory = from_snapshot or (None if args.snapshot_every else restore_point(memory, call))
    ckpt = in_memory or (torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None)
    if ckpt:
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
        client.load_state_dict(ckpt.get("ft", {}))  # learned timeouts and the iteration count, as of the checkpoint
        source = "the snapshot in the monitor's memory" if from_snapshot else "memory" if in_memory else "disk"
        print(f"[rank {rank}] {where}: resumed at step {start} (pid {os.getpid()}, from {source})"
              + (lost_steps(start, ckpt_path) if from_snapshot else ""), flush=True)
    if not client.is_initialized:
        client.init_workload_monitoring()
    learned = sorted(client.timeouts.learned)
    print(f"[rank {rank}] {where}: timeouts in force {client.timeouts.describe()}"
          + (f" (learned: {', '.join(learned)})" if learned else ""), flush=True)

    def hang_now(step: int) -> bool:
        return bool(hang) and (rank, step) == (hang["rank"], hang["step"]) and hang["attempt"] in (attempt, -1) \
            and iteration == 0

    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        # Data loading is a section of its own: it is the rank's own work, while the step
        # waits for the slowest rank in DDP's all-reduce (so step times are all alike).
        with client.section("data"):
            x, y = batch(step, rank)
            if slow and rank == slow["rank"]:
                time.sleep(slow["ms"] / 1000)
        with client.section("step"):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_time)
            if hang_now(step) and args.hang_where == "step":
                print(f"[rank {rank}] {where}: hanging at step {step} (on purpose)", flush=True)
                write_metrics_to_stuck_filesystem(args.hang_mode)
        client.send_heartbeat()
        if args.snapshot_every and (step + 1) % args.snapshot_every == 0:
            snapshot.save(step + 1, {"model": model.module, "opt": opt, "step": step + 1, "ft": client.state_dict()})
        if args.wait_for and args.wait_at == step and attempt == 0 and iteration == 0:
            end = time.monotonic() + 100
            while not os.path.exists(args.wait_for) and time.monotonic() < end:
                client.send_heartbeat()
                time.sleep(0.05)
        if hang_now(step) and args.hang_where == "between":
            print(f"[rank {rank}] {where}: hanging after step {step}, outside every section (on purpose)", flush=True)
            write_metrics_to_stuck_filesystem(args.hang_mode)
        if crash and (rank, step) == (crash["rank"], crash["step"]) and crash["attempt"] in (attempt, -1) \
                and iteration == 0:
            raise RuntimeError(f"rank {rank} crashed at step {step} (on purpose)")
        if die and (rank, step) == (die["rank"], die["step"]) and die["attempt"] in (attempt, -1):
            print(f"[rank {rank}] {where}: killing myself at step {step} (on purpose)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.control and attempt == 0:
            at, action = args.control.split(":")
            if step == int(at) and os.environ.get("LOCAL_RANK") == "0":
                client.send_workload_control_request(action, f"demo: requested at step {step}")
                time.sleep(3600)  # the launcher stops us
        if (step + 1) % args.ckpt_every == 0:
            # Learn timeouts from what every rank observed (a collective); not
            # enough data yet (no checkpoint section completed) is not an error.
            client.calculate_and_set_section_timeouts(calc_out_of_section=False, skip_if_not_ready=True)
            with client.section("ckpt"), call.atomic() if call is not None else contextlib.nullcontext():
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                         "ft": client.state_dict()}
                if call is not None:
                    memory[step + 1] = copy.deepcopy(state)
                    memory.pop(step + 1 - 2 * args.ckpt_every, None)
                if rank == 0:
                    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = ckpt_path.with_suffix(".tmp")
                    torch.save(state, tmp)
                    os.replace(tmp, ckpt_path)
                dist.barrier()
    print(f"[rank {rank}] {where}: finished {args.steps} steps, loss {loss.item():.4f} (pid {os.getpid()})",
          flush=True)
    if args.linger_until:
        end = time.monotonic() + 100
        while not os.path.exists(args.linger_until) and time.monotonic() < end:
            client.send_heartbeat()
            time.sleep(0.05)
    if args.snapshot_every:
        snapshot.wait()  # the last save's copy to the partner uses a process group: finish it first
    dist.destroy_process_group()
    if call is None:
        client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
