"""Figure 1: what one client call costs the training process, in both progress modes.

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
JSON as a cross-check. Paced: one call per millisecond, one kind at a time
(what ran just before a call changes its cost: a heartbeat right after a PING
costs more), the process sleeping in between as a training step would.

Progress modes, side by side in the same run: `record` (the default: the daemon
hands the client a shared-memory progress record, and heartbeats and monitored
section events are stores into it) and `socket` (`--ft-progress-record false`:
every event is a message the daemon reads). Round trips take the socket in both.

Placement: everything that wakes the idle daemon costs several times more when
the wake-up crosses CPUs (an inter-processor interrupt; on a VM, a hypervisor
exit) than on the daemon's own CPU, and an unpinned run lands on either at the
scheduler's whim. So the set runs twice, pinned: `cross-CPU` (daemon on one
CPU, client on another -- the usual deployment, the rank owning its cores) and
`same-CPU`.

Reference rows (no target): a bare ``socket.send(HEARTBEAT_FRAME, MSG_DONTWAIT)``
on a socketpair whose other end is read by a forked process sleeping in epoll
(as the daemon does), timed the same way: the floor that one syscall plus the
wake-up of an idle reader sets on this machine, below which no
one-send-per-event client can go.
"""

from __future__ import annotations

import argparse
import os
import selectors
import socket
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
RECORD_EVENT_TARGET_US = 0.5
RECORD_PACED_TARGET_US = 1.0
RTT_TARGET_US = 30.0
MODES: dict[str, tuple[str, ...]] = {"record": (), "socket": ("--ft-progress-record", "false")}
"""Progress modes: daemon flags for each."""
HEARTBEAT = b"\x00\x00\x00\x02\x91\x04"  # wire.HEARTBEAT_FRAME, spelled out: the reference needs no client


# -- harness side ------------------------------------------------------------------
PLACEMENTS = {
    "cross-CPU": (0, 1),  # daemon on CPU 0, client on CPU 1: every wake-up crosses CPUs
    "same-CPU": (0, 0),  # both on CPU 0
}
"""Where the daemon and the client run. Unpinned, the scheduler flips between the
two from run to run, and on a VM the two differ by several times for anything
that wakes the idle daemon (see README), so each is measured pinned."""


def placements() -> dict[str, tuple[int, int] | None]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"unpinned": None}
    return {name: (cpus[a], cpus[b]) for name, (a, b) in PLACEMENTS.items()}


def run(mode: Mode, loop: str) -> list[Figure]:
    from bench import call_shape

    out: list[Figure] = call_shape.run(mode, loop)  # in-process: the loop is only its figures' tag
    for progress in MODES:
        for name, cpus in placements().items():
            out += run_placed(mode, loop, name, cpus, progress)
    return out


def run_placed(mode: Mode, loop: str, placement: str, cpus: tuple[int, int] | None,
               progress: str = "record") -> list[Figure]:
    n = mode.pick(5000, 2000, 200)
    repeats = mode.pick(20, 5, 2)
    paced = mode.pick(2000, 300, 20)
    rtt = mode.pick(2000, 500, 50)
    d = private_dir()
    daemon = Daemon(d, loop, *DAEMON_FLAGS, *MODES[progress]).wait_ready()
    try:
        args = ["--socket", str(daemon.socket), "--n", str(n), "--repeats", str(repeats), "--paced", str(paced),
                "--rtt", str(rtt), "--progress", progress]
        if cpus is not None:
            os.sched_setaffinity(daemon.pid, {cpus[0]})
            args += ["--cpu", str(cpus[1]), "--peer-cpu", str(cpus[0])]
        w = Worker("bench.client_cost", args)
        try:
            r = w.recv(timeout=300)
        finally:
            w.finish()
    finally:
        daemon.stop()
        cleanup(d)
    if r["progress"] != progress:
        raise RuntimeError(f"the client reported progress through the {r['progress']}, not the {progress}:\n"
                           f"{daemon.log()}")
    return figures(r, loop, placement, n, repeats, paced, rtt, progress)


