#!/usr/bin/env python3
"""Issue 28, across nodes: M simulated launchers (threads of this process) against ONE real
torch.distributed TCPStore (its own process), driving the launcher's own protocol code.

    bench/sim_nodes.py [--quick | --smoke] [--nodes 2,4,...,128] [--incidents K] [--out FILE.json] [--plot DIR]

Each simulated node is what ft-launcher's agent is to the store, minus the processes:
its own TCPStore client, a rendezvous handler built the way torchrun builds it for
``--rdzv-backend c10d`` (`C10dRendezvousBackend` + `dynamic_rendezvous.create_handler`; the
store server is not any node's: ``is_host`` false) and torch's `_assign_worker_ranks`, a
WorkerGroup with the round's store, and the agent's `NodeMessages` (crossnode.py), a
`RollCaller` (rollcall.py, whose monitors are replaced by evidence returned after a set
delay: the seam is `RollCaller.local`) and the slow-rank exchange. Per incident:

1. a rank on node h hangs; the other nodes' ranks waiting for it time out 50-300 ms later
   (every other node; the rest keep running and answer from their monitor loop, every
   0.1 s): each reporting node runs `exchange_hang_records` + `decide.first_hang`;
2. the node that hung first takes the roll call (`RollCaller.run`), the victims answer it
   as hangs.py does (`answer_pending(wait=...)`), the others from their loop;
3. every node joins the next rendezvous round (`next_rendezvous` + `_assign_worker_ranks`,
   as the agent's `_rendezvous`), and with the new protocols `leave_round` tidies the last;
4. the slow-rank exchange, twice (the second is the steady state).

Every store operation of a node goes through a counting wrapper (operations and bytes, keys
and values both ways); the keys the protocols wrote in the incident's round are checked
afterwards (left), and the store's own count (`num_keys`) tells torch's keys from ours;
the store host's CPU comes from /proc/PID/stat. Then an idle spell: every node's monitor
loop (roll call polls, shutdown check) for a few seconds: store operations per second
while training runs.

``--protocols`` before,after: "before" is the code of commit BEFORE (755bffb, loaded from
git), "after" the working tree's; both run in the same invocation, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import types
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

BEFORE = "755bffb"
"""The commit whose launcher protocols are the "before" rows (issue 28's starting point)."""
SECRET = b"sim-nodes-job-secret-0123456789abcdef"
RUN_ID = "sim"
MONITOR_INTERVAL = 0.1
"""torchrun's --monitor-interval default: how often an idle node's monitor loop runs."""
STACK = "".join(f'  File "/job/train.py", line {100 + i} in layer_{i}\n' for i in range(24))
STACK = f"Thread 0x00007f0000000000 (most recent call first):\n{STACK}"


# -- the store host ----------------------------------------------------------------
SERVER = """
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
print(s.port, flush=True)
sys.stdin.read()
"""


class StoreHost:
    """A TCPStore server in its own process (nobody's node), and its CPU from /proc."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: the server prints its port or dies (EOF)
        if not line.strip().isdigit():
            raise RuntimeError(f"the store host did not start: {line!r}")
        self.port = int(line)
        from torch.distributed import TCPStore

        self.client = TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=60))

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def num_keys(self) -> int:
        return int(self.client.num_keys())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- counting ---------------------------------------------------------------------
def _len(v: Any) -> int:
    return len(v) if isinstance(v, (bytes, bytearray, str)) else 8


class Counter:
    """Store operations and bytes (keys and values, both ways) of one node."""

    def __init__(self) -> None:
        self.ops: Tally[str] = Tally()
        self.bytes = 0
        self.lock = threading.Lock()

    def count(self, op: str, nbytes: int) -> None:
        with self.lock:
            self.ops[op] += 1
            self.bytes += nbytes

    def total(self) -> tuple[int, int]:
        with self.lock:
            return sum(self.ops.values()), self.bytes

    def by_op(self) -> dict[str, int]:
        with self.lock:
            return dict(self.ops)


class CountingStore:
    """A store client's Python face, counted: what the protocols call on ``wg.store``."""

    def __init__(self, inner: Any, counter: Counter, written: set[str] | None = None) -> None:
        self.inner = inner
        self.counter = counter
        self.written = written if written is not None else set()

    def set(self, key: str, value: Any) -> None:
        self.written.add(key)
        self.counter.count("set", _len(key) + _len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        out: bytes = self.inner.get(key)
        self.counter.count("get", _len(key) + len(out))
        return out

    def add(self, key: str, n: int) -> int:
        self.written.add(key)
        self.counter.count("add", _len(key) + 16)
        return int(self.inner.add(key, n))

    def append(self, key: str, value: Any) -> None:
        self.written.add(key)
        self.counter.count("append", _len(key) + _len(value))
        self.inner.append(key, value)

    def check(self, keys: list[str]) -> bool:
        self.counter.count("check", sum(map(_len, keys)))
        return bool(self.inner.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out: list[bytes] = self.inner.multi_get(keys)
        self.counter.count("multi_get", sum(map(_len, keys)) + sum(map(len, out)))
        return out

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.written.update(keys)
        self.counter.count("multi_set", sum(map(_len, keys)) + sum(map(_len, values)))
        self.inner.multi_set(keys, values)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.written.add(key)
        out: bytes = self.inner.compare_set(key, expected, desired)
        self.counter.count("compare_set", _len(key) + _len(expected) + _len(desired) + len(out))
        return out

    def delete_key(self, key: str) -> bool:
        self.counter.count("delete_key", _len(key))
        return bool(self.inner.delete_key(key))

    def wait(self, keys: list[str], *args: Any) -> None:
        self.counter.count("wait", sum(map(_len, keys)))
        self.inner.wait(keys, *args)

    def num_keys(self) -> int:
        self.counter.count("num_keys", 0)
        return int(self.inner.num_keys())

    def __getattr__(self, name: str) -> Any:  # timeout, set_timeout, ...: not store operations
        return getattr(self.inner, name)


# -- the protocols: the working tree's, and BEFORE's from git ------------------------------
@dataclass
class Protocol:
    name: str
    node_messages: type
    roll_caller: type
    step_exchange: Callable[[SimNode, str, dict[int, float]], dict[int, float]]
    tidies: bool
    """Whether the node deletes its keys of the previous round (leave_round)."""


def _module(name: str, source: str, origin: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = origin
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(source, origin, "exec"), mod.__dict__)  # noqa: S102 - the project's own code at BEFORE
    return mod


def protocol_before(ref: str = BEFORE) -> Protocol | None:
    """The launcher's protocols as they were at ``ref`` (None where git cannot show them)."""

    def source(path: str) -> str:
        out = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise FileNotFoundError(out.stderr.strip())
        return out.stdout

    try:
        wire = _module("ft_sim_before.rollcall_wire", source("ft_monitor/launcher/incident/rollcall_wire.py"),
                       f"{ref}:rollcall_wire.py")
        import ft_monitor.launcher.incident.rollcall_wire as current
        sys.modules["ft_monitor.launcher.incident.rollcall_wire"] = wire  # the old roll call imports the old wire
        try:
            rollcall = _module("ft_sim_before.rollcall", source("ft_monitor/launcher/incident/rollcall.py"),
                               f"{ref}:rollcall.py")
        finally:
            sys.modules["ft_monitor.launcher.incident.rollcall_wire"] = current
        crossnode = _module("ft_sim_before.crossnode", source("ft_monitor/launcher/incident/crossnode.py"),
                            f"{ref}:crossnode.py")
        telemetry = _module("ft_sim_before.telemetry", source("ft_monitor/launcher/telemetry/telemetry.py"),
                            f"{ref}:telemetry.py")
    except (FileNotFoundError, OSError, subprocess.SubprocessError) as e:
        print(f"sim_nodes: no 'before' protocols ({ref}): {e}", file=sys.stderr)
        return None

    def step(node: SimNode, section: str, local: dict[int, float]) -> dict[int, float]:
        # Telemetry._exchange of BEFORE, on the state it keeps (no Telemetry needed)
        state = types.SimpleNamespace(job_secret=SECRET, monotonic=time.monotonic, _exchanged_at=-1e18,
                                      host=node.host, remote_medians={}, _bad_values=set())
        telemetry.Telemetry._exchange(state, node.wg, section, local)
        return dict(state.remote_medians)

    return Protocol("before", crossnode.NodeMessages, rollcall.RollCaller, step, tidies=False)


def protocol_after() -> Protocol:
    from ft_monitor.launcher.incident.crossnode import NodeMessages
    from ft_monitor.launcher.incident.rollcall import RollCaller
    from ft_monitor.launcher.store.step_exchange import exchange_step_times

    def step(node: SimNode, section: str, local: dict[int, float]) -> dict[int, float]:
        medians, listed = exchange_step_times(node.wg.store, node.channel, node.wg.group_rank,
                                              node.wg.group_world_size, section, local, node.host, set(),
                                              listed=node.step_listed is node.wg)
        node.step_listed = node.wg if listed else None  # as Telemetry keeps it, per round
        return medians

    return Protocol("after", NodeMessages, RollCaller, step, tidies=True)


def sim_roll_caller(base: type, host: str, delay: float, timeout: float) -> Any:
    """``base`` (a RollCaller) whose monitors are evidence returned after ``delay`` seconds."""
    from ft_monitor.launcher.incident.diagnosis import ANSWERED, RankEvidence
    from ft_monitor.launcher.store.sealed import Sealer

    class SimRollCaller(base):  # type: ignore[valid-type, misc]
        def local(self, ranks: list[Any], incident: int, budget: float) -> list[Any]:
            time.sleep(max(0.0, min(delay, budget)))
            return [RankEvidence(r.global_rank, host, ANSWERED, r.local_rank, r.pid, "step", 100, STACK)
                    for r in ranks]

    return SimRollCaller(lambda lr: Path("/nonexistent"), host, timeout, False, sealer=Sealer(SECRET))


# -- a simulated node ---------------------------------------------------------------
@dataclass
class NodeResult:
    hang_s: float | None = None
    first_rank: int | None = None
    owner: bool = False
    rollcall_s: float | None = None
    answered_nodes: int | None = None
    missing_ranks: int | None = None
    rdzv_start: float = 0.0
    rdzv_end: float = 0.0
    step_s: float | None = None
    step_medians: int | None = None
    errors: list[str] = field(default_factory=list)


class SimNode:
    def __init__(self, index: int, nodes: int, ranks_per_node: int, port: int, proto: Protocol,
                 timeout: float, rendezvous: str = "c10d") -> None:
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        self.index = index
        self.host = f"node{index:03d}"
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.proto = proto
        self.counter = Counter()
        self.rdzv_counter = Counter()
        self.delay = 0.05 + 0.15 * ((index * 37) % nodes) / nodes
        """The simulated monitors' answer time (a stack dump): 50-200 ms."""
        self.client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=RUN_ID, min_nodes=nodes,
                                      max_nodes=nodes, local_addr=self.host, is_host=False, join_timeout=600)
        # what c10d_rendezvous_backend.create_backend + registry do, with the backend's store counted
        backend = C10dRendezvousBackend(CountingStore(self.client, self.rdzv_counter), RUN_ID)
        self.handler = create_handler(self.client, backend, params)
        self.rdzv = rendezvous
        """``c10d``: torch's dynamic rendezvous; ``given``: none, each node's rank given (as torch's
        static rendezvous does), under the same per-round store prefix as c10d's."""
        self.messages = proto.node_messages(SECRET)
        self.rollcall = sim_roll_caller(proto.roll_caller, self.host, self.delay, timeout)
        self.wg: Any = None
        self.round_stores: list[Any] = []
        self.written: set[str] = set()
        self.round_written: list[set[str]] = []
        """The keys this node wrote in each round (the protocols' and torch's rank assignment)."""
        self.channel: Any = None
        self.step_listed: Any = None
        self.rounds = 0

    def rendezvous(self) -> None:
        """The agent's _rendezvous: torch's next_rendezvous and _assign_worker_ranks, then ours."""
        from torch.distributed import PrefixStore
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

        from ft_monitor.launcher.rdzv.rounds import rendezvous_round

        previous = self.wg
        if self.rdzv == "c10d":
            info = self.handler.next_rendezvous()
        else:
            info = types.SimpleNamespace(store=PrefixStore(f"torch.rendezvous.{RUN_ID}.{self.rounds}", self.client),
                                         rank=self.index, world_size=self.nodes)
        spec = WorkerSpec(role="trainer", local_world_size=self.ranks_per_node, rdzv_handler=self.handler,
                          entrypoint="sim")
        self.written = set()
        store = CountingStore(info.store, self.rdzv_counter)  # torch's keys: not counted as ours
        workers = SimpleElasticAgent._assign_worker_ranks(None, store, info.rank, info.world_size, spec)  # type: ignore[arg-type]
        self.rounds += 1
        self.wg = types.SimpleNamespace(store=CountingStore(info.store, self.counter, self.written), spec=spec,
                                        group_rank=info.rank, group_world_size=info.world_size, workers=workers)
        self.round_stores.append(info.store)
        if previous is not None and self.proto.tidies:
            self.messages.leave_round(CountingStore(previous.store.inner, self.counter), previous.group_rank,
                                      self.rollcall.written)
        self.rollcall.new_round(rendezvous_round(self.handler, self.rounds - 1) if self.rdzv == "c10d"
                                else self.rounds - 1)
        self.channel = self.messages.channel(self.wg)

    def ranks(self) -> list[Any]:
        from ft_monitor.launcher.incident.rollcall import Rank

        return [Rank(w.global_rank, w.local_rank, 100000 + w.global_rank) for w in self.wg.workers]

    def close(self) -> None:
        if self.rdzv == "c10d":
            self.handler._stop_heartbeats()


# -- one incident -----------------------------------------------------------------------
@dataclass
class Plan:
    hung: int
    """The group rank whose rank hangs first."""
    t0: float
    wall0: float
    done: threading.Event = field(default_factory=threading.Event)

    def role(self, g: int) -> str:
        return "hung" if g == self.hung else "victim" if (g - self.hung) % 2 == 0 else "idle"

    def offset(self, g: int, nodes: int) -> float:
        return 0.0 if g == self.hung else 0.05 + 0.25 * ((g * 53) % nodes) / nodes


def incident(node: SimNode, plan: Plan, res: NodeResult, timeout: float) -> None:
    from ft_monitor.launcher.incident.crossnode import ATTRIBUTION_WINDOW, HANG_KEY
    from ft_monitor.launcher.incident.decide import first_hang
    from ft_monitor.launcher.incident.diagnosis import HungRank
    from ft_monitor.launcher.store.store_auth import HangRecord

    g, n = node.wg.group_rank, node.wg.group_world_size
    role = plan.role(g)
    ranks = node.ranks()
    if role == "idle":  # the monitor loop's _answer_roll_calls
        while not plan.done.is_set():
            node.rollcall.answer_pending(ranks, store=node.wg.store, channel=node.channel, group_rank=g,
                                         group_world_size=n)
            plan.done.wait(MONITOR_INTERVAL)
        return
    if role == "victim":  # a victim's monitor fires after the hung rank's: its record is in the store first
        hung_key = HANG_KEY.format(plan.hung)
        end = time.monotonic() + timeout
        while not node.wg.store.inner.check([hung_key]) and time.monotonic() < end:  # not counted: the sim's
            time.sleep(0.005)
    time.sleep(max(0.0, plan.t0 + plan.offset(g, n) - time.monotonic()))
    rank = ranks[0].global_rank
    onset = plan.wall0 - (2.0 if role == "hung" else 1.0 - plan.offset(g, n))
    mine = HangRecord(rank, onset, "section 'step' open for 2.0 s, timeout 2.0 s", node.host)
    t = time.monotonic()
    values = node.messages.exchange_hang_records(node.wg, node.channel, mine)
    first, _ = first_hang(mine, node.channel, values)
    res.hang_s = time.monotonic() - t
    res.first_rank = first.rank
    if first.rank == rank:
        res.owner = True
        hung = HungRank(rank, node.host, ranks[0].pid, mine.message, "section", "step", 100, plan.wall0)
        t = time.monotonic()
        d = node.rollcall.run(hung, ranks, store=node.wg.store, channel=node.channel, group_rank=g,
                              group_world_size=n, world_size=n * node.ranks_per_node, attempt=0)
        res.rollcall_s = time.monotonic() - t
        res.answered_nodes = len(d.roll_call.nodes_answered)
        res.missing_ranks = len(d.missing_ranks)
        plan.done.set()
    else:
        if not node.rollcall.answered_recently():
            node.rollcall.answer_pending(ranks, store=node.wg.store, channel=node.channel, group_rank=g,
                                         group_world_size=n, wait=timeout + ATTRIBUTION_WINDOW)
        plan.done.wait(timeout + 10)


def on_all(nodes: list[SimNode], fn: Callable[[SimNode], None], limit: float) -> list[str]:
    """Run ``fn`` on every node, each on its thread; the errors."""
    errors: list[str] = []

    def run(node: SimNode) -> None:
        try:
            fn(node)
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{node.host}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(n,), name=f"sim-{n.host}", daemon=True) for n in nodes]
    for t in threads:
        t.start()
    end = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    errors += [f"{t.name}: still running after {limit:.0f} s" for t in threads if t.is_alive()]
    return errors


