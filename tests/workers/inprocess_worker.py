"""A rank of a small DDP job (gloo, CPU) run under ft_client.inprocess.Wrapper.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python inprocess_worker.py SCENARIO [--steps N]

Prints one line per event the tests wait for ("iteration I start step S", "finished",
...; the start lines, and the lines before and after the wrapped call, count the OS
threads by name). Scenarios: ok, raise (rank 1 raises at step 5 of iteration 0), hang
(rank 1 sleeps at step 5 of iteration 0 with no ping), atomic (a fault arrives while
rank 0 is inside atomic()), health (health_check fails), die (rank 1 exits at step 5),
report (rank 0 reports a fault through events.report_fault at step 5), cycles (a fault
at step 2 of every iteration until iteration 20), monitored (a RankMonitorClient with
sections `step` and, inside it, `data`; rank 1 hangs inside `data` at step 5 of
iteration 0 and its monitor daemon pushes ABORT, while rank 0 waits in DDP's all-reduce
outside `data`). ``--wait-for FILE``: every rank waits for FILE before iteration 0
trains (a forger's writes come first); ``--max-iterations N``: the Wrapper's bound.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from ft_client.inprocess import CallWrapper, Wrapper, events

SAVED_4 = "test/rank0-saved-step-4"
"""With ``raise``: rank 0 has completed and saved step 4 (rank 1 raises at step 5 only then;
else rank 0, interrupted between step 4's all-reduce and its copy, restores step 4)."""


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


CYCLE_STARTED = "cycles-started"
"""cycles: the in-process iteration rank 0 has printed its start line in."""


def wait_until(predicate: Callable[[], object], timeout: float) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds (polled every 5 ms)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def fds() -> int:
    """Open descriptors, not counting /proc files (another thread may be reading one)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith("/proc/")
        except OSError:
            pass
    return n


def os_threads() -> dict[str, int]:
    """This process's OS threads (/proc/self/task), native ones included (gloo's, a store's),
    counted by name (``comm``); threading.enumerate sees only Python's."""
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return names


def threads_line(names: dict[str, int]) -> str:
    return f"tasks {sum(names.values())} names " + ",".join(f"{k}={v}" for k, v in sorted(names.items()))


def settled_threads(limit: int, timeout: float) -> dict[str, int]:
    """The OS threads once they are at most ``limit`` (a thread that was joined may still be
    leaving the kernel for an instant), or as they are after ``timeout`` seconds."""
    wait_until(lambda: sum(os_threads().values()) <= limit, timeout)
    return os_threads()


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0])


