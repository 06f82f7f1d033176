"""One job of bench/sim_nodes.py: M simulated launchers on a fresh store host (a TCPStore, or
an etcd), their first rendezvous, then incidents (a hang, its exchange and decision, the roll
call, the next round, the slow-rank exchange twice) and an idle spell of monitor loops, each
measured in store operations, bytes, keys left and the store host's CPU (on etcd also in the
HTTP requests the store operations and the rendezvous made)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.sim_nodes_node import Protocol, SimNode
from bench.sim_nodes_store import EtcdHost, StoreHost

MONITOR_INTERVAL = 0.1
"""torchrun's --monitor-interval default: how often an idle node's monitor loop runs."""


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
              timeout: float = 5.0, rendezvous: str = "c10d", store: str = "tcp") -> dict[str, Any]:
    """One job of ``m`` nodes on a fresh store host (``store``: ``tcp``, a TCPStore and torch's
    c10d backend; ``etcd``, an etcd and torch's etcd-v2 backend): rendezvous, ``incidents``
    incidents, idle."""
    host: Any = EtcdHost() if store == "etcd" else StoreHost()
    nodes: list[SimNode] = []
    out: dict[str, Any] = {"nodes": m, "protocol": proto.name, "ranks_per_node": ranks_per_node, "incidents": [],
                           "rendezvous": rendezvous, "store": store}
    try:
        nodes = [SimNode(i, m, ranks_per_node, getattr(host, "port", 0), proto, timeout, rendezvous,
                         etcd=getattr(host, "endpoint", None)) for i in range(m)]
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


def one_incident(host: Any, nodes: list[SimNode], k: int, timeout: float) -> dict[str, Any]:
    m = len(nodes)
    results = {n.index: NodeResult() for n in nodes}
    keys0, cpu0 = host.num_keys(), host.cpu_s()
    ops0, bytes0 = totals(nodes)
    rops0, rbytes0 = totals(nodes, "rdzv_counter")
    req0, _ = totals(nodes, "requests")
    plan = Plan(hung=(k * 7 + 1) % m, t0=time.monotonic() + 0.05, wall0=time.time() + 0.05)
    errors = on_all(nodes, lambda n: incident(n, plan, results[n.index], timeout), timeout * 4 + 30)
    cpu_incident = host.cpu_s() - cpu0
    ops1, bytes1 = totals(nodes)
    req1, rbody1 = totals(nodes, "requests")
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
    req2, rbody2 = totals(nodes, "requests")
    on_etcd = isinstance(host, EtcdHost)
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
    rdzv = max(r.rdzv_end for r in results.values()) - min(r.rdzv_start for r in results.values()) \
        if all(r.rdzv_end for r in results.values()) else None  # a node still in it after 300 s: none
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
        "incident_requests": req1 - req0 if on_etcd else None,
        "rendezvous_requests": req2 - req1 if on_etcd else None,
        "rendezvous_response_bytes": rbody2 - rbody1 if on_etcd else None,
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


def idle(host: Any, nodes: list[SimNode], seconds: float) -> dict[str, Any]:
    """Every node's monitor loop while training runs: store operations per second, store CPU."""
    if seconds <= 0:
        return {}
    ops0, _ = totals(nodes)
    req0, _ = totals(nodes, "requests")
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
    req1, _ = totals(nodes, "requests")
    took = time.monotonic() - t0
    return {"ops_per_s": (ops1 - ops0) / took, "ops_per_s_per_node": (ops1 - ops0) / took / len(nodes),
            "requests_per_s": (req1 - req0) / took if isinstance(host, EtcdHost) else None,
            "torch_ops_per_s": (rops1 - rops0) / took, "torch_bytes_per_s": (rbytes1 - rbytes0) / took,
            "store_cpu_share": (host.cpu_s() - cpu0) / took, "errors": errors[:3]}