def totals(nodes: Iterable[SimNode], attr: str = "counter") -> tuple[int, int]:
    ops = nbytes = 0
    for n in nodes:
        o, b = getattr(n, attr).total()
        ops += o
        nbytes += b
    return ops, nbytes


def left_keys(nodes: list[SimNode], round_index: int) -> int:
    """Keys the protocols wrote in round ``round_index`` that are still in the store."""
    store = nodes[0].round_stores[round_index]
    keys = set().union(*(n.round_written[round_index] for n in nodes))
    return sum(1 for k in keys if store.check([k]))


def run_nodes(m: int, proto: Protocol, incidents: int, ranks_per_node: int, idle_s: float,
              timeout: float = 5.0, rendezvous: str = "c10d") -> dict[str, Any]:
    """One job of ``m`` nodes on a fresh store host: rendezvous, ``incidents`` incidents, idle."""
    host = StoreHost()
    nodes: list[SimNode] = []
    out: dict[str, Any] = {"nodes": m, "protocol": proto.name, "ranks_per_node": ranks_per_node, "incidents": [],
                           "rendezvous": rendezvous}
    try:
        nodes = [SimNode(i, m, ranks_per_node, host.port, proto, timeout, rendezvous) for i in range(m)]
        t = time.monotonic()
        errors = on_all(nodes, lambda n: n.rendezvous(), 300)
        out["first_rendezvous_s"] = time.monotonic() - t
        if errors:
            raise RuntimeError(f"first rendezvous: {errors[:3]}")
        for n in nodes:
            n.round_written.append(n.written)
        errors = on_all(nodes, lambda n: n.proto.step_exchange(n, "step", {}), 120)  # as every incident leaves it
        if errors:
            raise RuntimeError(f"first slow-rank exchange: {errors[:3]}")
        for k in range(incidents):
            out["incidents"].append(one_incident(host, nodes, k, timeout))
        out["idle"] = idle(host, nodes, idle_s)
    finally:
        for n in nodes:
            n.close()
        host.close()
    return out