def figures(r: dict[str, Any], loop: str, placement: str, n: int, repeats: int, paced: int, rtt: int,
            progress: str = "record") -> list[Figure]:
    us = lambda xs: [x / 1000.0 for x in xs]  # noqa: E731
    b2b_note = f"{repeats} x {n} calls, each timed; timer overhead {r['timer_ns']} ns subtracted"
    paced_note = f"{paced} calls, one per ms, one kind at a time"
    event_us, paced_us = ((RECORD_EVENT_TARGET_US, RECORD_PACED_TARGET_US) if progress == "record"
                          else (EVENT_TARGET_US, PACED_TARGET_US))
    out = []

    def fig(key: str, what: str, samples_ns: list[float], target_us: float, note: str, **extra: Any) -> None:
        out.append(Figure(id=f"client.{progress}.{placement}.{key}", what=f"{what} ({progress}, {placement})",
                          unit="us", samples=us(samples_ns), target=f"p50 <= {target_us:g} us", limit=target_us,
                          loop=loop, details={"how": note, "placement": placement, "progress": progress, **extra}))

    b = r["b2b"]
    fig("heartbeat.b2b", "heartbeat, back-to-back", b["heartbeat"], event_us, b2b_note,
        batch_mean_us=[x / 1000 for x in r["batch"]["heartbeat"]])
    fig("section.b2b", "monitored section event, back-to-back", b["section"], event_us,
        b2b_note + "; start+end pair / 2", batch_mean_us=[x / 1000 for x in r["batch"]["section"]])
    fig("unmonitored.b2b", "unmonitored section event, back-to-back", b["unmonitored"], event_us,
        b2b_note + "; start+end pair / 2", batch_mean_us=[x / 1000 for x in r["batch"]["unmonitored"]])
    p = r["paced"]
    fig("heartbeat.paced", "heartbeat, 1 call/ms", p["heartbeat"], paced_us, paced_note)
    fig("section.paced", "monitored section event, 1 call/ms", p["section"], paced_us,
        paced_note + "; start+end pair / 2")
    fig("unmonitored.paced", "unmonitored section event, 1 call/ms", p["unmonitored"], paced_us,
        paced_note + "; start+end pair / 2")
    fig("ping.b2b", "round trip (PING), back-to-back", r["rtt"]["ping"], RTT_TARGET_US,
        f"{rtt} requests through the client's transport")
    fig("set_timeouts.b2b", "round trip set_timeouts(), back-to-back", r["rtt"]["set_timeouts"], RTT_TARGET_US,
        f"{rtt} calls of client.set_timeouts(client.timeouts)")
    fig("ping.paced", "round trip (PING), 1 call/ms", p["ping"], RTT_TARGET_US, paced_note)
    if progress != "socket":
        return out
    ref = "reference: bare send() of the heartbeat frame to a reader idle in epoll (another process)"
    out.append(Figure(id=f"client.reference.{placement}.raw_send.b2b", unit="us", samples=us(b["raw"]), loop=loop,
                      what=f"reference: raw send() syscall, back-to-back ({placement})",
                      details={"how": ref + "; " + b2b_note, "placement": placement}))
    out.append(Figure(id=f"client.reference.{placement}.raw_send.paced", unit="us", samples=us(p["raw"]), loop=loop,
                      what=f"reference: raw send() syscall, 1 call/ms ({placement})",
                      details={"how": ref + "; " + paced_note, "placement": placement}))
    return out


# -- worker side (the client process) ----------------------------------------------
def _timer_overhead() -> int:
    pc = time.perf_counter_ns
    xs = []
    for _ in range(20000):
        t0 = pc()
        xs.append(pc() - t0)
    return int(statistics.median(xs))


