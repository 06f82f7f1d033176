"""WarmStarts (ft_monitor.launcher.warm.warm) with real templates, without a launcher: the template
made again for ``--ft-preload auto`` takes over only once it answers, and a list of thousands
of modules reaches it whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ft_monitor.launcher.warm.warm import WarmStarts
from tests.procs import cleanup_dir, short_tmpdir, wait_until


@pytest.fixture
def d() -> Iterator[Path]:
    path = short_tmpdir()
    yield path
    cleanup_dir(path)


def test_the_template_made_again_takes_over_once_it_answers(d: Path) -> None:
    w = WarmStarts(d, ["json"], True)
    try:
        w.template = w._launch(w.preload)  # start() would also make this test process a subreaper
        assert w._ready_now(60) is None
        first = w.template
        # more names than one command-line argument holds (128 KiB): passed through a file
        names = ["json", "email.mime.text"] + [f"no_such_module_{i:05d}_{'x' * 20}" for i in range(6000)]
        (d / "modules-0.json").write_text(json.dumps(names))
        w.poll()
        assert w._pending is not None and w.template is first  # the first one serves meanwhile
        assert w._ready_now(120) is None
        assert w.template is not first and w._pending is None
        assert "email.mime.text" in w.preload and not any(n.startswith("no_such") for n in w.preload)
        assert first.proc.wait(30) is not None  # asked to stop once replaced
        assert not w.fallbacks
    finally:
        w.close()


def test_a_template_made_again_that_dies_leaves_the_first_one_serving(d: Path) -> None:
    w = WarmStarts(d, ["json"], True)
    try:
        w.template = w._launch(w.preload)
        assert w._ready_now(60) is None
        first = w.template
        (d / "modules-0.json").write_text(json.dumps(["json"]))
        w.poll()
        assert w._pending is not None
        w._pending.proc.kill()
        w._pending.proc.wait(10)
        assert w._ready_now(5) is None and w.template is first and w._pending is None
    finally:
        w.close()


def test_a_restart_never_waits_for_a_template_still_importing(d: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the review's case: --ft-preload auto made its template again 3 s before a hang, and the restart waited
    # for its imports (worker start 13.9 s where a cold start takes 4-6 s), without a word
    (d / "slow_module.py").write_text("import time\ntime.sleep(300)\n")
    w = WarmStarts(d, ["json"], True, sys_path=[str(d)])
    try:
        w.template = w._launch(["json", "slow_module"])  # the first template itself still importing
        with w.forking(1) as pids:  # a restart: started as usual, at once, with one line saying why
            pass
        assert pids == [] and len(w.fallbacks) == 1, w.fallbacks
        assert "is still importing; a restart does not wait for it; starting the workers as usual" in w.fallbacks[0]
        w.template.close()
        w.template = w._launch(w.preload)
        assert w._ready_now(60) is None
        first = w.template
        (d / "modules-0.json").write_text(json.dumps(["json", "slow_module"]))
        caplog.clear()
        with caplog.at_level("INFO", logger="ft_monitor.launcher"):
            w.poll()  # made again with the workers' modules: importing for 300 s
            assert w._pending is not None
            for _ in range(5):
                w.poll()  # the monitor loop's polls say nothing of it (they said it 13 to 54 times a restart)
            assert "still importing" not in caplog.text
            assert w._ready_now(0.0) is None and w.template is first  # the restart forks from the ready one
        said = f"is still importing; this restart forks from the ready one (pid {first.pid}, json)"
        assert caplog.text.count(said) == 1, caplog.text
        # and its imports do not take the CPU from the restart's workers: paused until every rank steps again
        pending = w._pending
        with w.forking(2):  # a signal is delivered a moment after kill() returns: waited for
            wait_until(lambda: _state(pending.pid) == "T", 10, "the importing template stopped")
            assert _state(first.pid) != "T"
        w.poll()  # not before the ranks step again (or PAUSE_LIMIT)
        assert _state(pending.pid) == "T"
        w.resume(force=True)
        wait_until(lambda: _state(pending.pid) != "T", 10, "the importing template going on")
    finally:
        w.close()


def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