def one_incident(host: StoreHost, nodes: list[SimNode], k: int, timeout: float) -> dict[str, Any]:
    m = len(nodes)
    results = {n.index: NodeResult() for n in nodes}
    keys0, cpu0 = host.num_keys(), host.cpu_s()
    ops0, bytes0 = totals(nodes)
    rops0, rbytes0 = totals(nodes, "rdzv_counter")
    plan = Plan(hung=(k * 7 + 1) % m, t0=time.monotonic() + 0.05, wall0=time.time() + 0.05)
    errors = on_all(nodes, lambda n: incident(n, plan, results[n.index], timeout), timeout * 4 + 30)
    cpu_incident = host.cpu_s() - cpu0
    ops1, bytes1 = totals(nodes)
    incident_round = len(nodes[0].round_stores) - 1
    # the restart: every node joins the next round (the agent's _rendezvous, our tidying included)
    for n in nodes:
        results[n.index].rdzv_start = time.monotonic()
    errors += on_all(nodes, lambda n: (n.rendezvous(), setattr(results[n.index], "rdzv_end", time.monotonic())),
                     300)
    for n in nodes:
        n.round_written.append(n.written)
    ops2, bytes2 = totals(nodes)
    rops1, rbytes1 = totals(nodes, "rdzv_counter")
    left_ours = left_keys(nodes, incident_round)
    # the slow-rank exchange, twice (the first of a round finds keys missing; the second is the steady state)
    local = {n.index: {w.global_rank: 0.1 + 0.001 * w.global_rank for w in n.wg.workers} for n in nodes}
    step_ops: list[tuple[int, int]] = []
    for _ in range(2):
        s0 = totals(nodes)

        def step(n: SimNode) -> None:
            t = time.monotonic()
            got = n.proto.step_exchange(n, "step", local[n.index])
            results[n.index].step_s = time.monotonic() - t
            results[n.index].step_medians = len(got)

        errors += on_all(nodes, step, 120)
        s1 = totals(nodes)
        step_ops.append((s1[0] - s0[0], s1[1] - s0[1]))
    keys_after = host.num_keys()  # the next round as the last was before the incident: its step times published
    owners = [r for r in results.values() if r.owner]
    decided = [r for r in results.values() if r.first_rank is not None]
    slowest = max(n.delay for n in nodes)
    owner = owners[0] if owners else None
    rdzv = max(r.rdzv_end for r in results.values()) - min(r.rdzv_start for r in results.values())
    return {
        "hung_node": plan.hung,
        "errors": errors[:5],
        "owners": len(owners),
        "agreed": len({r.first_rank for r in decided}) == 1,
        "reporting_nodes": len(decided),
        "hang_decision_s": max(r.hang_s for r in decided if r.hang_s is not None) if decided else None,
        "hang_decision_median_s": statistics.median(r.hang_s for r in decided if r.hang_s is not None)
        if decided else None,
        "roll_call_s": owner.rollcall_s if owner else None,
        "slowest_answer_s": slowest,
        "roll_call_beyond_slowest_s": (owner.rollcall_s - slowest) if owner and owner.rollcall_s else None,
        "answered_nodes": owner.answered_nodes if owner else None,
        "missing_ranks": owner.missing_ranks if owner else None,
        "incident_ops": ops1 - ops0,
        "incident_bytes": bytes1 - bytes0,
        "tidy_ops": (ops2 - ops1),
        "rendezvous_s": rdzv,
        "rendezvous_ops": rops1 - rops0,
        "rendezvous_bytes": rbytes1 - rbytes0,
        "step_exchange_s": max(r.step_s for r in results.values() if r.step_s is not None),
        "step_medians_seen": min(r.step_medians or 0 for r in results.values()),
        "step_ops_first": step_ops[0][0],
        "step_ops": step_ops[1][0],
        "step_bytes": step_ops[1][1],
        "keys_left_ours": left_ours,
        "keys_added_total": keys_after - keys0,
        "store_cpu_s": cpu_incident,
    }


