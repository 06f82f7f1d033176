"""`ft_client.client.error_file`: the raising rank's error.json as torch's ``@record`` writes it,
for scripts without ``@record`` (issue 55: the exception's type, message and traceback never
reached error.json). In one process, with torch's own reader of error files checking the format."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ft_client import env
from ft_client.client.error_file import write_uncaught


def _raised() -> tuple[type[BaseException], BaseException, object]:
    def training_step() -> None:
        raise ValueError("bad batch 7")

    try:
        training_step()
    except ValueError:
        kind, value, tb = sys.exc_info()
        assert kind is not None and value is not None
        return kind, value, tb
    raise AssertionError("not raised")


def test_an_uncaught_exception_is_written_in_torchs_format_once_and_never_through_a_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "error.json"
    monkeypatch.setenv(env.ERROR_FILE, str(path))
    kind, value, tb = _raised()
    assert write_uncaught(kind, value, tb, os.getpid()) == str(path)  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # written whole beside it, linked, cleaned up
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "ValueError: bad batch 7"
    stack = data["message"]["extraInfo"]["py_callstack"]
    assert stack.startswith("Traceback (most recent call last):") and "in training_step" in stack
    assert stack.endswith("ValueError: bad batch 7\n")
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(path))  # torch reads it as @record's
    assert failure.message["message"] == "ValueError: bad batch 7"  # type: ignore[index]
    assert failure.timestamp == int(data["message"]["extraInfo"]["timestamp"])
    # @record wrote it first: left alone
    path.write_text('{"message": "from @record"}')
    assert write_uncaught(kind, value, tb, os.getpid()) is None  # type: ignore[arg-type]
    assert path.read_text() == '{"message": "from @record"}'
    # a forked child's exception is not the rank's; a link planted at the path is not followed
    path.unlink()
    assert write_uncaught(kind, value, tb, os.getpid() + 1) is None and not path.exists()  # type: ignore[arg-type]
    target = tmp_path / "precious"
    target.write_text("keep")
    path.symlink_to(target)
    assert write_uncaught(kind, value, tb, os.getpid()) is None  # type: ignore[arg-type]
    assert target.read_text() == "keep"
    # an interrupt or an exit is no rank's failure story; no error file named: nothing written
    path.unlink()
    assert write_uncaught(KeyboardInterrupt, KeyboardInterrupt(), None, os.getpid()) is None and not path.exists()
    monkeypatch.delenv(env.ERROR_FILE)
    assert write_uncaught(kind, value, tb, os.getpid()) is None  # type: ignore[arg-type]