def _raw_reader(cpu: int | None) -> tuple[socket.socket, int]:
    """A socketpair whose far end a forked process reads, sleeping in epoll between reads."""
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        near.close()
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        sel = selectors.DefaultSelector()
        sel.register(far, selectors.EVENT_READ)
        while True:
            sel.select()
            if not far.recv(65536):
                os._exit(0)
    far.close()
    return near, pid


def _raw_send(sock: socket.socket, frame: bytes) -> None:
    try:
        sock.send(frame, socket.MSG_DONTWAIT)
    except BlockingIOError:  # the reader is behind; a skipped send costs the same syscall
        pass


def _b2b(client: Any, n: int, kind: str, ovh: int, raw: socket.socket | None = None) -> list[float]:
    pc = time.perf_counter_ns
    out = [0.0] * n
    if kind == "raw":
        assert raw is not None
        frame = HEARTBEAT
        for i in range(n):
            t0 = pc()
            _raw_send(raw, frame)
            out[i] = pc() - t0 - ovh
        return out
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


def _paced(client: Any, kind: str, n: int, ovh: int, raw: socket.socket) -> list[float]:
    """n calls of one kind, one per millisecond, the process sleeping in between."""
    from ft_client import wire

    pc = time.perf_counter_ns
    hb, start, end = client.send_heartbeat, client.start_section, client.end_section
    req, ping = client._transport.request, wire.PING
    name = MONITORED if kind == "section" else UNMONITORED
    out: list[float] = []
    tick = 1_000_000
    warmup = min(100, n)  # unmeasured: let the previous phase's scheduling state settle
    time.sleep(0.1)
    next_at = pc() + tick
    for _ in range(n + warmup):
        left = next_at - pc()
        if left > 0:
            time.sleep(left / 1e9)
        next_at += tick
        if kind == "heartbeat":
            t0 = pc()
            hb()
            out.append(pc() - t0 - ovh)
        elif kind == "ping":
            t0 = pc()
            req(ping)
            out.append(pc() - t0 - ovh)
        elif kind == "raw":
            t0 = pc()
            _raw_send(raw, HEARTBEAT)
            out.append(pc() - t0 - ovh)
        else:
            t0 = pc()
            start(name)
            end(name)
            out.append((pc() - t0 - ovh) / 2)
    return out[warmup:]


def worker(argv: list[str]) -> None:
    from ft_client import RankMonitorClient, wire

    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    a.add_argument("--n", type=int, required=True)
    a.add_argument("--repeats", type=int, required=True)
    a.add_argument("--paced", type=int, required=True)
    a.add_argument("--rtt", type=int, required=True)
    a.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    a.add_argument("--peer-cpu", type=int, default=None, help="pin the reference reader to the daemon's CPU")
    a.add_argument("--progress", default="record")
    args = a.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    raw, reader = _raw_reader(args.peer_cpu)  # forked before the client exists
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
    b2b: dict[str, list[float]] = {k: [] for k in (*kinds, "raw")}
    batch: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for k in kinds:
            b2b[k] += _b2b(client, args.n, k, ovh)
            drain()
            batch[k].append(_batch(client, args.n, k))
            drain()
        b2b["raw"] += _b2b(client, args.n, "raw", ovh, raw)
        time.sleep(0.005)  # let the reader drain

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

    paced: dict[str, list[float]] = {}
    for k in ("heartbeat", "section", "unmonitored", "ping", "raw"):  # one kind per phase: what
        paced[k] = _paced(client, k, args.paced, ovh, raw)  # precedes a call changes its cost

    lost = client.lost_reason
    progress = "record" if client._record is not None else "socket"
    client.shutdown_workload_monitoring()
    raw.close()
    os.waitpid(reader, 0)
    say({"timer_ns": ovh, "b2b": b2b, "batch": batch, "rtt": rtt, "paced": paced, "lost": lost,
         "progress": progress})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