def idle(host: StoreHost, nodes: list[SimNode], seconds: float) -> dict[str, Any]:
    """Every node's monitor loop while training runs: store operations per second, store CPU."""
    if seconds <= 0:
        return {}
    ops0, _ = totals(nodes)
    rops0, rbytes0 = totals(nodes, "rdzv_counter")
    cpu0 = host.cpu_s()
    end = time.monotonic() + seconds

    def loop(n: SimNode) -> None:
        ranks = n.ranks()
        while time.monotonic() < end:
            n.rollcall.answer_pending(ranks, store=n.wg.store, channel=n.channel, group_rank=n.wg.group_rank,
                                      group_world_size=n.wg.group_world_size)
            n.messages.shared_shutdown(n.wg)
            time.sleep(MONITOR_INTERVAL)

    t0 = time.monotonic()
    errors = on_all(nodes, loop, seconds + 60)
    ops1, _ = totals(nodes)
    rops1, rbytes1 = totals(nodes, "rdzv_counter")
    took = time.monotonic() - t0
    return {"ops_per_s": (ops1 - ops0) / took, "ops_per_s_per_node": (ops1 - ops0) / took / len(nodes),
            "torch_ops_per_s": (rops1 - rops0) / took, "torch_bytes_per_s": (rbytes1 - rbytes0) / took,
            "store_cpu_share": (host.cpu_s() - cpu0) / took, "errors": errors[:3]}


