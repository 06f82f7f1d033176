"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.procs import cleanup_dir, short_tmpdir


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A private (0700) directory with a short path (AF_UNIX paths are limited to 107 bytes)."""
    d = short_tmpdir()
    yield d
    cleanup_dir(d)
