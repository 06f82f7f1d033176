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
import random
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
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

NS = (8, 16, 32, 64, 128, 256, 512, 1024)
TARGETS = {"notify_ms": 50.0, "barrier_ms": 200.0, "total_ms": 500.0}
"""At N = 1,024 (issue 28)."""
PREFIX = "ft_inprocess/sim/0/"
ADDRESS = b"a" * 170
"""What gloo's init_process_group writes per rank (torch 2.13: one key, 170 bytes)."""
WAIT_S = 300.0
"""Bound on every wait of the harness for its ranks."""


# -- one N, in this process ----------------------------------------------------------
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
        from ft_client.signed import Signer

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


# -- many N, each in its own process ------------------------------------------------
class Worker:
    """A `worker` process: ft_client from ``tree`` (an older checkout) or this tree."""

    def __init__(self, ranks: int, tree: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "TORCHELASTIC_"))}
        env["PYTHONPATH"] = os.pathsep.join([*([str(tree)] if tree else []), str(ROOT)])
        env["FT_SIM_CHILD"] = "1"
        if os.environ.get("FT_SIM_SWITCH_INTERVAL"):
            env["FT_SIM_SWITCH_INTERVAL"] = os.environ["FT_SIM_SWITCH_INTERVAL"]
        self.log = tempfile.TemporaryFile("w+")  # torch's warnings: a pipe could fill up
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.sim_inprocess", "--worker", str(ranks)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=str(tree or ROOT))

    def recv(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the simulation worker gave no answer within {timeout:g} s (exit code "
                               f"{self.proc.poll()}): {self.log.read()[-3000:]}")
        return json.loads(line)  # type: ignore[no-any-return]

    def measure(self, n: int, incidents: int, timeout: float = 1800.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n} {incidents}\n")
        self.proc.stdin.flush()
        return self.recv(timeout)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def baseline_tree(rev: str) -> Path:
    """ft_client as of ``rev``, in a temporary directory."""
    d = Path(tempfile.mkdtemp(prefix="ft-sim-base-"))
    archive = subprocess.run(["git", "--no-optional-locks", "archive", rev, "ft_client"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
    return d


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the incidents of one N."""
    rows = result["incidents"]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    out = {k: med(k) for k in ("notify_ms", "barrier_ms", "barrier_span_ms", "total_ms", "calls", "calls_per_rank",
                               "calls_busiest_rank", "bytes", "bytes_per_rank", "server_cpu_s",
                               "server_wire_bytes")}
    out.update(n=result["n"], keys_held=max(r["keys_held"] for r in rows), keys_past=max(r["keys_past"] for r in rows),
               keys_growth=max(r["keys_growth"] for r in rows[1:]) if len(rows) > 1 else rows[0]["keys_growth"],
               quiet_calls=max(q["calls"] for q in result["quiet"]),
               quiet_server_cpu_ms=max(q["server_cpu_s"] for q in result["quiet"]) * 1000,
               floor_ms=statistics.median(result["floor_ms"]),
               rss_per_rank_kb=result["rss_per_rank_kb"], server_rss_per_rank_kb=result["server_rss_per_rank_kb"],
               calls_by_op=rows[-1]["calls_by_op"], keys_held_names=rows[-1]["keys_held_names"])
    return out


COLUMNS = (("N", "n", "{:.0f}"), ("notify ms", "notify_ms", "{:.1f}"), ("fan-out ms", "floor_ms", "{:.1f}"),
           ("barrier ms", "barrier_ms", "{:.1f}"), ("span ms", "barrier_span_ms", "{:.1f}"),
           ("total ms", "total_ms", "{:.1f}"), ("calls", "calls", "{:.0f}"), ("calls/rank", "calls_per_rank", "{:.2f}"),
           ("busiest", "calls_busiest_rank", "{:.0f}"), ("bytes/rank", "bytes_per_rank", "{:.0f}"),
           ("store CPU ms", "server_cpu_s", "{:.0f}"), ("keys held", "keys_held", "{:.0f}"),
           ("of past iterations", "keys_past", "{:.0f}"),
           ("keys +/incident", "keys_growth", "{:.0f}"), ("quiet calls", "quiet_calls", "{:.0f}"),
           ("RSS/rank KiB", "rss_per_rank_kb", "{:.0f}"))


def table(rows: list[dict[str, Any]]) -> str:
    head = ["protocol", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["protocol"]]
        for _, k, fmt in COLUMNS:
            v = r[k] * 1000 if k == "server_cpu_s" else r[k]
            cells.append(fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    styles = {p: s for p, s in zip(protocols, ("--", "-"), strict=False)} if len(protocols) > 1 else {protocols[0]: "-"}
    panels = (
        (axes[0][0], "time per incident (ms)", (("notify_ms", "fault -> every rank notified"),
                                                ("barrier_ms", "barrier (last in -> last out)"),
                                                ("total_ms", "total store protocol"),
                                                ("floor_ms", "store fan-out: one set, N waiters"))),
        (axes[0][1], "store calls per rank per incident", (("calls_per_rank", "mean"),
                                                           ("calls_busiest_rank", "busiest rank"))),
        (axes[1][0], "payload bytes per rank per incident", (("bytes_per_rank", "keys + values"),)),
        (axes[1][1], "store host CPU per incident (ms)", (("server_cpu_s", "TCPStore server process"),)),
    )
    for ax, label, series in panels:
        for i, (k, name) in enumerate(series):
            for p in protocols:
                mine = sorted((r for r in rows if r["protocol"] == p), key=lambda r: r["n"])
                ys = [r[k] * (1000 if k == "server_cpu_s" else 1) for r in mine]
                ax.plot([r["n"] for r in mine], ys, styles[p], color=f"C{i}", marker="o", markersize=3,
                        label=f"{name} ({p})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].axhline(TARGETS["notify_ms"], color="grey", lw=0.8, ls=":")
    axes[0][0].axhline(TARGETS["total_ms"], color="grey", lw=0.8, ls=":")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep(ns: list[int], incidents: int, baseline: str | None, old_incidents: int | None = None,
          old_max: int | None = None, progress: Any = None) -> list[dict[str, Any]]:
    """Every N (old then new where a baseline is named: one worker process each, both
    connected first, then taking turns N by N; the old one up to ``old_max`` ranks).
    ``progress(rows)`` after each N; a simulation that fails is reported and ends its
    protocol's sweep (the other goes on)."""
    trees: list[tuple[str, Path | None, int]] = [("new" if baseline else "this", None, max(ns))]
    if baseline:
        trees.insert(0, (f"old ({baseline[:10]})", baseline_tree(baseline), min(max(ns), old_max or max(ns))))
    workers = {name: (Worker(top, tree), top) for name, tree, top in trees}
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    try:
        for name, (w, top) in workers.items():
            print(f"sim_inprocess: {name}: {2 * top} connections in "
                  f"{w.recv(3600)['connect_s']:.0f} s", file=sys.stderr, flush=True)
        for n in ns:
            for name, (w, top) in workers.items():
                if n > top or name in failed:
                    continue
                k = old_incidents if old_incidents and name.startswith("old") else incidents
                print(f"sim_inprocess: N = {n} ({name}, {k} incidents) ...", file=sys.stderr, flush=True)
                try:
                    raw = w.measure(n, k)
                except RuntimeError as e:
                    failed[name] = f"N = {n}: {str(e)[-500:]}"
                    print(f"sim_inprocess: {name} failed at {failed[name]}", file=sys.stderr, flush=True)
                    continue
                rows.append({"protocol": name, **summary(raw), "raw": raw})
            if progress is not None:
                progress(rows)
    finally:
        for w, _ in workers.values():
            w.close()
    return rows


# -- bench/run.py -------------------------------------------------------------------------
def run(mode: Any, loop: str | None = None) -> list[Any]:
    from bench.harness import Figure

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
                                   "git_commit": _git("rev-parse", "HEAD"), "rows": rows, "table": text},
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


def _git(*args: str) -> str | None:
    out = subprocess.run(["git", "--no-optional-locks", *args], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip() if out.returncode == 0 else None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker()
        os._exit(0)  # the ranks' daemon threads may still sit in store calls
    sys.exit(main())
