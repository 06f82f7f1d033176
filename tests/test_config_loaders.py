"""FaultToleranceConfig's nvidia-resiliency-ext loaders: from_kwargs, from_yaml_file,
from_args, to_yaml_file. Same names and arguments as the reference; the values go through
the same rules and error messages as every other source (tests/test_config.py)."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

import pytest

from ft_monitor.config import ConfigError, FaultToleranceConfig

REFERENCE_STYLE_YAML = """\
training:
  steps: 100
  fault_tolerance:
    initial_rank_heartbeat_timeout: 60
    rank_heartbeat_timeout: null
    rank_section_timeouts: {step: 30, ckpt: null}
    workload_check_interval: 1.0          # the reference's; ignored here with a warning
    rank_termination_signal: SIGUSR1
    log_level: DEBUG
"""


def test_from_kwargs_validates_and_drops_unknown_names_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ft_monitor.config"):
        cfg = FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout="12", rank_section_timeouts={"step": 3},
                                               workload_check_interval=1.0, rank_heartbat_timeout=5)
    assert (cfg.rank_heartbeat_timeout, dict(cfg.rank_section_timeouts)) == (12.0, {"step": 3.0})
    assert "ignored nvidia-resiliency-ext setting(s) with no meaning here: workload_check_interval" in caplog.text
    assert "ignored unknown setting(s): 'rank_heartbat_timeout' (from keyword arguments)" in caplog.text


def test_from_kwargs_strict_and_bad_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^keyword arguments: unknown field 'rank_heartbat_timeout' = 5 "):
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, rank_heartbat_timeout=5)
    with pytest.raises(ConfigError, match=r"^invalid setting safety_factor = 0.5 \(from keyword arguments\): must be a number >= 1\.0"):
        FaultToleranceConfig.from_kwargs(safety_factor=0.5)
    assert FaultToleranceConfig.from_kwargs() == FaultToleranceConfig()


def test_from_yaml_file_finds_the_nested_mapping(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(REFERENCE_STYLE_YAML)
    cfg = FaultToleranceConfig.from_yaml_file(str(path))
    assert cfg.initial_rank_heartbeat_timeout == 60.0 and cfg.rank_heartbeat_timeout is None
    assert dict(cfg.rank_section_timeouts) == {"step": 30.0, "ckpt": None}
    assert (cfg.rank_termination_signal, cfg.log_level) == (signal.SIGUSR1, logging.DEBUG)
    with pytest.raises(ConfigError, match=r"unknown field 'workload_check_intervl'"):
        path.write_text("fault_tolerance: {workload_check_intervl: 1}\n")
        FaultToleranceConfig.from_yaml_file(path, ignore_not_recognized=False)
    path.write_text("model: {}\n")
    with pytest.raises(ConfigError, match=r"has no 'fault_tolerance:' mapping$"):
        FaultToleranceConfig.from_yaml_file(path)


def test_from_args_file_then_flags_and_not_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(REFERENCE_STYLE_YAML)
    monkeypatch.setenv("FT_RANK_HEARTBEAT_TIMEOUT", "99")  # from_args reads no environment
    parser = argparse.ArgumentParser()
    parser.add_argument("--ft-cfg-path", default=None)
    parser.add_argument("--ft-rank-heartbeat-timeout", default=None)
    parser.add_argument("--ft-rank-section-timeouts", default=None)
    parser.add_argument("--ft-initial-rank-heartbeat-timeout", type=float, default=None)
    args = parser.parse_args(["--ft-cfg-path", str(path), "--ft-rank-heartbeat-timeout", "20",
                              "--ft-rank-section-timeouts", "step:5,eval:none"])
    cfg = FaultToleranceConfig.from_args(args)
    assert (cfg.initial_rank_heartbeat_timeout, cfg.rank_heartbeat_timeout) == (60.0, 20.0)  # None flag: not given
    assert dict(cfg.rank_section_timeouts) == {"step": 5.0, "eval": None}
    assert FaultToleranceConfig.from_args(argparse.Namespace()) == FaultToleranceConfig()
    with pytest.raises(ConfigError, match=r"^invalid setting rank_heartbeat_timeout = 'soon' \(from --ft-rank-heartbeat-timeout\)"):
        FaultToleranceConfig.from_args(argparse.Namespace(ft_rank_heartbeat_timeout="soon"))
    # the reference falls back to defaults when the file has no fault_tolerance mapping; we say so
    path.write_text("model: {}\n")
    with pytest.raises(ConfigError, match=r"has no 'fault_tolerance:' mapping$"):
        FaultToleranceConfig.from_args(args)


def test_to_yaml_file_reads_back_equal(tmp_path: Path) -> None:
    cfg = FaultToleranceConfig.from_kwargs(rank_section_timeouts={"step": 3, "ckpt": None},
                                           rank_termination_signal="SIGUSR1", log_level="warning")
    path = tmp_path / "out.yaml"
    cfg.to_yaml_file(str(path))
    assert "rank_termination_signal: SIGUSR1" in path.read_text()
    assert FaultToleranceConfig.from_yaml_file(path) == cfg
    with pytest.raises(ConfigError, match=r"^cannot write config file .*/missing/out.yaml: No such file or directory$"):
        cfg.to_yaml_file(tmp_path / "missing" / "out.yaml")


def test_progress_tracking_flag() -> None:
    assert FaultToleranceConfig().is_progress_tracking_enabled is True
    assert FaultToleranceConfig.from_kwargs(max_no_progress_cycles=0).is_progress_tracking_enabled is False
