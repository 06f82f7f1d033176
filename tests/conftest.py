"""Fixtures shared by the test modules: each is defined here once, not in the modules."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import leaks
from tests.procs import cleanup_dir, short_tmpdir, slack

KEEP_ENV = "FT_TEST_KEEP_DIR"
"""Where the work folder of a failing test is kept (scripts/flake-hunt sets it per run);
unset: /tmp/ft-failed-tests."""


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """Each phase's report on the item (``item.ft_failed``), for fixtures that keep evidence."""
    report = yield
    if report.failed:
        item.ft_failed = True  # type: ignore[attr-defined]
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    """pytest-timeout's bound on each test (the ini's, or the test's own mark), multiplied
    by how busy the machine is when the test starts (tests/procs.slack)."""
    marker = item.get_closest_marker("timeout")
    base = (marker.args[0] if marker.args else marker.kwargs.get("timeout")) if marker is not None \
        else item.config.getini("timeout")
    if base:
        item.add_marker(pytest.mark.timeout(float(base) * slack()), append=False)
    return (yield)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """End-to-end tests first (each module's in its order): pytest-xdist hands tests out in this
    order, and a run whose last tests are minute-long end-to-end ones ends with one busy worker
    while the others wait; the unit tests, seconds in all, fill in at the end."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


@pytest.fixture(scope="session", autouse=True)
def imported_once() -> None:
    """What torch starts once per process, started before the first test, so that it is the
    process's and not a leak of whichever test was first to need it (tests/leaks.py): the thread
    of OpenBLAS's pool (at import), the intra-op thread pool (at the first parallel operation),
    and libuv's signal pipe (at the first TCPStore server; it stays after the store is gone)."""
    import torch
    from torch.distributed import TCPStore

    torch.ones(1 << 20).sum()
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    del store


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest, imported_once: None) -> Iterator[None]:
    """The test leaves no child process, thread or open file behind (tests/leaks.py), pass or
    fail: torn down after every other fixture of the test, it errors with the list."""
    before = leaks.Snapshot.take()
    yield
    found = leaks.check(before)
    if found:
        pytest.fail(f"{request.node.nodeid} leaked: " + "; ".join(found), pytrace=False)


def keep_evidence(node: pytest.Item, d: Path) -> Path | None:
    """Move a failing test's work folder (daemon and launcher logs, hang reports, stack dumps)
    where it survives the run; where it went, or None when the test passed."""
    if not getattr(node, "ft_failed", False) or not d.exists():
        return None
    base = Path(os.environ.get(KEEP_ENV) or "/tmp/ft-failed-tests")
    base.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", node.nodeid)[-150:]
    dest = base / name
    n = 1
    while dest.exists():
        n += 1
        dest = base / f"{name}.{n}"
    shutil.move(str(d), dest)
    return dest


@pytest.fixture
def workdir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A private (0700) directory with a short path under /tmp, removed afterwards: sockets go
    in it, and AF_UNIX paths are limited to 107 bytes (pytest's tmp_path can be longer).
    A failing test's folder is kept instead (`keep_evidence`), and its path is printed with the
    failure."""
    d = short_tmpdir()
    yield d
    kept = keep_evidence(request.node, d)
    if kept is not None:
        request.node.add_report_section("teardown", "evidence", f"work folder kept at {kept}")
    cleanup_dir(d)


PROGRESS_MODES: dict[str, tuple[str, ...]] = {"record": (), "socket": ("--ft-progress-record", "false")}
"""The two ways a rank reports progress, as daemon (or ft-launcher) flags: the shared-memory
record (the default) and the socket alone."""


@pytest.fixture(params=list(PROGRESS_MODES))
def progress(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """Runs a test in both progress modes: the flags to give the daemon (or ft-launcher)."""
    return PROGRESS_MODES[request.param]


@pytest.fixture
def clean_logging() -> Iterator[None]:
    """cli.main configures the root logger (force=True); put it back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)


@pytest.fixture
def no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if cli.main gets as far as starting the daemon; and no FT_* from the real environment."""
    import ft_monitor.daemon.server

    async def forbidden(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("run_daemon reached: the bad value was not refused before serving")

    monkeypatch.setattr(ft_monitor.daemon.server, "run_daemon", forbidden)
    for key in list(os.environ):
        if key.startswith("FT_"):
            monkeypatch.delenv(key)


@pytest.fixture
def isolated_cli(clean_logging: None, no_daemon: None) -> None:
    """Both of the above, for tests that run cli.main with a value it must refuse."""
