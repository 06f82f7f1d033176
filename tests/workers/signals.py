"""A process that shows how a signal reached it, for tests of signal delivery.

    python tests/workers/signals.py exit-123 SIGNAME      # a handler that exits 123
    python tests/workers/signals.py count SIGNAME [tree]  # how many deliveries

``exit-123`` is nvidia-resiliency-ext's own test pattern (and a rank that saves an
emergency checkpoint on SIGTERM, then exits): a second delivery, once the handler has
run, re-enters it or kills the process with the signal's default action.

``count`` takes a real-time signal (SIGRTMIN): those queue, one per send, where two sends of a
standard signal merge into one. It blocks the signal, says ready, and on a line on
stdin takes every queued delivery and prints "count PID N". With ``tree`` it first
starts two more counters, one in its process group and one in a session of its own
(setsid), relays the line to them and their counts back.

Prints "ready pids=..." (its own pid first) once the signal is handled or blocked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def say(line: str) -> None:
    print(line, flush=True)


def exit_123(sig: signal.Signals) -> None:
    signal.signal(sig, lambda *_: sys.exit(123))
    say(f"ready pids={os.getpid()}")
    while True:
        signal.pause()


def count(sig: signal.Signals, tree: bool) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    kids = [subprocess.Popen([sys.executable, __file__, "count", sig.name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=own_session)
            for own_session in ((False, True) if tree else ())]
    pids = [os.getpid()]
    for kid in kids:
        assert kid.stdout is not None
        pids += [int(p) for p in kid.stdout.readline().split("=")[1].split(",")]
    say("ready pids=" + ",".join(map(str, pids)))
    sys.stdin.readline()
    n = 0
    while signal.sigtimedwait({sig}, 0) is not None:
        n += 1
    say(f"count {pids[0]} {n}")
    for kid in kids:
        assert kid.stdin is not None and kid.stdout is not None
        kid.stdin.write("\n")
        kid.stdin.flush()
        say(kid.stdout.readline().strip())
        kid.wait(10)


def main() -> None:
    mode, name, *rest = sys.argv[1:]
    sig = signal.Signals[name]
    if mode == "exit-123":
        exit_123(sig)
    else:
        count(sig, rest == ["tree"])


if __name__ == "__main__":
    main()