# -- bench/run.py's figures ------------------------------------------------------------
def figures(mode: Any) -> list[Any]:
    """For bench/run.py: this module in its own process (the harness process never imports
    torch), ``--smoke`` / ``--quick`` / full as run.py's mode; figures at the largest M run,
    before and after side by side."""
    import tempfile

    from bench.harness import Figure

    with tempfile.TemporaryDirectory(prefix="ftb-sim-") as d:
        out = Path(d) / "sim.json"
        flag = {"smoke": ["--smoke"], "quick": ["--quick"], "full": []}[mode.name]
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *flag, "--out", str(out)],
                              capture_output=True, text=True, timeout=3600, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"bench/sim_nodes.py failed: {proc.stderr[-2000:]}")
        result = json.loads(out.read_text())
    rows = result["rows"]
    top = max(r["nodes"] for r in rows)
    figs: list[Any] = []
    for proto in ("before", "after"):
        row = next((r for r in rows if r["protocol"] == proto and r["nodes"] == top), None)
        if row is None:
            continue
        count = len(next(x for x in result["runs"] if x["protocol"] == proto and x["nodes"] == top)["incidents"])
        details = {"how": f"bench/sim_nodes.py: {top} simulated nodes against one TCPStore, medians of "
                          f"{count} incidents", "rows": [r for r in rows if r["protocol"] == proto],
                   "loadavg": [result["loadavg_start"], result["loadavg_end"]]}
        p = f"scale.nodes.{proto}"
        figs += [
            Figure(f"{p}.roll_call_beyond_slowest", f"roll call complete beyond the slowest answer, M={top} ({proto})",
                   "s", [row["roll_call_beyond_slowest_s"]], target="<= 1 s", limit=1.0, details=details),
            Figure(f"{p}.hang_decision", f"hang-record exchange + first-hang decision, M={top} ({proto})", "s",
                   [row["hang_decision_s"]]),
            Figure(f"{p}.ops_per_node", f"store ops per node per incident, M={top} ({proto})", "ops",
                   [row["incident_ops_per_node"]]),
            Figure(f"{p}.idle_ops", f"store ops/s while training runs (all nodes), M={top} ({proto})", "ops/s",
                   [row["idle_ops_per_s"]]),
            Figure(f"{p}.step_ops", f"slow-rank exchange: store ops (all nodes), M={top} ({proto})", "ops",
                   [row["step_ops"]]),
            Figure(f"{p}.rendezvous", f"rendezvous round (torch c10d), M={top} ({proto})", "s", [row["rendezvous_s"]]),
            Figure(f"{p}.keys_left", f"our keys left in the store per incident, M={top} ({proto})", "keys",
                   value=row["keys_left_ours"], judge="value", target="0" if proto == "after" else "-",
                   limit=0 if proto == "after" else None),
            Figure(f"{p}.agreed", f"first hang agreed by all, every answer in (M={top}, {proto})", "bool",
                   value=row["all_agreed"] and row["all_answered"], met=row["all_agreed"] and row["all_answered"]),
        ]
    return figs


