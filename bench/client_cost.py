"""Figure 1: what one client call costs the training process.

A real client process (`--worker`) connects a `RankMonitorClient` to a real
daemon and times, with time.perf_counter_ns, each call of:

* ``send_heartbeat()``;
* ``start_section("step") + end_section("step")`` -- a monitored section (listed in
  rank_section_timeouts with a timeout): two events, reported per event (pair / 2);
* ``start_section("data") + end_section("data")`` -- not listed: no IPC, per event;
* a PING request/reply through the client's own transport, and
  ``set_timeouts(client.timeouts)`` (UPDATE_CONFIG -> CONFIG_OK), both round trips.

Back-to-back: repeats of n calls timed one by one (the timer's own cost, the
median of an empty timed pair, is subtracted), with a PING between repeats so
the daemon has drained; the batch mean (one timer around n calls) is kept in the
JSON as a cross-check. Paced: one call per millisecond, kinds in turn, the
process sleeping in between as a training step would.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench.harness import Daemon, Figure, Mode, Worker, cleanup, private_dir, say

MONITORED = "step"
UNMONITORED = "data"
DAEMON_FLAGS = ("--ft-rank-heartbeat-timeout", "600", "--ft-rank-section-timeouts", f"{MONITORED}:600")

EVENT_TARGET_US = 2.0
PACED_TARGET_US = 5.0
RTT_TARGET_US = 30.0


# -- harness side ------------------------------------------------------------------
def run(mode: Mode, loop: str) -> list[Figure]:
    n = mode.pick(5000, 2000, 200)
    repeats = mode.pick(20, 5, 2)
    paced = mode.pick(2000, 300, 20)
    rtt = mode.pick(2000, 500, 50)
    d = private_dir()
    daemon = Daemon(d, loop, *DAEMON_FLAGS).wait_ready()
    try:

        w = Worker("bench.client_cost", ["--socket", str(daemon.socket), "--n", str(n), "--repeats", str(repeats),
                                         "--paced", str(paced), "--rtt", str(rtt)])
        try:
            r = w.recv(timeout=300)
        finally:
            w.finish()
    finally:
        daemon.stop()
        cleanup(d)
    return figures(r, loop, n, repeats, paced, rtt)


def figures(r: dict[str, Any], loop: str, n: int, repeats: int, paced: int, rtt: int) -> list[Figure]:
    us = lambda xs: [x / 1000.0 for x in xs]  # noqa: E731
    b2b_note = f"{repeats} x {n} calls, each timed; timer overhead {r['timer_ns']} ns subtracted"
    paced_note = f"{paced} calls, one per ms (kinds in turn)"
    out = []

    def fig(key: str, what: str, samples_ns: list[float], target_us: float, note: str, **extra: Any) -> None:
        out.append(Figure(id=f"client.{key}", what=what, unit="us", samples=us(samples_ns),
                          target=f"p50 <= {target_us:g} us", limit=target_us, loop=loop,
                          details={"how": note, **extra}))

    b = r["b2b"]
    fig("heartbeat.b2b", "heartbeat, back-to-back", b["heartbeat"], EVENT_TARGET_US, b2b_note,
        batch_mean_us=[x / 1000 for x in r["batch"]["heartbeat"]])
    fig("section.b2b", "monitored section event, back-to-back", b["section"], EVENT_TARGET_US,
        b2b_note + "; start+end pair / 2", batch_mean_us=[x / 1000 for x in r["batch"]["section"]])
    fig("unmonitored.b2b", "unmonitored section event, back-to-back", b["unmonitored"], EVENT_TARGET_US,
        b2b_note + "; start+end pair / 2", batch_mean_us=[x / 1000 for x in r["batch"]["unmonitored"]])
    p = r["paced"]
    fig("heartbeat.paced", "heartbeat, 1 call/ms", p["heartbeat"], PACED_TARGET_US, paced_note)
    fig("section.paced", "monitored section event, 1 call/ms", p["section"], PACED_TARGET_US,
        paced_note + "; start+end pair / 2")
    fig("unmonitored.paced", "unmonitored section event, 1 call/ms", p["unmonitored"], PACED_TARGET_US,
        paced_note + "; start+end pair / 2")
    fig("ping.b2b", "round trip (PING), back-to-back", r["rtt"]["ping"], RTT_TARGET_US,
        f"{rtt} requests through the client's transport")
    fig("set_timeouts.b2b", "round trip set_timeouts(), back-to-back", r["rtt"]["set_timeouts"], RTT_TARGET_US,
        f"{rtt} calls of client.set_timeouts(client.timeouts)")
    fig("ping.paced", "round trip (PING), 1 call/ms", p["ping"], RTT_TARGET_US, paced_note)
    return out


# -- worker side (the client process) ----------------------------------------------
def _timer_overhead() -> int:
    pc = time.perf_counter_ns
    xs = []
    for _ in range(20000):
        t0 = pc()
        xs.append(pc() - t0)
    return int(statistics.median(xs))


def _b2b(client: Any, n: int, kind: str, ovh: int) -> list[float]:
    pc = time.perf_counter_ns
    out = [0.0] * n
    if kind == "heartbeat":
        hb = client.send_heartbeat
        for i in range(n):
            t0 = pc()
            hb()
            out[i] = pc() - t0 - ovh
        return out
    name = MONITORED if kind == "section" else UNMONITORED
    start, end = client.start_section, client.end_section
    for i in range(n):
        t0 = pc()
        start(name)
        end(name)
        out[i] = (pc() - t0 - ovh) / 2
    return out


def _batch(client: Any, n: int, kind: str) -> float:
    """Mean ns per event with one timer around n calls."""
    pc = time.perf_counter_ns
    if kind == "heartbeat":
        hb = client.send_heartbeat
        t0 = pc()
        for _ in range(n):
            hb()
        return (pc() - t0) / n
    name = MONITORED if kind == "section" else UNMONITORED
    start, end = client.start_section, client.end_section
    t0 = pc()
    for _ in range(n):
        start(name)
        end(name)
    return (pc() - t0) / (2 * n)


def worker(argv: list[str]) -> None:
    from ft_client import RankMonitorClient, wire

    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    a.add_argument("--n", type=int, required=True)
    a.add_argument("--repeats", type=int, required=True)
    a.add_argument("--paced", type=int, required=True)
    a.add_argument("--rtt", type=int, required=True)
    args = a.parse_args(argv)

    client = RankMonitorClient(args.socket)
    client.init_workload_monitoring()
    transport = client._transport  # the PING goes through the client's own connection
    assert transport is not None
    ping = wire.PING

    def drain() -> None:
        transport.request(ping)

    ovh = _timer_overhead()
    kinds = ("heartbeat", "section", "unmonitored")
    for k in kinds:  # warm up caches and the frame cache
        _b2b(client, 200, k, ovh)
    drain()
    b2b: dict[str, list[float]] = {k: [] for k in kinds}
    batch: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for k in kinds:
            b2b[k] += _b2b(client, args.n, k, ovh)
            drain()
            batch[k].append(_batch(client, args.n, k))
            drain()

    pc = time.perf_counter_ns
    rtt: dict[str, list[float]] = {"ping": [], "set_timeouts": []}
    req = transport.request
    for _ in range(args.rtt):
        t0 = pc()
        req(ping)
        rtt["ping"].append(pc() - t0 - ovh)
    timeouts = client.timeouts
    for _ in range(args.rtt):
        t0 = pc()
        client.set_timeouts(timeouts)
        rtt["set_timeouts"].append(pc() - t0 - ovh)

    paced: dict[str, list[float]] = {"heartbeat": [], "section": [], "unmonitored": [], "ping": []}
    order = list(paced)
    hb, start, end = client.send_heartbeat, client.start_section, client.end_section
    tick = 1_000_000
    next_at = time.perf_counter_ns() + tick
    for i in range(args.paced * len(order)):
        left = next_at - time.perf_counter_ns()
        if left > 0:
            time.sleep(left / 1e9)
        next_at += tick
        k = order[i % len(order)]
        if k == "heartbeat":
            t0 = pc()
            hb()
            paced[k].append(pc() - t0 - ovh)
        elif k == "ping":
            t0 = pc()
            req(ping)
            paced[k].append(pc() - t0 - ovh)
        else:
            name = MONITORED if k == "section" else UNMONITORED
            t0 = pc()
            start(name)
            end(name)
            paced[k].append((pc() - t0 - ovh) / 2)

    lost = client._lost_reason
    client.shutdown_workload_monitoring()
    say({"timer_ns": ovh, "b2b": b2b, "batch": batch, "rtt": rtt, "paced": paced, "lost": lost})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
