"""Figure 2: client calls while the daemon is stopped (SIGSTOP) for a few seconds.

A real client process makes the figure-1 calls at one tick per millisecond
(heartbeat, monitored section start+end, unmonitored section start+end), each
timed with its monotonic start. The harness lets it run, SIGSTOPs the daemon
for ``stop`` seconds, SIGCONTs it, and lets it run on. Reported over the calls
that started inside the stop window: the worst and p99 call time, how many ticks
ran (the client was not blocked), whether the connection survived, and whether
the daemon counted every event once it resumed (`ft-monitor status --json`
against the worker's count, see bench/events.py).

The socket path (``--ft-progress-record false``): with the progress record a call
stores into memory and never waits on the daemon, stopped or not.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from bench.harness import Daemon, Figure, Mode, Worker, cleanup, private_dir, say

DAEMON_FLAGS = ("--ft-rank-heartbeat-timeout", "600", "--ft-rank-section-timeouts", "step:600",
                "--ft-progress-record", "false")
MAX_CALL_US = 10_000.0
"""A call during the stop must not wait for the daemon: 10 ms is far above a
scheduler hiccup and far below the stop (seconds)."""


def run(mode: Mode, loop: str) -> list[Figure]:
    pre, stop, post = mode.pick((1.0, 3.0, 1.0), (0.5, 3.0, 0.5), (0.2, 0.5, 0.2))
    d = private_dir()
    daemon = Daemon(d, loop, *DAEMON_FLAGS).wait_ready()
    try:
        w = Worker("bench.stalled", ["--socket", str(daemon.socket)])
        try:
            w.recv(timeout=30)  # connected
            w.send({"seconds": pre + stop + post})
            time.sleep(pre)
            t_stop = time.monotonic_ns()
            os.kill(daemon.pid, signal.SIGSTOP)
            time.sleep(stop)
            t_cont = time.monotonic_ns()
            os.kill(daemon.pid, signal.SIGCONT)
            r = w.recv(timeout=60)
            st = daemon.status()  # while the client is still connected
            w.send({"exit": True})
        finally:
            w.finish()
    finally:
        daemon.stop()
        cleanup(d)

    inside = [(t, dur, k) for t, dur, k in r["calls"] if t_stop <= t < t_cont]
    durs_us = [dur / 1000 for _, dur, _ in inside]
    ticks = sum(1 for _, _, k in inside if k == "heartbeat")
    expected_ticks = int((t_cont - t_stop) / 1e6)
    events_ok = st.get("events") == r["events_sent"]
    detail = {"stop_s": stop, "calls_in_stop": len(inside), "ticks_in_stop": ticks,
              "ticks_expected": expected_ticks, "connected_after": r["connected"],
              "lost_reason": r["lost"], "events_sent": r["events_sent"], "events_counted": st.get("events"),
              "ping_after_us": r["ping_after_ns"] / 1000 if r["ping_after_ns"] is not None else None,
              "per_kind_max_us": _per_kind_max(inside)}
    return [
        Figure(id="stalled.call", what=f"client call while daemon stopped {stop:g} s", unit="us",
               samples=durs_us, target=f"max <= {MAX_CALL_US / 1000:g} ms", limit=MAX_CALL_US, judge="max",
               loop=loop, details=detail),
        Figure(id="stalled.not_blocked", what="client kept its pace and connection, nothing lost", unit="",
               value=f"{ticks}/{expected_ticks} ticks, {'connected' if r['connected'] else 'LOST'}, "
                     f"events {st.get('events')}/{r['events_sent']}",
               target=">= 90% ticks, connected, no loss",
               met=bool(ticks >= 0.9 * expected_ticks and r["connected"] and events_ok), loop=loop,
               details=detail),
    ]


def _per_kind_max(calls: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for _, dur, k in calls:
        out[k] = max(out.get(k, 0.0), dur / 1000)
    return out


def worker(argv: list[str]) -> None:
    from bench.events import EventCounter
    from bench.harness import hear
    from ft_client import RankMonitorClient, wire

    counter = EventCounter().install()

    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    args = a.parse_args(argv)
    client = RankMonitorClient(args.socket)
    client.init_workload_monitoring()
    say({"connected": True})
    seconds = hear()["seconds"]
    hb, start, end = client.send_heartbeat, client.start_section, client.end_section
    mono, pc = time.monotonic_ns, time.perf_counter_ns
    calls: list[tuple[int, int, str]] = []
    tick = 1_000_000
    t_end = mono() + int(seconds * 1e9)
    next_at = mono()
    while next_at < t_end:
        left = next_at - mono()
        if left > 0:
            time.sleep(left / 1e9)
        next_at += tick
        t = mono()
        t0 = pc(); hb(); calls.append((t, pc() - t0, "heartbeat"))  # noqa: E702
        t0 = pc(); start("step"); calls.append((t, pc() - t0, "section_start"))  # noqa: E702
        t0 = pc(); end("step"); calls.append((t, pc() - t0, "section_end"))  # noqa: E702
        t0 = pc(); start("data"); end("data"); calls.append((t, pc() - t0, "unmonitored"))  # noqa: E702
    connected = client._transport is not None
    ping_ns = None
    if connected:
        t0 = pc()
        client._transport.request(wire.PING)  # the daemon has now read every event before it
        ping_ns = pc() - t0
    say({"calls": calls, "events_sent": counter.sent, "connected": connected, "lost": client.lost_reason,
         "ping_after_ns": ping_ns})
    hear()
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