# -- summary, table, plot ---------------------------------------------------------------
def _median(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    inc = run["incidents"]
    m = run["nodes"]
    row = {"protocol": run["protocol"], "nodes": m, "first_rendezvous_s": run.get("first_rendezvous_s")}
    for key in ("hang_decision_s", "roll_call_s", "roll_call_beyond_slowest_s", "rendezvous_s", "step_exchange_s",
                "incident_ops", "incident_bytes", "tidy_ops", "rendezvous_ops", "rendezvous_bytes", "step_ops",
                "step_ops_first", "step_bytes", "keys_left_ours", "keys_added_total", "store_cpu_s"):
        row[key] = _median(i[key] for i in inc)
    row["incident_ops_per_node"] = row["incident_ops"] / m if row["incident_ops"] is not None else None
    row["incident_bytes_per_node"] = row["incident_bytes"] / m if row["incident_bytes"] is not None else None
    row["all_agreed"] = all(i["agreed"] and i["owners"] == 1 for i in inc)
    row["all_answered"] = all(i["answered_nodes"] == m and i["missing_ranks"] == 0 for i in inc)
    row["errors"] = sum(len(i["errors"]) for i in inc)
    idle_ = run.get("idle") or {}
    row["idle_ops_per_s"] = idle_.get("ops_per_s")
    row["idle_ops_per_s_per_node"] = idle_.get("ops_per_s_per_node")
    row["idle_store_cpu_share"] = idle_.get("store_cpu_share")
    row["idle_torch_ops_per_s"] = idle_.get("torch_ops_per_s")
    row["idle_torch_bytes_per_s"] = idle_.get("torch_bytes_per_s")
    return row


COLUMNS = [("protocol", "protocol", "{}"), ("nodes", "M", "{}"), ("hang_decision_s", "hang+decision s", "{:.3f}"),
           ("roll_call_beyond_slowest_s", "roll call beyond slowest s", "{:.3f}"),
           ("step_exchange_s", "slow-rank exch. s", "{:.3f}"), ("rendezvous_s", "rendezvous s", "{:.3f}"),
           ("incident_ops_per_node", "ops/node/incident", "{:.0f}"),
           ("incident_bytes_per_node", "bytes/node/incident", "{:.0f}"), ("step_ops", "step-exch. ops", "{:.0f}"),
           ("rendezvous_ops", "rdzv ops", "{:.0f}"), ("keys_left_ours", "our keys left", "{:.0f}"),
           ("keys_added_total", "keys added (all)", "{:.0f}"), ("store_cpu_s", "store CPU s/incident", "{:.3f}"),
           ("idle_ops_per_s", "idle ops/s", "{:.0f}"), ("idle_torch_ops_per_s", "idle torch ops/s", "{:.0f}"),
           ("idle_store_cpu_share", "idle store CPU", "{:.1%}"),
           ("all_agreed", "agreed", "{}"), ("all_answered", "all answered", "{}")]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = r.get(key)
            cells.append("-" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], directory: Path, load: str) -> list[str]:
    """Curves against M, before and after: one PNG of four panels. The file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("incident_ops_per_node", "store ops per node per incident"),
              ("idle_ops_per_s", "store ops/s while training runs (all nodes)"),
              ("roll_call_beyond_slowest_s", "roll call: s beyond the slowest answer"),
              ("hang_decision_s", "hang exchange + first-hang decision, s"),
              ("step_ops", "slow-rank exchange: ops (all nodes)"),
              ("rendezvous_s", "rendezvous round (torch c10d), s")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for proto, style in (("before", "o--"), ("after", "s-")):
            pts = sorted((r["nodes"], r[key]) for r in rows if r["protocol"] == proto and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=proto)
        ax.set_xscale("log", base=2)
        if key in ("incident_ops_per_node", "idle_ops_per_s", "step_ops"):
            ax.set_yscale("log")
        ax.set_xlabel("simulated nodes M")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ft-launcher's store protocols against one TCPStore, M simulated nodes (issue 28; {load})",
                 fontsize=11)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sim_nodes.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [str(path)]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(nodes: list[int], incidents: int, ranks_per_node: int, idle_s: float, protocols: list[str],
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
        partial: Path | None = None, incidents_at: dict[int, int] | None = None,
        rendezvous: str = "c10d") -> dict[str, Any]:
    """Every M, both protocols side by side; a job that fails is recorded (its error) and the
    others go on; ``partial``: the JSON so far, rewritten after each job."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as ft-launcher sets it
    import logging

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("ft_monitor").setLevel(logging.ERROR)
    protos = []
    for name in protocols:
        p = protocol_before() if name == "before" else protocol_after()
        if p is not None:
            protos.append(p)
    runs = []
    load_start = loadavg()
    for m in nodes:
        for p in protos:  # side by side, at each M
            t = time.monotonic()
            log(f"sim_nodes: M={m} {p.name} ... (load {loadavg()})")
            try:
                r = run_nodes(m, p, (incidents_at or {}).get(m, incidents), ranks_per_node, idle_s,
                              rendezvous=rendezvous)
            except Exception as e:  # noqa: BLE001 - one M that the machine cannot host ends only its job
                log(f"sim_nodes: M={m} {p.name} failed: {type(e).__name__}: {e}")
                runs.append({"nodes": m, "protocol": p.name, "failed": f"{type(e).__name__}: {e}"[:2000],
                             "wall_s": time.monotonic() - t, "loadavg": loadavg()})
                continue
            r["wall_s"] = time.monotonic() - t
            r["loadavg"] = loadavg()
            runs.append(r)
            if partial is not None:
                partial.write_text(json.dumps({"runs": runs, "rows": [summarize(x) for x in runs if "failed" not in x]},
                                              indent=1, default=str) + "\n")
    rows = [summarize(r) for r in runs if "failed" not in r]
    return {"runs": runs, "rows": rows, "loadavg_start": load_start, "loadavg_end": loadavg(),
            "uptime": Path("/proc/uptime").read_text().split()[0], "before": BEFORE}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/sim_nodes.py", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="M up to 32, 2 incidents")
    size.add_argument("--smoke", action="store_true", help="M = 2, 1 incident (tests; figures meaningless)")
    p.add_argument("--nodes", default=None, help="comma-separated M values (default 2,4,...,128)")
    p.add_argument("--incidents", type=int, default=None)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--idle", type=float, default=None, help="seconds of idle monitor loops per M")
    p.add_argument("--protocols", default="before,after")
    p.add_argument("--rendezvous", choices=("c10d", "given"), default="c10d",
                   help="torch's c10d rendezvous (default), or none: each node's rank given, as a static rendezvous")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="folder for sim_nodes.png (default: none)")
    args = p.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    nodes = [int(x) for x in args.nodes.split(",")] if args.nodes else \
        {"full": [2, 4, 8, 16, 32, 64, 128], "quick": [2, 4, 8, 16, 32], "smoke": [2]}[mode]
    incidents = args.incidents or {"full": 3, "quick": 2, "smoke": 1}[mode]
    idle_s = args.idle if args.idle is not None else {"full": 6.0, "quick": 2.0, "smoke": 1.0}[mode]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"sim_nodes-{mode}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    at = {128: 2} if mode == "full" and args.incidents is None else None  # each 128-node round takes minutes here
    result = run(nodes, incidents, args.ranks_per_node, idle_s, args.protocols.split(","),
                 partial=out.with_suffix(".partial.json"), incidents_at=at, rendezvous=args.rendezvous)
    result["rendezvous"] = args.rendezvous
    result["mode"] = mode
    text = table(result["rows"])
    print(text)
    for r in result["runs"]:
        if "failed" in r:
            print(f"\nM={r['nodes']} {r['protocol']}: failed after {r['wall_s']:.0f} s (load {r['loadavg']}): "
                  f"{r['failed'][:300]}")
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"sim_nodes: JSON written to {out}", file=sys.stderr)
    if args.plot:
        for f in plot(result["rows"], Path(args.plot), f"load {result['loadavg_start']} -> {result['loadavg_end']}"):
            print(f"sim_nodes: plot written to {f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
