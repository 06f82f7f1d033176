"""A rank process for end-to-end tests: connects, does a few steps, then does what it is told.

    python tests/workers/rank.py SCENARIO [--steps N]

Prints one line per milestone ("connected pid=...", "steps done", ...) and flushes,
so tests wait on lines instead of sleeping.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from ft_client import RankMonitorClient, env, wire


def say(line: str) -> None:
    print(line, flush=True)


def hang_in_sleep() -> None:
    time.sleep(600)


def hang_in_c_call_holding_gil() -> None:
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call
    while True:  # a signal handler interrupts sleep(3); a real hang does not end
        libc.sleep(600)


def stop_myself() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)


def spawn_data_loader_child() -> int:
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(600)
        finally:
            os._exit(0)
    return pid


def spawn_stubborn_child(*, ignore_term: bool = False, own_session: bool = False) -> int:
    """A data-loader-like child that may ignore SIGTERM or leave the rank's process
    group (setsid); returns once the child has done so, so no signal races its setup."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if own_session:
                os.setsid()
            os.write(w, b"x")
            os.close(w)
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    return pid


def fork_child_that_cycles_steps(client: RankMonitorClient) -> int:
    """A data-loader-like child that inherited the client and keeps using it."""
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(60000):
                with client.section("step"):
                    time.sleep(0.005)
                client.send_heartbeat()
        finally:
            os._exit(0)
    return pid


def fork_child_holding_the_socket(client: RankMonitorClient) -> int:
    """A child that keeps a copy of the rank's connection open (as a child that
    inherited a non-close-on-exec descriptor would), then the rank exits."""
    fd = os.dup(client._transport._sock.fileno())  # type: ignore[union-attr]
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(fd)
    return pid


