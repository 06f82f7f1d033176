"""What ft-launcher refuses before it imports torch (ft_monitor/launcher/early_check.py): one
line, exit 2, with the nearest known name for a typo; and what it leaves to the full parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.early_check import launcher_part, missing_script, problem
from tests.procs import ROOT

TRAIN = "examples/train_ddp.py"


def test_an_unknown_ft_flag_is_refused_with_the_nearest_known_one() -> None:
    assert problem(["--standalone", "--ft-rank-hartbeat-timeout", "3", TRAIN], {}) == \
        "unknown flag --ft-rank-hartbeat-timeout (did you mean --ft-rank-heartbeat-timeout?)"
    assert problem(["--ft_rank_hartbeat_timeout=3", TRAIN], {}) == \
        "unknown flag --ft_rank_hartbeat_timeout (did you mean --ft-rank-heartbeat-timeout?)"
    assert problem(["--ft-zzz", TRAIN], {}) == "unknown flag --ft-zzz"


def test_flags_after_the_script_are_the_scripts() -> None:
    assert problem(["--standalone", TRAIN, "--ft-whatever", "--hang", "x"], {}) is None
    assert launcher_part(["--nproc-per-node", "2", "-m", "pkg.train", "--ft-x"]) == (["--nproc-per-node", "2"], None)
    assert launcher_part(["--no-python", "echo", "--ft-x"]) is None  # the command cannot be told apart


@pytest.mark.parametrize("spelling", ["--ft-param-rank_heartbeat_timeout=30", "--ft-param-rank-heartbeat-timeout=30",
                                      "--ft_param_rank_heartbeat_timeout=30", "--ft-rank-heartbeat-timeout=30",
                                      "--ft_rank_heartbeat_timeout=30"])
def test_every_spelling_of_existing_launch_scripts_is_accepted(spelling: str) -> None:
    from ft_monitor.launcher.main import build_parser

    assert problem([spelling, TRAIN], {}) is None
    assert build_parser().parse_args([spelling, TRAIN]).ft_rank_heartbeat_timeout == "30"


def test_a_config_that_does_not_validate_names_the_field_the_value_and_the_rule(tmp_path: Path) -> None:
    assert problem(["--ft-rank-heartbeat-timeout", "abc", TRAIN], {}) == (
        "invalid setting rank_heartbeat_timeout = 'abc' (from --ft-rank-heartbeat-timeout): must be a number of "
        "seconds > 0, or null to disable")
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  rank_hartbeat_timeout: 3\n")
    assert problem(["--ft-cfg-path", str(cfg), TRAIN], {}) == (
        f"config file {cfg}: unknown field 'rank_hartbeat_timeout' = 3 (did you mean 'rank_heartbeat_timeout'?)")
    assert "FT_RANK_HEARTBEAT_TIMEOUT" in str(problem([TRAIN], {"FT_RANK_HEARTBEAT_TIMEOUT": "-1"}))


def test_a_script_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    # checked last (main.py), after every other check of the launch, so that those still speak first
    assert missing_script(["--nproc-per-node", "2", "nope.py"], str(tmp_path)) == \
        f"the training script nope.py does not exist (in {tmp_path})"
    assert missing_script(["-m", "pkg.train"], str(tmp_path)) is None
    assert missing_script([TRAIN], str(ROOT)) is None


@pytest.mark.e2e
@pytest.mark.parametrize("args", [["--ft-rank-hartbeat-timeout", "3", TRAIN], ["--ft-cfg-path", "examples/ft.yaml",
                                                                             "--ft-on-hang", "never", TRAIN]],
                         ids=["flag typo", "bad value"])
def test_ft_launcher_refuses_in_one_line_without_importing_torch(args: list[str]) -> None:
    # a flag or config error took 8-24 s to appear on a busy machine
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
            "from ft_monitor.launcher.main import entrypoint\n"
            f"sys.argv = ['ft-launcher', '--standalone', '--nproc-per-node', '2', *{args!r}]\n"
            "entrypoint()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == exit_codes.LAUNCHER_ERROR, done
    assert done.stdout == "torch imported: False\n", done
    (line,) = done.stderr.splitlines()
    assert line.startswith("ft-launcher: ") and ("did you mean" in line or "on_hang" in line), line


@pytest.mark.e2e
def test_a_missing_script_is_one_line_and_exit_2() -> None:
    # 32 lines of torch's and exit 1 before
    done = subprocess.run([sys.executable, "-m", "ft_monitor.launcher.main", "--standalone", "--nproc-per-node", "2",
                           "examples/no_such_script.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == exit_codes.LAUNCHER_ERROR, done
    assert [line for line in done.stderr.splitlines() if not line.startswith("[ft-launcher]")] == [
        f"ft-launcher: the training script examples/no_such_script.py does not exist (in {ROOT / 'examples'})"]
