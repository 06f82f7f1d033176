"""The worker template forked from ft-launcher at its start (ft_monitor/launcher/warm/template_fork.py):
when the entry point forks, and that what it changes for the import of torch is undone."""

from __future__ import annotations

import argparse
import os

import pytest

from ft_monitor.launcher.early_check import parse_launch
from ft_monitor.launcher.main import build_parser
from ft_monitor.launcher.warm import template_fork


@pytest.mark.parametrize(("argv", "asked"), [
    (["--ft-warm-restart", "train.py"], True),
    (["--ft_warm_start", "train.py"], True),
    (["--ft-warm-start=1", "train.py"], True),
    (["--nproc-per-node", "2", "train.py"], False),
    (["--ft-warm-restart", "-h"], False),  # the help is main's to print, once
    (["--ft-warm-restart", "--help"], False),
])
def test_only_warm_flags_make_the_entry_point_look_further(argv: list[str], asked: bool) -> None:
    assert template_fork.requested(argv) is asked


def test_a_flag_after_the_script_is_the_scripts_and_asks_for_nothing() -> None:
    args = template_fork.parse_quietly(build_parser(), ["--nproc-per-node", "2", "train.py", "--ft-warm-restart"],
                                      parse_launch)
    assert args is not None and not args.ft_warm_restart
    assert template_fork.fork_early(args).template is None


def test_flags_that_do_not_parse_are_left_to_main() -> None:
    assert template_fork.parse_quietly(build_parser(), ["--ft-warm-restart", "--no-such-flag", "x.py"],
                                       parse_launch) is None


def test_a_bad_preload_list_forks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_fork, "threads", lambda: 2)  # were the check to let it through: no fork of pytest
    args = argparse.Namespace(ft_warm_restart=True, ft_warm_start=False, ft_preload="torch,not a module")
    assert template_fork.fork_early(args).template is None  # main refuses the flag with its own line


def test_openblas_starts_no_pool_while_torch_is_imported_and_the_workers_never_see_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    with template_fork.no_blas_pool():
        assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert "OPENBLAS_NUM_THREADS" not in os.environ  # torch builds the workers' environment from this one
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")  # the user's own: kept, and kept as it was
    with template_fork.no_blas_pool():
        assert os.environ["OPENBLAS_NUM_THREADS"] == "4"
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_a_launcher_with_threads_does_not_fork_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_fork, "threads", lambda: 3)
    args = argparse.Namespace(ft_warm_restart=True, ft_warm_start=False, ft_preload=None)
    early = template_fork.fork_early(args)
    assert early.template is None
    assert early.why_not == ("the launcher has 3 threads at its start, so the worker template is started as a new "
                             "interpreter instead of forked from it")
