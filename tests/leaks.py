"""No test leaks a process, a thread or an open file into the next test on its worker.

`Snapshot.take` records what the test worker's process holds: its child processes (and
whether each is a zombie), its Python threads, its native threads, and its open file
descriptors. conftest.py takes one before each test and one after its fixtures are torn down;
what is new after is the test's leak, pass or fail. A leaked child is killed (its process
group), waited for and reaped, so that it cannot disturb the next test; the test then errors
in its teardown with the list, so a failure says which test leaked what.

What outlives tests on purpose is not counted: the zygote (tests/zygote.py, one per worker,
started by the first test that needs it) and whatever the interpreter starts once and keeps
(a thread of a library imported by the test, such as asyncio's or torch's pools) is told
apart by name in `KEPT_THREADS`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from dataclasses import dataclass

from tests import zygote

KEPT_THREADS = ("pymalloc", "ThreadPoolExecutor", "asyncio_", "Dummy-")
"""Python threads a library keeps for the life of the process once started (name prefixes)."""
GRACE = 2.0
"""Seconds a thread, a child or a descriptor is given to go away on its own after a test (a
daemon thread told to stop, a process just killed, a socket closed by the collector)."""


@dataclass(frozen=True)
class Snapshot:
    children: frozenset[int]
    threads: frozenset[str]
    native_threads: int
    fds: frozenset[tuple[int, str]]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(frozenset(_children()), frozenset(_threads()), _native_threads(), frozenset(_fds()))

    def leaks(self, after: Snapshot) -> list[str]:
        """What ``after`` holds that this one did not (the kept zygote excepted)."""
        keep = zygote.pids()
        out = []
        new_children = sorted(after.children - self.children - keep)
        if new_children:
            out.append("child processes " + ", ".join(f"{pid} ({_describe(pid)})" for pid in new_children))
        new_threads = sorted(t for t in after.threads - self.threads if not t.split(":", 1)[1].startswith(KEPT_THREADS))
        if new_threads:
            out.append("threads " + ", ".join(t.split(":", 1)[1] for t in new_threads))
        if after.native_threads > self.native_threads and not new_threads:
            out.append(f"native threads: {after.native_threads} after the test, {self.native_threads} before")
        zygote_fds = zygote.fds()
        new_fds = sorted(fd for fd in after.fds - self.fds if fd[0] not in zygote_fds)
        if new_fds:
            out.append("open files " + ", ".join(f"{fd} -> {target}" for fd, target in new_fds))
        return out


def check(before: Snapshot) -> list[str]:
    """The leaks of the test that ran since ``before``, after a grace period for things on
    their way out; leaked children are killed and reaped."""
    found = before.leaks(Snapshot.take())
    if not found:
        return found  # the common case, without a collection (gc.collect over torch's heap: 0.1 s a test)
    end = time.monotonic() + GRACE
    while True:
        gc.collect()
        found = before.leaks(Snapshot.take())
        if not found or time.monotonic() >= end:
            break
        time.sleep(0.05)
    if found:
        reap(before)
    return found


def reap(before: Snapshot) -> None:
    """Kill (process group and process) and reap every child the test left."""
    for pid in _children() - before.children - zygote.pids():
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def _children() -> set[int]:
    """This process's child processes, zombies included (/proc/self/task/*/children)."""
    out: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return out


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return f"{'zombie' if state == 'Z' else 'running'}: {cmd[:120]}"


def _threads() -> set[str]:
    return {f"{t.ident}:{t.name}" for t in threading.enumerate() if t is not threading.main_thread()}


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _fds() -> set[tuple[int, str]]:
    out = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            out.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:
            continue  # the listing's own descriptor, gone already
    return out
