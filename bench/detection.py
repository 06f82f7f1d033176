"""Figure 6: how late a hang is acted on, for each kind of timeout.

For each kind (heartbeat, section, out-of-section) a real daemon is started
with only that timeout set (TIMEOUT seconds), and rank processes hang one after
another. A rank (`--worker`, its own process group, as launchers start ranks)
connects, installs a SIGTERM handler that writes time.monotonic_ns() to a file
and exits, makes its last event and records time.monotonic_ns() just *before*
that call, then sleeps. Both processes read the same CLOCK_MONOTONIC, so

    delay = SIGTERM arrival in the rank - (last event + timeout)

is the end-to-end lateness: IPC, the daemon's timer, its hang report, the stack
dump (default config: SIGUSR2 to the rank, wait for faulthandler's file to stop
growing) and the signal. It is measured twice: with the default stack dump and
with it off (--ft-stack-dump-timeout 0). The daemon's own detection lateness
(hang report: elapsed_s - timeout_s, its clock only) is reported beside it.

Both progress modes, side by side: `record` (the default: the rank's last event is
a store into its shared-memory record, which the daemon reads on its fine tick and
when the deadline comes due) and `socket` (``--ft-progress-record false``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench.harness import Daemon, Figure, Mode, Worker, cleanup, private_dir, say, wait_until

TIMEOUT = 0.3
TARGET_MS = 50.0
KINDS = {
    "heartbeat": ("--ft-rank-heartbeat-timeout", str(TIMEOUT)),
    "section": ("--ft-rank-section-timeouts", f"step:{TIMEOUT}"),
    "out_of_section": ("--ft-rank-out-of-section-timeout", str(TIMEOUT), "--ft-rank-section-timeouts", "step:none"),
}
MODES: dict[str, tuple[str, ...]] = {"record": (), "socket": ("--ft-progress-record", "false")}
VARIANTS = {
    "default": ("--ft-termination-grace-time", "5"),
    "no_dump": ("--ft-termination-grace-time", "5", "--ft-stack-dump-timeout", "0"),
}


def run(mode: Mode, loop: str) -> list[Figure]:
    hangs = mode.pick(20, 5, 1)
    out: list[Figure] = []
    for progress, pflags in MODES.items():
        for variant, vflags in VARIANTS.items():
            for kind, kflags in KINDS.items():
                delays, lateness, dumps = _measure(loop, hangs, kind, (*kflags, *vflags, *pflags))
                label = "stack dump on (default)" if variant == "default" else "stack dump off"
                out.append(Figure(
                    id=f"detect.{progress}.{kind}.{variant}",
                    what=f"{kind} timeout -> SIGTERM at rank, {label} ({progress})", unit="ms",
                    samples=delays, target=f"<= {TARGET_MS:g} ms", limit=TARGET_MS, loop=loop,
                    details={"hangs": hangs, "timeout_s": TIMEOUT, "stack_dumps_captured": dumps,
                             "daemon_detection_lateness_ms": lateness, "progress": progress}))
                if variant == "default":
                    out.append(Figure(
                        id=f"detect.{progress}.{kind}.daemon",
                        what=f"{kind} timeout -> daemon detects (its clock, {progress})", unit="ms",
                        samples=lateness, target=f"<= {TARGET_MS:g} ms", limit=TARGET_MS, loop=loop,
                        details={"how": "hang report elapsed_s - timeout_s", "progress": progress}))
    return out


def _measure(loop: str, hangs: int, kind: str, flags: tuple[str, ...]) -> tuple[list[float], list[float], int]:
    d = private_dir()
    daemon = Daemon(d, loop, *flags).wait_ready()
    delays: list[float] = []
    lateness: list[float] = []
    dumps = 0
    try:
        for i in range(hangs):
            stamp = d / f"term-{i}"
            w = Worker("bench.detection", ["--socket", str(daemon.socket), "--kind", kind, "--stamp", str(stamp)],
                       new_session=True)
            try:
                last = w.recv(timeout=30)["last_event_ns"]
                rc = w.proc.wait(TIMEOUT + 30)
            finally:
                if w.proc.poll() is None:
                    os.killpg(w.pid, signal.SIGKILL)
                w.finish()
            if rc != 0 or not stamp.exists():
                raise RuntimeError(f"rank {kind} #{i} exited with {rc} without recording SIGTERM:\n{daemon.log()}")
            term_ns = int(stamp.read_text())
            delays.append((term_ns - last) / 1e6 - TIMEOUT * 1000)
            report = _report(daemon.report_dir, w.pid)
            lateness.append((report["elapsed_s"] - report["timeout_s"]) * 1000)
            dumps += bool(report.get("stack_dump_captured"))
    finally:
        daemon.stop()
        cleanup(d)
    return delays, lateness, dumps


def _report(report_dir: Path, pid: int) -> dict:
    def done() -> dict | None:
        for p in report_dir.glob(f"rank*-pid{pid}-hang.json"):
            data = json.loads(p.read_text())
            if data.get("terminated_by"):
                return data
        return None

    return wait_until(done, 30, f"the hang report of pid {pid}", 0.005)


# -- worker side (the rank) --------------------------------------------------------
def worker(argv: list[str]) -> None:
    from ft_client import RankMonitorClient, RankMonitorClientError

    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    a.add_argument("--kind", choices=tuple(KINDS), required=True)
    a.add_argument("--stamp", required=True)
    args = a.parse_args(argv)
    fd = os.open(args.stamp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def on_term(signum: int, frame: object) -> None:
        os.write(fd, str(time.monotonic_ns()).encode())
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    client = RankMonitorClient(args.socket)
    end = time.monotonic() + 10
    while True:  # the previous rank's session may still be closing: BUSY for a moment
        try:
            client.init_workload_monitoring()
            break
        except RankMonitorClientError as e:
            if "busy" not in str(e) or time.monotonic() > end:
                raise
            time.sleep(0.005)
    for _ in range(3):
        client.start_section("step")
        client.end_section("step")
        client.send_heartbeat()
    time.sleep(0.01)
    mono = time.monotonic_ns
    if args.kind == "heartbeat":
        last = mono()
        client.send_heartbeat()
    elif args.kind == "section":
        last = mono()
        client.start_section("step")
    else:
        client.start_section("step")
        last = mono()
        client.end_section("step")
    say({"last_event_ns": last})
    while True:
        time.sleep(600)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
