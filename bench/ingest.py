"""Figures 4b and 5: daemon ingest rate, loss, and memory under load.

One pair: a real client process pushes rounds of events (step section open,
close, heartbeat -- 3 events per iteration -- through `RankMonitorClient`) as
fast as it can; each round ends with a PING, whose PONG means the daemon has
read everything before it (one ordered connection). Rate = events / (first
send -> PONG). Between rounds the harness reads the daemon's VmRSS; after the
last, `ft-monitor status --json` must count exactly the events the client sent
(bench/events.py counts them on the client side).

The client never blocks on a slow daemon: unsent bytes wait in its buffer,
bounded by ft_client.wire.transport.MAX_PENDING, past which it gives up on the
daemon. A burst of a million events outruns any daemon, so the worker applies
back-pressure a training loop never needs: when more than FLOW_BYTES wait
unsent, it calls `Transport.flush()` (a blocking send).

Eight pairs: 8 daemons and 8 clients at once, started together on a signal;
aggregate rate = all events / (first start -> last PONG), and each pair's count
checked the same way.

The socket path: the daemon runs with ``--ft-progress-record false`` (with the
progress record the same calls are stores that the daemon never has to read
one by one; figure 1 has both).
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.harness import Daemon, Figure, Mode, Worker, cleanup, private_dir, say

DAEMON_FLAGS = ("--ft-rank-heartbeat-timeout", "600", "--ft-rank-section-timeouts", "step:600",
                "--ft-progress-record", "false")
TARGET_RATE = 300_000
RSS_GROWTH_LIMIT_KB = 1024
FLOW_BYTES = 256 * 1024
RSS_TARGET_KB = 30 * 1024


def run(mode: Mode, loop: str) -> list[Figure]:
    return run_one(mode, loop) + run_pairs(mode, loop)


def run_one(mode: Mode, loop: str) -> list[Figure]:
    events = mode.pick(1_000_000, 200_000, 20_000)
    rounds = mode.pick(5, 3, 2)
    d = private_dir()
    daemon = Daemon(d, loop, *DAEMON_FLAGS).wait_ready()
    rss = [daemon.rss_kb()]
    try:
        w = Worker("bench.ingest", ["--socket", str(daemon.socket), "--events", str(events),
                                    "--rounds", str(rounds)])
        try:
            w.recv(timeout=30)
            rates, flushes = [], 0
            for _ in range(rounds):
                w.send({"go": True})
                r = w.recv(timeout=300)
                rates.append(r["events"] / r["seconds"])
                flushes += r["flushes"]
                rss.append(daemon.rss_kb())
            st = daemon.status()
            w.send({"exit": True})
            done = w.recv(timeout=30)
        finally:
            w.finish()
        hwm = _hwm(daemon.pid)
    finally:
        daemon.stop()
        cleanup(d)
    sent = done["sent"]
    counted = st.get("events")
    growth = rss[-1] - rss[1]
    info = {"events_per_round": events, "rounds": rounds, "sent": sent, "counted": counted,
            "lost_reason": done["lost"], "flushes": flushes, "rss_kb": rss, "vm_hwm_kb": hwm}
    return [
        Figure(id="ingest.one", what="ingest, one client (events/s)", unit="ev/s", samples=rates,
               target=f">= {TARGET_RATE // 1000}k ev/s", limit=TARGET_RATE, op=">=", loop=loop,
               details={**info, "how": f"{rounds} rounds of {events} events, median over rounds"}),
        Figure(id="ingest.one.no_loss", what="ingest, one client: events counted = sent", unit="",
               value=f"{counted}/{sent}", target="equal, connection kept",
               met=bool(counted == sent and done["lost"] is None), loop=loop, details=info),
        Figure(id="daemon.rss_after_events", what=f"daemon RSS after {events * rounds // 1000}k events",
               unit="MB", samples=[rss[-1] / 1024], target=f"<= {RSS_TARGET_KB // 1024} MB",
               limit=RSS_TARGET_KB / 1024, loop=loop, details=info),
        Figure(id="daemon.rss_growth",
               what=f"daemon RSS growth, {events // 1000}k -> {events * rounds // 1000}k events",
               unit="MB", samples=[growth / 1024], target=f"none (<= {RSS_GROWTH_LIMIT_KB // 1024} MB)",
               limit=RSS_GROWTH_LIMIT_KB / 1024, loop=loop, details=info),
    ]


def run_pairs(mode: Mode, loop: str) -> list[Figure]:
    pairs = mode.pick(8, 8, 2)
    events = mode.pick(300_000, 60_000, 6_000)
    d = private_dir()
    daemons: list[Daemon] = []
    workers: list[Worker] = []
    try:
        for i in range(pairs):
            daemons.append(Daemon(d, loop, *DAEMON_FLAGS, name=f"r{i}.sock"))
        for dm in daemons:
            dm.wait_ready()
        for dm in daemons:
            workers.append(Worker("bench.ingest", ["--socket", str(dm.socket), "--events", str(events),
                                                   "--rounds", "1"]))
        for w in workers:
            w.recv(timeout=30)
        for w in workers:
            w.send({"go": True})
        results = [w.recv(timeout=300) for w in workers]
        statuses = [dm.status() for dm in daemons]
        for w in workers:
            w.send({"exit": True})
        dones = [w.recv(timeout=30) for w in workers]
    finally:
        for w in workers:
            w.finish()
        for dm in daemons:
            dm.stop()
        cleanup(d)
    start = min(r["t_start"] for r in results)
    end = max(r["t_end"] for r in results)
    total = sum(r["events"] for r in results)
    per_pair = [r["events"] / r["seconds"] for r in results]
    ok = [st.get("events") == dn["sent"] and dn["lost"] is None for st, dn in zip(statuses, dones)]
    info = {"pairs": pairs, "events_per_client": events, "aggregate_ev_s": total / ((end - start) / 1e9),
            "per_pair_ev_s": per_pair, "counted": [st.get("events") for st in statuses],
            "sent": [dn["sent"] for dn in dones], "lost": [dn["lost"] for dn in dones]}
    return [
        Figure(id="ingest.pairs", what=f"ingest, {pairs} pairs at once (aggregate ev/s)", unit="ev/s",
               samples=[total / ((end - start) / 1e9)], loop=loop, details=info),
        Figure(id="ingest.pairs.per_pair", what=f"ingest, {pairs} pairs at once (per pair ev/s)", unit="ev/s",
               samples=per_pair, loop=loop, details=info),
        Figure(id="ingest.pairs.no_loss", what=f"ingest, {pairs} pairs: every pair counted = sent", unit="",
               value=f"{sum(ok)}/{pairs} pairs exact", target="all", met=all(ok), loop=loop, details=info),
    ]


def _hwm(pid: int) -> int | None:
    from bench.harness import read_kb

    try:
        return read_kb(pid, "VmHWM")
    except (OSError, KeyError):
        return None


# -- worker side -------------------------------------------------------------------
def worker(argv: list[str]) -> None:
    from bench.events import EventCounter
    from bench.harness import hear
    from ft_client import RankMonitorClient, wire

    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    a.add_argument("--events", type=int, required=True)
    a.add_argument("--rounds", type=int, required=True)
    args = a.parse_args(argv)
    counter = EventCounter().install()
    client = RankMonitorClient(args.socket)
    client.init_workload_monitoring()
    say({"connected": True})
    start, end, hb = client.start_section, client.end_section, client.send_heartbeat
    iterations = args.events // 3
    for _ in range(args.rounds):
        if hear() is None:
            return
        t = client._transport
        assert t is not None
        flushes = 0
        before = counter.sent
        t0 = time.monotonic_ns()
        for i in range(iterations):
            start("step")
            end("step")
            hb()
            if i & 1023 == 0 and len(t._pending) > FLOW_BYTES:
                t.flush()
                flushes += 1
        t.request(wire.PING)
        t1 = time.monotonic_ns()
        n = counter.sent - before
        say({"events": n, "seconds": (t1 - t0) / 1e9, "t_start": t0, "t_end": t1, "flushes": flushes})
    hear()
    say({"sent": counter.sent, "lost": client.lost_reason})
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
