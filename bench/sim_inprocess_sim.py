"""The simulation of bench/sim_inprocess.py, in one process: N simulated ranks (threads
running the Wrapper's own store, watcher, fault report, barrier and cleanup) against one real
TCPStore server, whose connections a `Pool` makes once and every N reuses; `worker` is the
``--worker MAX_N`` process that measures N after N for the harness."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import Counter
from typing import Any

PREFIX = "ft_inprocess/sim/0/"
ADDRESS = b"a" * 170
"""What gloo's init_process_group writes per rank (torch 2.13: one key, 170 bytes)."""
WAIT_S = 300.0
"""Bound on every wait of the harness for its ranks."""


class SimRank:
    """One simulated rank: the Wrapper's store, run state and watcher, on threads."""

    def __init__(self, sim: Sim, rank: int) -> None:
        from bench.simstore import CountingStore, Tally
        from ft_client.inprocess.call import Run
        from ft_client.inprocess.store import RestartStore

        self.sim = sim
        self.tally = Tally()
        base = CountingStore(sim.pool.clients[2 * rank], self.tally, spare=sim.pool.clients[2 * rank + 1])
        self.run = Run(RestartStore(base, sim.n, sim.signer, rank=rank, prefix=sim.prefix, attempt_id="0"), rank,
                       sim.n)
        if self.run.watch is None:
            raise RuntimeError("the store cannot be cloned: no watcher")
        self.stamps: list[dict[str, float]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.main, name=f"sim-rank-{rank}", daemon=True)

    def main(self) -> None:
        from ft_client.inprocess import interrupt, recovery
        from ft_client.inprocess.call import CallWrapper
        from ft_client.inprocess.store import GLOO_DEFAULT_GROUP_KEY

        run, sim = self.run, self.sim
        try:
            while True:
                run.new_iteration(sockets=set())
                call = CallWrapper(run, run.iteration)
                call.store.set(f"{GLOO_DEFAULT_GROUP_KEY}{run.rank}", ADDRESS)  # re-entry: the group's address key
                stop = threading.Event()
                watcher = threading.Thread(target=interrupt.watch, args=(run, run.watch, run.iteration, stop),
                                           name=f"sim-watch-{run.rank}", daemon=True)
                watcher.start()
                sim.entered(run.iteration)
                while not run.wake.wait(1.0) and not sim.finished:  # the monitor thread: no store call
                    pass
                if sim.finished or run.fault is None:
                    stop.set()
                    watcher.join(5)  # it returns on the done outcome (`close`)
                    return
                interrupt.handle_fault(sim.cfg, run, call)  # the abort notice, then the (no-op) abort hook
                stop.set()
                watcher.join(WAIT_S)
                run.times["left"] = run.times["finalized"] = time.time()
                arrived = time.time()
                recovery.rejoin(sim.cfg, run, run.fault)
                self.stamps.append({"seen": run.times["seen"], "in": arrived, "out": run.times["barrier"],
                                    "done": time.time()})
        except BaseException as e:  # noqa: BLE001 - reported by the harness
            self.error = e
            sim.entered(-1)


