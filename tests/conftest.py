"""Fixtures shared by the test modules: each is defined here once, not in the modules."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import cleanup_dir, short_tmpdir


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A private (0700) directory with a short path under /tmp, removed afterwards: sockets go
    in it, and AF_UNIX paths are limited to 107 bytes (pytest's tmp_path can be longer)."""
    d = short_tmpdir()
    yield d
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
    import ft_monitor.server

    async def forbidden(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("run_daemon reached: the bad value was not refused before serving")

    monkeypatch.setattr(ft_monitor.server, "run_daemon", forbidden)
    for key in list(os.environ):
        if key.startswith("FT_"):
            monkeypatch.delenv(key)


@pytest.fixture
def isolated_cli(clean_logging: None, no_daemon: None) -> None:
    """Both of the above, for tests that run cli.main with a value it must refuse."""