def forge_hang_notice() -> str:
    """Tell the launcher, as if this worker were one of its monitors, that this very
    process hung, with a field of the wrong type; return the reply ("Ack", "Error CODE")."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)

    def recv_exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = s.recv(n - len(data))
            if not chunk:
                raise EOFError("the launcher closed the connection")
            data += chunk
        return data

    try:
        s.connect(os.environ[env.LAUNCHER_SOCKET])
        s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.MONITOR, 0, {})))
        wire.read_frame_blocking(recv_exact)
        s.sendall(wire.encode(wire.HangNotice({
            "rank": 0, "pid": os.getpid(), "reason": "section", "section": "step", "message": "forged",
            "elapsed_s": 2.0, "timeout_s": 1.0, "onset_time": 1.0, "detected_time": "x", "iteration": 1,
            "report": "/nonexistent/r.json", "stack_dump": None, "stack_dump_captured": False, "error_file": None})))
        reply = wire.read_frame_blocking(recv_exact)
    finally:
        s.close()
    return f"{type(reply).__name__} {getattr(reply, 'code', '')}".strip()


class SlowToDie:
    """Keeps the client (and its socket) alive while the interpreter winds down, for 3 s: a slow
    exit after the script's main returned, as a big process's teardown is."""

    def __init__(self, client: RankMonitorClient) -> None:
        self.client = client

    def __del__(self) -> None:
        time.sleep(3.0)


_LINGER: SlowToDie | None = None


def wait_for_file(path: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > end:
            raise SystemExit(f"{path} did not appear within {timeout:.0f}s")
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-s", type=float, default=0.01, help="seconds each of the first --steps steps takes")
    p.add_argument("--socket", default=None)
    p.add_argument("--until-file", default=None)
    args = p.parse_args()

    client = RankMonitorClient(args.socket)
    client.init_workload_monitoring()
    say(f"connected pid={os.getpid()}")
    for _ in range(args.steps):
        with client.section("step"):
            time.sleep(args.step_s)
        client.send_heartbeat()
    say("steps done")

    s = args.scenario
    if s == "sleep":
        client.start_section("step")
        hang_in_sleep()
    elif s == "gil":
        client.start_section("step")
        hang_in_c_call_holding_gil()
    elif s == "stop":
        client.start_section("step")
        stop_myself()
    elif s == "children":
        child = spawn_data_loader_child()
        say(f"child pid={child}")
        client.start_section("step")
        hang_in_sleep()
    elif s == "children-ignore-term":
        pids = [spawn_stubborn_child(ignore_term=True) for _ in range(2)]
        say(f"children pids={','.join(map(str, pids))}")
        client.start_section("step")
        hang_in_sleep()
    elif s == "child-own-session":
        say(f"child pid={spawn_stubborn_child(own_session=True)}")
        client.start_section("step")
        hang_in_sleep()
    elif s == "fork-child-cycles":
        say(f"child pid={fork_child_that_cycles_steps(client)}")
        client.start_section("step")
        hang_in_sleep()
    elif s == "fork-child-holds-socket":
        say(f"child pid={fork_child_holding_the_socket(client)}")
        os._exit(0)  # no GOODBYE: an exit, with the socket still open in the child
    elif s == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        client.start_section("step")
        hang_in_sleep()
    elif s == "no-heartbeat":
        hang_in_sleep()
    elif s == "clean":
        client.shutdown_workload_monitoring()
        say("shutdown")
    elif s == "clean-open-section":
        client.start_section("step")
        client.shutdown_workload_monitoring()
        say("shutdown")
    elif s == "exit3":
        sys.exit(3)
    elif s == "return-slow-exit":  # returns right after connecting; its exit is slower than the timeouts
        global _LINGER
        _LINGER = SlowToDie(client)  # freed as the interpreter winds down, after atexit, the socket still open
        say("returning")
    elif s == "raise-slow-exit":  # an uncaught exception, then a teardown (atexit) longer than the timeouts
        import atexit

        atexit.register(time.sleep, 3.0)
        say("raising")
        raise RuntimeError("bad batch (test)")
    elif s == "train-until-stdin":  # steps and heartbeats until a line arrives on stdin
        stop = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
        while not stop.is_set():
            with client.section("step"):
                time.sleep(0.02)
            client.send_heartbeat()
        client.shutdown_workload_monitoring()
    elif s == "forge-hang-notice":  # under ft-launcher; ends once --until-file appears
        say(f"launcher replied {forge_hang_notice()}")
        client.send_workload_control_request("Continue", "after a forged hang notice")  # queued behind it
        wait_for_file(args.until_file)
        client.shutdown_workload_monitoring()
    elif s == "hang-after-stdin":  # connected and idle until a line arrives on stdin, then hung in "step"
        sys.stdin.readline()
        client.start_section("step")
        hang_in_sleep()
    elif s == "roll-call":  # under ft-launcher, by RANK: 0 hangs once --until-file appears, 1 exits, 2 idles
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            wait_for_file(args.until_file)
            client.start_section("step")
            hang_in_sleep()
        elif rank == 1:
            client.shutdown_workload_monitoring()
            say("rank 1 leaves")
        else:
            say(f"rank {rank} idles")
            hang_in_sleep()
    elif s == "stall":  # under ft-launcher: rank 0 stalls 2.5 s in a step, then both finish
        if os.environ.get("RANK", "0") == "0":
            with client.section("step"):
                time.sleep(2.5)
        else:
            time.sleep(3.0)
        client.shutdown_workload_monitoring()
        say("finished")
    elif s == "wait-stdin":
        sys.stdin.readline()
        client.shutdown_workload_monitoring()
    elif s in ("corrupt-record", "corrupt-iteration"):  # one bad write into its record, then healthy
        from ft_client import record

        rec = client._record
        if rec is None:
            raise SystemExit("no progress record to corrupt")
        if s == "corrupt-record":  # garbage over the header
            rec.words[:16] = memoryview(os.urandom(128)).cast("q")
        else:  # one word, as a stray native write could
            rec.words[record.W_ITERATION] = -7
        say("record corrupted")
        told = None
        for i in range(80):  # every 50 ms, in a step: 4 s, four times the tests' heartbeat timeout
            with client.section("step"):
                time.sleep(0.05)
            client.send_heartbeat()
            if told is None and client._record is None:
                told = i
                say(f"reporting through the socket after {i + 1} heartbeats")
        client.shutdown_workload_monitoring()
        say(f"finished, told: {told is not None}")
    else:
        raise SystemExit(f"unknown scenario {s}")


if __name__ == "__main__":
    main()