class Sim:
    """N simulated ranks, one real store server; `incident()` measures one fault."""

    def __init__(self, pool: Pool, n: int, seed: int = 0) -> None:
        import logging

        from ft_client.inprocess.config import WrapperConfig
        from ft_client.store.signed import Signer

        logging.getLogger("ft_client.inprocess").setLevel(logging.ERROR)  # one restart line per rank otherwise
        if 2 * n > len(pool.clients):
            raise ValueError(f"{n} ranks need {2 * n} connections; the pool has {len(pool.clients)}")
        pool.sims += 1
        self.pool, self.n, self.server, self.control = pool, n, pool.server, pool.control
        self.prefix = f"{PREFIX}{pool.sims}/"
        self.random = random.Random(seed)
        self.signer = Signer(os.urandom(32), "sim")
        self.cfg = WrapperConfig(abort=lambda call: None, barrier_timeout=WAIT_S, completion_timeout=WAIT_S)
        self.finished = False
        self._lock = threading.Lock()
        self._entered: Counter[int] = Counter()
        self.rss_before = _rss_kb()
        threading.stack_size(512 * 1024)
        self.ranks = [SimRank(self, r) for r in range(n)]
        self.floor_ms = [self.fanout_floor(i) for i in range(3)]
        for r in self.ranks:
            r.thread.start()
        self.iteration = 0
        self.wait_ready()
        self.rss_ranks_kb = _rss_kb() - self.rss_before  # threads and the Wrapper's objects (connections: Pool)

    def entered(self, iteration: int) -> None:
        with self._lock:
            self._entered[iteration] += 1

    def _check(self) -> None:
        for r in self.ranks:
            if r.error is not None:
                raise RuntimeError(f"simulated rank {r.run.rank} failed: {r.error!r}") from r.error

    def wait_ready(self) -> None:
        """Every rank entered the current iteration and its watcher is blocked in the store."""
        from bench.simstore import wait_until

        def ready() -> bool:
            self._check()
            return self._entered[self.iteration] == self.n and sum(r.tally.waiting for r in self.ranks) >= self.n

        wait_until(ready, WAIT_S, f"{self.n} ranks in iteration {self.iteration} with their watchers waiting")

    def fanout_floor(self, i: int) -> float:
        """One set waking N waiters, each then reading the key (wait + get, as a watcher
        does, without the signature): ms until the last has the value."""
        from bench.simstore import CountingStore, Tally, wait_until

        key, tally, done = f"{self.prefix}floor/{i}", Tally(), [0.0] * self.n

        def waiter(r: int) -> None:
            s = CountingStore(self.ranks[r].run.watch.base.inner, tally)  # type: ignore[union-attr]
            s.wait([key])
            s.get(key)
            done[r] = time.perf_counter()

        threads = [threading.Thread(target=waiter, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        wait_until(lambda: tally.waiting >= self.n, WAIT_S, "the fan-out's waiters")
        t0 = time.perf_counter()
        self.control.set(key, b"x" * 200)
        for t in threads:
            t.join(WAIT_S)
        self.control.delete_key(key)
        return (max(done) - t0) * 1000

    def tallies(self) -> tuple[list[Counter[str]], list[int]]:
        snaps = [r.tally.snapshot() for r in self.ranks]
        return [s[0] for s in snaps], [s[1] + s[2] for s in snaps]

    def keys(self) -> list[str]:
        return [k for k in self.control.list_keys() if k.startswith(self.prefix)]

    def quiet(self, seconds: float) -> dict[str, float]:
        """Store calls and server CPU while every rank trains (watchers waiting)."""
        calls0, _ = self.tallies()
        s0 = self.server.reading()
        time.sleep(seconds)  # a measurement window, not a wait for readiness
        calls1, _ = self.tallies()
        s1 = self.server.reading()
        return {"calls": sum(sum((c1 - c0).values()) for c0, c1 in zip(calls0, calls1, strict=True)),
                "server_cpu_s": s1.cpu_s - s0.cpu_s, "seconds": seconds}

    def incident(self) -> dict[str, Any]:
        from ft_client.inprocess import events, interrupt

        keys_before = len(self.keys())
        calls0, bytes0 = self.tallies()
        s0 = self.server.reading()
        culprit = self.ranks[self.random.randrange(self.n)].run
        culprit.waiting = False  # the hung rank was outside every collective
        interrupt.on_reported_fault(culprit, events.Fault(f"rank {culprit.rank}: simulated hang", culprit.rank,
                                                          self.iteration, "monitor"))
        fault = culprit.fault
        if fault is None:
            raise RuntimeError(f"rank {culprit.rank} did not take the reported fault: its iteration "
                               f"{culprit.iteration}, the simulation's {self.iteration}, outcome in the store "
                               f"{culprit.store.outcome(self.iteration)!r}")
        self.iteration += 1
        self.wait_ready()
        calls1, bytes1 = self.tallies()
        s1 = self.server.reading() - s0
        keys = self.keys()
        stamps = [r.stamps[-1] for r in self.ranks]
        per_rank = [sum((c1 - c0).values()) for c0, c1 in zip(calls0, calls1, strict=True)]
        per_rank_bytes = [b1 - b0 for b0, b1 in zip(bytes0, bytes1, strict=True)]
        ops: Counter[str] = Counter()
        for c0, c1 in zip(calls0, calls1, strict=True):
            ops += c1 - c0
        last_in = max(s["in"] for s in stamps)
        return {
            "notify_ms": (max(s["seen"] for s in stamps) - fault.time) * 1000,
            "barrier_ms": (max(s["out"] for s in stamps) - last_in) * 1000,
            "barrier_span_ms": (max(s["out"] for s in stamps) - min(s["in"] for s in stamps)) * 1000,
            "total_ms": (max(s["done"] for s in stamps) - fault.time) * 1000,
            "calls": sum(per_rank), "calls_per_rank": sum(per_rank) / self.n, "calls_busiest_rank": max(per_rank),
            "calls_by_op": dict(ops),
            "bytes": sum(per_rank_bytes), "bytes_per_rank": sum(per_rank_bytes) / self.n,
            "server_cpu_s": s1.cpu_s, "server_wire_bytes": s1.rchar + s1.wchar, "server_syscalls": s1.syscr + s1.syscw,
            "keys_held": len(keys), "keys_growth": len(keys) - keys_before,
            "keys_past": sum(_iteration_of(k.removeprefix(self.prefix)) < self.iteration for k in keys),
            "keys_held_names": sorted({_shape(k.removeprefix(self.prefix)) for k in keys}),
        }

    def close(self) -> None:
        """Every rank completes the iteration (`RestartStore.complete`: its watcher returns
        on the ``done`` outcome), then the server stops."""
        self.finished = True
        try:
            for r in self.ranks:
                if r.error is None:
                    r.run.store.complete(r.run.iteration)
        finally:
            for r in self.ranks:
                r.run.wake.set()
            for r in self.ranks:
                r.thread.join(5)
            for key in self.keys():  # what the last iteration leaves (the Wrapper's call would end here)
                self.control.delete_key(key)


def _shape(key: str) -> str:
    """A key's name with its numbers replaced (``.../iter/3/barrier/17`` -> ``.../iter/N/barrier/N``)."""
    return "/".join("N" if part.isdigit() else part for part in key.split("/"))


def _iteration_of(key: str) -> int:
    """The iteration of a key of the Wrapper's space (``iter/<N>/...``)."""
    parts = key.split("/")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "iter" and parts[1].isdigit() else -1


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Pool:
    """The store server and 2 connections per rank for up to ``ranks`` ranks, made once and
    reused by every N (bench/simstore.py `connect` says why)."""

    def __init__(self, ranks: int) -> None:
        from bench.simstore import StoreServer, connect

        t0 = time.monotonic()
        rss0 = _rss_kb()
        self.server = StoreServer()
        server0 = self.server.reading()
        self.control = self.server.client()  # the harness's own reads (keys): not counted
        self.clients = connect(self.server, 2 * ranks)
        self.sims = 0
        self.connect_s = time.monotonic() - t0
        self.rss_per_rank_kb = (_rss_kb() - rss0) / ranks
        self.server_rss_per_rank_kb = (self.server.reading().rss_kb - server0.rss_kb) / ranks

    def close(self) -> None:
        self.server.stop()


def simulate(pool: Pool, n: int, incidents: int, quiet_s: float = 0.3, seed: int = 0) -> dict[str, Any]:
    """N ranks, ``incidents`` faults (one after another), in this process."""
    t0 = time.monotonic()
    sim = Sim(pool, n, seed)
    try:
        setup_s = time.monotonic() - t0
        quiet, rows = [], []
        for _ in range(incidents):
            quiet.append(sim.quiet(quiet_s))
            rows.append(sim.incident())
        return {"n": n, "incidents": rows, "quiet": quiet, "floor_ms": sim.floor_ms, "setup_s": setup_s,
                "rss_per_rank_kb": sim.rss_ranks_kb / n + pool.rss_per_rank_kb,
                "server_rss_per_rank_kb": pool.server_rss_per_rank_kb, "connect_s": pool.connect_s,
                "threads": threading.active_count(), "loadavg": list(os.getloadavg())}
    finally:
        sim.close()


def worker() -> None:
    """``--worker MAX_N``: a pool for MAX_N ranks, then one JSON line per ``N INCIDENTS`` line read."""
    if os.environ.get("FT_SIM_SWITCH_INTERVAL"):  # the GIL's hand-over interval among 2N threads (default 5 ms)
        sys.setswitchinterval(float(os.environ["FT_SIM_SWITCH_INTERVAL"]))
    pool = Pool(int(sys.argv[2]))
    print(json.dumps({"ready": True, "connect_s": pool.connect_s}), flush=True)
    try:
        for line in sys.stdin:
            n, incidents = (int(x) for x in line.split())
            print(json.dumps(simulate(pool, n, incidents)), flush=True)
    finally:
        pool.close()
