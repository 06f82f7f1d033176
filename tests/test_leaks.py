"""The suite's leak check (tests/leaks.py) itself: what a test leaves behind is named, and a
child left running is killed and reaped so the next test does not meet it."""

from __future__ import annotations

import os
import subprocess
import threading

from tests import leaks


def test_a_child_a_thread_and_a_file_left_behind_are_each_named() -> None:
    before = leaks.Snapshot.take()
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running")
    thread.start()
    r, w = os.pipe()
    try:
        found = before.leaks(leaks.Snapshot.take())
        assert len(found) == 3, found
        assert found[0].startswith(f"child processes {child.pid} (running: sleep 60)")
        assert found[1] == "threads left-running"
        assert found[2].startswith("open files ") and f"{r} -> pipe:" in found[2] and f"{w} -> pipe:" in found[2]
        leaks.reap(before)  # what the check does with a leaked child
        assert child.poll() is not None or child.wait(5) == -9
    finally:
        stop.set()
        thread.join(5)
        os.close(r)
        os.close(w)
        if child.poll() is None:
            child.kill()
            child.wait(5)
    assert leaks.check(before) == []  # an OS thread ends a moment after its join returns


def test_what_goes_away_within_the_grace_is_no_leak() -> None:
    before = leaks.Snapshot.take()
    done = threading.Event()
    thread = threading.Thread(target=done.wait, args=(0.2,), name="finishing")
    thread.start()
    assert leaks.check(before) == []  # waited for, not reported
    thread.join(5)