def main() -> int:
    import faulthandler
    import logging
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests ask for a stack when a run hangs

    logging.basicConfig(level=logging.DEBUG if os.environ.get("FT_INPROCESS_DEBUG") else logging.WARNING,
                        format="%(asctime)s %(threadName)s %(name)s %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--soft-timeout", type=float, default=30.0)
    p.add_argument("--max-iterations", type=int, default=25)
    p.add_argument("--barrier-timeout", type=float, default=15.0,
                   help="how long the ranks wait for each other at the restart's barrier")
    p.add_argument("--wait-for", default=None, help="a file every rank waits for before iteration 0 trains")
    args = p.parse_args()
    scenario = args.scenario
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    saved: dict[int, dict[str, object]] = {}  # step -> the in-memory copy taken after it (the last two)
    client = None
    if scenario == "monitored":
        from ft_client import RankMonitorClient

        sockets = os.environ.get("FT_TEST_SOCKET_DIR")  # one `ft-monitor serve` per local rank (torchrun)
        client = RankMonitorClient(f"{sockets}/rank{os.environ['LOCAL_RANK']}.sock" if sockets else None)
        client.init_workload_monitoring()

    def health(call: CallWrapper) -> None:
        if scenario == "health" and rank == 0:
            raise RuntimeError("GPU 0 fell off the bus (test)")

    @Wrapper(soft_timeout=args.soft_timeout, hard_timeout=args.soft_timeout + 30, barrier_timeout=args.barrier_timeout,
             completion_timeout=30, monitor_thread_interval=0.01, health_check=health,
             max_iterations=args.max_iterations)
    def train(call: CallWrapper) -> float:
        if args.wait_for and call.iteration == 0:
            say(f"rank {rank} waits for {args.wait_for}")
            if not wait_until(lambda: os.path.exists(args.wait_for), 60):
                raise SystemExit(f"{args.wait_for} never appeared")
        call.init_process_group("gloo")
        torch.manual_seed(0)
        model = DDP(nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        start = 0
        if call.iteration > 0:
            # the ranks may have been interrupted on either side of a step: restore the
            # latest step every rank holds (a collective on the new group)
            latest = torch.tensor([max(saved, default=0)])
            dist.all_reduce(latest, op=dist.ReduceOp.MIN)
            start = int(latest.item())
            if start:
                model.module.load_state_dict(saved[start]["model"])  # type: ignore[arg-type]
                opt.load_state_dict(saved[start]["opt"])  # type: ignore[arg-type]
        say(f"rank {rank} pid {os.getpid()} iteration {call.iteration} start step {start} threads "
            f"{threading.active_count()} fds {fds()} groups {len(distributed_c10d._world.pg_map)} keys "
            f"{call.store.num_keys()} rss {rss_kb()} {threads_line(os_threads())}")
        if scenario == "cycles" and rank == 0:  # rank 1 faults once this line is out (else it may never be)
            call.store.set(CYCLE_STARTED, str(call.iteration).encode())
        loss = torch.tensor(0.0)
        for step in range(start, args.steps):
            call.ping()
            if client is not None:
                client.start_section("step")
            first = call.iteration == 0
            if scenario in ("raise", "health") and rank == 1 and first and step == 5:
                if scenario == "raise":  # the fault comes once rank 0 has saved step 4 too: restored at 5
                    call.store.wait([SAVED_4], timedelta(seconds=60))
                raise ValueError("bad batch (test)")
            if client is not None:
                client.start_section("data")
            if scenario in ("hang", "monitored") and rank == 1 and first and step == 5:
                say(f"rank {rank} hangs")
                time.sleep(3600)
            if client is not None:
                client.end_section("data")
            if scenario == "die" and rank == 1 and first and step == 5:
                os._exit(17)
            if scenario == "report" and rank == 0 and first and step == 5:
                events.report_fault(events.Fault("test fault from the monitor", 0))
                time.sleep(3600)
            if scenario == "cycles" and step == 2 and call.iteration < 20 and rank == 1:
                # rank 0's interrupt could otherwise come between its all_reduce and its start line
                if not wait_until(lambda: call.store.check([CYCLE_STARTED])
                                  and call.store.get(CYCLE_STARTED) == str(call.iteration).encode(), 60):
                    raise SystemExit(f"rank 0 never started iteration {call.iteration}")
                call.store.delete_key(CYCLE_STARTED)  # the test counts the store's keys: none left behind
                raise RuntimeError(f"fault in iteration {call.iteration}")
            if scenario == "atomic" and rank == 0 and first and step == 5:
                with call.atomic():
                    say(f"rank {rank} in atomic")
                    open(os.environ["ATOMIC_MARK"], "w").close()  # rank 1 raises now
                    if not wait_until(lambda: call._run.interrupt_pending, 30):
                        raise SystemExit("the interrupt never reached the atomic block")
                    say(f"rank {rank} interrupt deferred")
                    say(f"rank {rank} atomic done")
            if scenario == "atomic" and rank == 1 and first and step == 5:
                if not wait_until(lambda: os.path.exists(os.environ["ATOMIC_MARK"]), 30):
                    raise SystemExit("rank 0 never entered its atomic block")
                raise ValueError("fault while rank 0 is in atomic()")
            g = torch.Generator().manual_seed(step * 100 + rank)
            x = torch.randn(16, 8, generator=g)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            saved[step + 1] = {"model": {k: v.clone() for k, v in model.module.state_dict().items()},
                               "opt": copy.deepcopy(opt.state_dict())}
            saved.pop(step - 1, None)
            if scenario == "raise" and rank == 0 and first and step == 4:
                call.store.set(SAVED_4, b"1")
            if client is not None:
                client.end_section("step")
                client.send_heartbeat()
            say(f"rank {rank} iteration {call.iteration} step {step} loss {loss.item():.6f}")
        dist.barrier()
        dist.destroy_process_group()
        return float(loss.item())

    before = os_threads()
    say(f"rank {rank} before the call {threads_line(before)}")
    try:
        final = train()
    except BaseException as e:
        say(f"rank {rank} gave up: {type(e).__name__}: {e}")
        return 3
    say(f"rank {rank} finished loss {final:.6f} threads {threading.active_count()} fds {fds()} "
        f"{threads_line(settled_threads(sum(before.values()), 10.0))}")
    if client is not None:
        client.shutdown_workload_monitoring()
    return 0


if __name__ == "__main__":
    sys.exit(main())
