"""Figure 10: what an idle monitor costs in CPU, with the progress record's fine tick.

A real daemon and a real rank (`--worker`) that connects, opens `step` and then
sleeps inside it (a long step: nothing happens, nothing is due for minutes). The
daemon's CPU time is read from /proc/PID/task/*/schedstat (nanoseconds on the CPU,
every thread) once per second; a sample is one second's share of one core, in
percent. Configurations:

* ``record, tick 25 ms``: the usual timeouts (step 30 s, heartbeat 60 s): the
  daemon reads the record every 25 ms (the tick's upper bound);
* ``record, tick 1 ms``: a section with a 20 ms timeout is configured (never
  opened), so the tick is at its lower bound, 1 ms: the worst case;
* ``socket``: ``--ft-progress-record false``, the daemon sleeps until a message or
  a deadline (the floor).

Target (the 25 ms tick): below 1% of one core.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.harness import Daemon, Figure, Mode, Worker, cleanup, private_dir, say
from bench.startup import cpu_ns

TARGET_PCT = 1.0
CONFIGS: dict[str, tuple[str, ...]] = {
    "record.tick25ms": ("--ft-rank-heartbeat-timeout", "60", "--ft-rank-section-timeouts", "step:30"),
    "record.tick1ms": ("--ft-rank-heartbeat-timeout", "60", "--ft-rank-section-timeouts", "step:30,probe:0.02"),
    "socket": ("--ft-rank-heartbeat-timeout", "60", "--ft-rank-section-timeouts", "step:30",
               "--ft-progress-record", "false"),
}
LABELS = {"record.tick25ms": "progress record, tick 25 ms", "record.tick1ms": "progress record, tick 1 ms",
          "socket": "socket only, no tick"}


def run(mode: Mode, loop: str) -> list[Figure]:
    seconds = mode.pick(10, 4, 1)
    out = []
    for name, flags in CONFIGS.items():
        samples, progress = _measure(loop, flags, seconds)
        target = name == "record.tick25ms"
        out.append(Figure(id=f"idle.{name}", what=f"idle monitor CPU, {LABELS[name]}", unit="%", samples=samples,
                          target=f"< {TARGET_PCT:g}% of one core" if target else "-",
                          limit=TARGET_PCT if target else None, loop=loop,
                          details={"how": f"{seconds} one-second samples of the daemon's CPU time "
                                          "(/proc/PID/task/*/schedstat) while its rank sleeps in a 30 s step",
                                   "progress": progress}))
    return out


def _measure(loop: str, flags: tuple[str, ...], seconds: int) -> tuple[list[float], str]:
    d = private_dir()
    daemon = Daemon(d, loop, *flags).wait_ready()
    try:
        w = Worker("bench.idle_cpu", ["--socket", str(daemon.socket)])
        try:
            ready = w.recv(timeout=30)
            time.sleep(0.5)  # let the connection's start-up work settle
            samples = []
            last, at = cpu_ns(daemon.pid), time.monotonic()
            for _ in range(seconds):
                time.sleep(1.0)  # the sampling interval is what is measured over
                now_cpu, now = cpu_ns(daemon.pid), time.monotonic()
                samples.append(100.0 * (now_cpu - last) / ((now - at) * 1e9))
                last, at = now_cpu, now
            w.send({"stop": True})
            w.recv(timeout=30)
        finally:
            w.finish()
    finally:
        daemon.stop()
        cleanup(d)
    return samples, ready["progress"]


def worker(argv: list[str]) -> None:
    from ft_client import RankMonitorClient

    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    args = a.parse_args(argv)
    client = RankMonitorClient(args.socket)
    client.init_workload_monitoring()
    client.send_heartbeat()
    client.start_section("step")
    say({"progress": "record" if client._record is not None else "socket", "pid": os.getpid()})
    sys.stdin.readline()  # idle in the step until told
    client.end_section("step")
    client.shutdown_workload_monitoring()
    say({"done": True})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
