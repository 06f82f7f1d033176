"""--ft-preload and the module lists workers write (ft_monitor.core.preload): pure."""

from __future__ import annotations

import pytest

from ft_client.errors import FtError
from ft_client.startup.loaded_modules import loaded_modules
from ft_monitor.core.preload import PreloadError, modules_from_file, parse_preload


def test_the_flag_names_modules_or_auto_and_torch_always_comes_first() -> None:
    assert parse_preload(None) == (["torch"], False)
    assert parse_preload("") == (["torch"], False)
    assert parse_preload("numpy, torch,transformers.models") == (["torch", "numpy", "transformers.models"], False)
    assert parse_preload("auto") == (["torch"], True)
    assert parse_preload("auto,numpy") == (["torch", "numpy"], True)
    with pytest.raises(PreloadError, match="'os.path; rm' is not a module name") as e:
        parse_preload("torch,os.path; rm")
    assert isinstance(e.value, FtError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("raw", [b"", b"{", b"{}", b"[1, 2]", b"null", "é".encode(), b"[" * 10000])
def test_a_workers_file_that_is_not_a_list_of_names_gives_nothing(raw: bytes) -> None:
    assert modules_from_file(raw) == []


def test_a_workers_file_keeps_dotted_names_only() -> None:
    raw = b'["torch", "torch._dynamo", "x y", "../etc", "a..b", "numpy.core", 3, "' + b"m" * 300 + b'"]'
    assert modules_from_file(raw) == ["torch", "torch._dynamo", "numpy.core"]


def test_a_worker_reports_its_submodules_but_not_main() -> None:
    names = loaded_modules()
    assert "ft_client.startup.loaded_modules" in names and "pytest" in names and "__main__" not in names
    assert names == sorted(names)
