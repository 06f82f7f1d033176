"""FaultToleranceConfig loading: precedence, YAML discovery, value forms, and error messages a user can act on."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ft_monitor import cli
from ft_monitor.config import (
    FIELDS,
    IGNORED_NVRX_FIELDS,
    ConfigError,
    FaultToleranceConfig,
    cli_overrides,
    find_fault_tolerance_section,
    load_config,
)
from ft_monitor.core.rules import parse_signal
from ft_monitor.core.settings import Settings
from tests.procs import ROOT

NO_ENV: dict[str, str] = {}
TIMEOUT_RULE = r"must be a number of seconds > 0, or null to disable"


def write_yaml(tmp_path: Path, text: str, name: str = "ft.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse_cli(*argv: str) -> dict[str, Any]:
    args = cli.build_parser().parse_args(["serve", "--socket", "/nonexistent/x.sock", *argv])
    return cli_overrides(args)


# ---------------------------------------------------------------------------
# Defaults and precedence


def test_defaults() -> None:
    cfg = load_config(environ=NO_ENV)
    assert cfg == FaultToleranceConfig()
    assert cfg.initial_rank_heartbeat_timeout is None
    assert cfg.rank_heartbeat_timeout is None
    assert cfg.rank_section_timeouts == {}
    assert cfg.rank_out_of_section_timeout is None
    assert cfg.num_warmup_iterations == 5
    assert cfg.safety_factor == 5.0
    assert cfg.rank_termination_signal is signal.SIGTERM
    assert cfg.stack_dump_signal is signal.SIGUSR2
    assert cfg.log_level == logging.INFO
    assert cfg.on_monitor_lost == "warn"
    assert cfg.skip_section_response is True


def test_precedence_defaults_yaml_env_cli(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "fault_tolerance:\n"
        "  initial_rank_heartbeat_timeout: 100\n"
        "  rank_heartbeat_timeout: 10\n"
        "  safety_factor: 2.0\n"
        "  num_warmup_iterations: 3\n",
    )
    env = {"FT_RANK_HEARTBEAT_TIMEOUT": "20", "FT_SAFETY_FACTOR": "3.5"}
    cli_values = {"safety_factor": "4"}
    cfg = load_config(path, env, cli_values)
    assert cfg.initial_rank_heartbeat_timeout == 100.0  # YAML over default
    assert cfg.rank_heartbeat_timeout == 20.0  # env over YAML
    assert cfg.safety_factor == 4.0  # CLI over env
    assert cfg.num_warmup_iterations == 3
    assert cfg.rank_out_of_section_timeout is None  # default
    assert load_config(path, NO_ENV).rank_heartbeat_timeout == 10.0
    assert load_config(path, env).safety_factor == 3.5


def test_env_is_read_only_for_config_fields() -> None:
    env = {"FT_RANK_MONITOR_IPC_SOCKET": "/tmp/x.sock", "FT_BOGUS": "1", "FT_WORKLOAD_CHECK_INTERVAL": "5",
           "RANK_HEARTBEAT_TIMEOUT": "3", "FT_STACK_DUMP_TIMEOUT": "2"}
    cfg = load_config(environ=env)
    assert cfg.stack_dump_timeout == 2.0
    assert cfg.rank_heartbeat_timeout is None


@pytest.mark.parametrize("flag", ["--ft-rank-heartbeat-timeout", "--ft_rank_heartbeat_timeout"])
def test_cli_flag_spellings(flag: str) -> None:
    overrides = parse_cli(flag, "5")
    assert overrides == {"rank_heartbeat_timeout": "5"}
    assert load_config(environ={"FT_RANK_HEARTBEAT_TIMEOUT": "9"}, cli=overrides).rank_heartbeat_timeout == 5.0


def test_cli_overrides_only_given_flags() -> None:
    assert parse_cli() == {}
    overrides = parse_cli("--ft-rank-section-timeouts", "step:30,ckpt:none", "--ft_safety_factor", "2",
                          "--ft-rank-termination-signal", "KILL", "--ft-workload-check-interval", "1")
    assert overrides == {"rank_section_timeouts": "step:30,ckpt:none", "safety_factor": "2",
                         "rank_termination_signal": "KILL", "workload_check_interval": "1"}


def test_every_field_has_a_flag() -> None:
    for name in FIELDS:
        assert parse_cli(f"--ft-{name.replace('_', '-')}", "x") == {name: "x"}
        assert parse_cli(f"--ft_{name}", "x") == {name: "x"}


def test_config_is_frozen() -> None:
    cfg = load_config(environ=NO_ENV)
    with pytest.raises(Exception, match=r"frozen"):
        cfg.safety_factor = 2.0  # type: ignore[misc]


def test_timeouts_view() -> None:
    cfg = load_config(environ=NO_ENV, cli={"rank_heartbeat_timeout": "5", "rank_section_timeouts": "step:30"})
    t = cfg.timeouts()
    assert t.rank_heartbeat_timeout == 5.0
    assert dict(t.rank_section_timeouts) == {"step": 30.0}
    assert t.learned == frozenset()


# ---------------------------------------------------------------------------
# YAML


def test_yaml_section_nested_anywhere(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "model:\n  layers: 4\n"
        "trainer:\n"
        "  callbacks:\n"
        "    - name: other\n"
        "    - plugins:\n"
        "        fault_tolerance:\n"
        "          rank_heartbeat_timeout: 7\n",
    )
    assert load_config(path, NO_ENV).rank_heartbeat_timeout == 7.0


def test_yaml_first_section_in_document_order(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "a:\n  fault_tolerance:\n    rank_heartbeat_timeout: 1\n"
        "b:\n  fault_tolerance:\n    rank_heartbeat_timeout: 2\n",
    )
    assert load_config(path, NO_ENV).rank_heartbeat_timeout == 1.0


def test_yaml_mapping_at_a_level_wins_over_deeper_ones() -> None:
    # As in nvidia-resiliency-ext: a mapping's own `fault_tolerance` key is taken before its children are searched.
    data = {"a": {"fault_tolerance": {"x": 1}}, "fault_tolerance": {"x": 2}}
    assert find_fault_tolerance_section(data) == {"x": 2}


def test_yaml_non_mapping_fault_tolerance_is_skipped() -> None:
    data = {"fault_tolerance": "yes", "nested": [{"fault_tolerance": {"x": 3}}]}
    assert find_fault_tolerance_section(data) == {"x": 3}


def test_yaml_missing_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "trainer:\n  max_steps: 10\n")
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(path))} has no 'fault_tolerance:' mapping$"):
        load_config(path, NO_ENV)


def test_yaml_empty_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "")
    with pytest.raises(ConfigError, match=r"^config file .* has no 'fault_tolerance:' mapping$"):
        load_config(path, NO_ENV)


def test_yaml_invalid(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "fault_tolerance: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(path))} is not valid YAML: "):
        load_config(path, NO_ENV)


def test_yaml_unreadable(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=rf"^cannot read config file {re.escape(str(missing))}: No such file"):
        load_config(missing, NO_ENV)
    with pytest.raises(ConfigError, match=rf"^cannot read config file {re.escape(str(tmp_path))}: Is a directory$"):
        load_config(tmp_path, NO_ENV)


def test_yaml_unknown_key_names_the_key(tmp_path: Path) -> None:
    # one typo away from a field: the field; else every known one
    path = write_yaml(tmp_path, "fault_tolerance:\n  rank_heartbeet_timeout: 5\n")
    with pytest.raises(
        ConfigError,
        match=rf"^config file {re.escape(str(path))}: unknown field 'rank_heartbeet_timeout' = 5 \(did you mean "
              r"'rank_heartbeat_timeout'\?\)$",
    ):
        load_config(path, NO_ENV)
    path = write_yaml(tmp_path, "fault_tolerance:\n  max_retries: 5\n")
    with pytest.raises(
        ConfigError,
        match=rf"^config file {re.escape(str(path))}: unknown field 'max_retries' = 5 \(known fields: "
              r"initial_rank_heartbeat_timeout, .*\)$",
    ):
        load_config(path, NO_ENV)


def test_unknown_cli_key_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^command line: unknown field 'bogus' = '1' \(known fields: "):
        load_config(environ=NO_ENV, cli={"bogus": "1"})


def test_non_string_yaml_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "fault_tolerance:\n  5: 1\n")
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(path))}: key 5 is not a field name$"):
        load_config(path, NO_ENV)


def test_yaml_error_names_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "fault_tolerance:\n  rank_heartbeat_timeout: -3\n")
    with pytest.raises(
        ConfigError,
        match=rf"^invalid setting rank_heartbeat_timeout = -3 \(from config file {re.escape(str(path))}\): "
              rf"{TIMEOUT_RULE}$",
    ):
        load_config(path, NO_ENV)


def test_nvrx_only_keys_are_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_yaml(tmp_path, "fault_tolerance:\n  workload_check_interval: 5\n  rank_heartbeat_timeout: 3\n")
    log = logging.getLogger("test_config")
    with caplog.at_level(logging.WARNING, logger="test_config"):
        cfg = load_config(path, NO_ENV, {"node_health_check_interval": "2", "workload_check_interval": "1"}, log=log)
    assert cfg.rank_heartbeat_timeout == 3.0
    warnings = [r for r in caplog.records if r.name == "test_config"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert warnings[0].getMessage() == (
        "ignored nvidia-resiliency-ext setting(s) with no meaning here: node_health_check_interval, "
        "workload_check_interval"
    )


def test_every_nvrx_only_key_is_accepted() -> None:
    cfg = load_config(environ=NO_ENV, cli={name: "whatever" for name in IGNORED_NVRX_FIELDS})
    assert cfg == FaultToleranceConfig()


# ---------------------------------------------------------------------------
# Value forms


def test_section_timeouts_cli_form() -> None:
    cfg = load_config(environ=NO_ENV, cli={"rank_section_timeouts": "step:30, ckpt:none ,eval:null,x:2.5,"})
    assert cfg.rank_section_timeouts == {"step": 30.0, "ckpt": None, "eval": None, "x": 2.5}


def test_section_timeouts_env_form() -> None:
    cfg = load_config(environ={"FT_RANK_SECTION_TIMEOUTS": "step:10,warmup:none"})
    assert cfg.rank_section_timeouts == {"step": 10.0, "warmup": None}


def test_section_timeouts_yaml_form(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "fault_tolerance:\n  rank_section_timeouts:\n    step: 30\n    ckpt: null\n")
    assert load_config(path, NO_ENV).rank_section_timeouts == {"step": 30.0, "ckpt": None}


def test_section_timeouts_null_is_empty(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "fault_tolerance:\n  rank_section_timeouts:\n")
    assert load_config(path, NO_ENV).rank_section_timeouts == {}


@pytest.mark.parametrize("word", ["none", "None", "NULL", "null", "off", "", "  none "])
def test_none_words(word: str) -> None:
    cfg = load_config(environ={"FT_RANK_HEARTBEAT_TIMEOUT": "5"}, cli={"rank_heartbeat_timeout": word})
    assert cfg.rank_heartbeat_timeout is None


def test_yaml_null_turns_a_timeout_off(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "fault_tolerance:\n  rank_out_of_section_timeout: null\n")
    assert load_config(path, NO_ENV).rank_out_of_section_timeout is None


@pytest.mark.parametrize("value", ["5", "5.0", " 5 ", 5, 5.0, "5e0"])
def test_number_forms(value: Any) -> None:
    assert load_config(environ=NO_ENV, cli={"rank_heartbeat_timeout": value}).rank_heartbeat_timeout == 5.0


@pytest.mark.parametrize(
    "value", ["SIGUSR1", "sigusr1", "USR1", "usr1", " SIGUSR1 ", "10", 10, signal.SIGUSR1],
)
def test_signal_forms(value: Any) -> None:
    assert int(signal.SIGUSR1) == 10
    cfg = load_config(environ=NO_ENV, cli={"stack_dump_signal": value})
    assert cfg.stack_dump_signal is signal.SIGUSR1
    cfg = load_config(environ=NO_ENV, cli={"rank_termination_signal": value})
    assert cfg.rank_termination_signal is signal.SIGUSR1


def test_dump_signal_must_differ_from_termination_signal() -> None:
    with pytest.raises(ConfigError, match=r"^invalid settings: stack_dump_signal = SIGUSR1 is also "
                                          r"rank_termination_signal"):
        load_config(environ=NO_ENV, cli={"stack_dump_signal": "USR1", "rank_termination_signal": "USR1"})


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_dump_signal_that_stops_the_rank_is_refused(sig: str) -> None:
    with pytest.raises(ConfigError, match=rf"^invalid settings: stack_dump_signal = {sig} would stop the rank"):
        load_config(environ=NO_ENV, cli={"stack_dump_signal": sig, "rank_termination_signal": "SIGUSR1"})


def test_parse_signal() -> None:
    assert parse_signal("term") is signal.SIGTERM
    assert parse_signal(9) is signal.SIGKILL
    with pytest.raises(KeyError):
        parse_signal("SIGNOPE")
    with pytest.raises(ValueError):
        parse_signal(1.5)


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("Yes", True), ("1", True), ("on", True),
                                                 ("false", False), ("NO", False), ("0", False), (False, False)])
def test_bool_forms(value: Any, expected: bool) -> None:
    assert load_config(environ=NO_ENV, cli={"skip_section_response": value}).skip_section_response is expected


@pytest.mark.parametrize(("value", "expected"), [("debug", logging.DEBUG), ("WARNING", logging.WARNING),
                                                 ("40", 40), (15, 15)])
def test_log_level_forms(value: Any, expected: int) -> None:
    assert load_config(environ=NO_ENV, cli={"log_level": value}).log_level == expected


def test_report_dir_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config(environ=NO_ENV, cli={"report_dir": "reports"}).report_dir == str(tmp_path / "reports")
    assert load_config(environ=NO_ENV, cli={"report_dir": "none"}).report_dir is None


def test_durations_accept_zero() -> None:
    cfg = load_config(environ=NO_ENV, cli={"termination_grace_time": "0", "stack_dump_timeout": 0})
    assert cfg.termination_grace_time == 0.0
    assert cfg.stack_dump_timeout == 0.0


# ---------------------------------------------------------------------------
# Errors: field, value, source and rule, one line each

SAFETY_RULE = (r"must be a number >= 1\.0 \(a factor below 1 makes timeouts shorter than observed\) "
               r"and <= 100 \(a larger one learns nothing\)")
DURATION_RULE = r"must be a number of seconds >= 0"
WHOLE_RULE = r"must be a whole number >= 0 and <= 9223372036854775807"
SIGNAL_RULE = r"must be a signal name or number, e\.g\. SIGTERM, TERM or 15"


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("initial_rank_heartbeat_timeout", "abc", TIMEOUT_RULE),
        ("initial_rank_heartbeat_timeout", "0", TIMEOUT_RULE),
        ("rank_heartbeat_timeout", "-5", TIMEOUT_RULE),
        ("rank_heartbeat_timeout", "nan", TIMEOUT_RULE),
        ("rank_heartbeat_timeout", "inf", TIMEOUT_RULE),
        ("rank_out_of_section_timeout", True, TIMEOUT_RULE),
        ("rank_out_of_section_timeout", [1], TIMEOUT_RULE),
        ("num_warmup_iterations", "-1", WHOLE_RULE),
        ("num_warmup_iterations", "2.5", WHOLE_RULE),
        ("num_warmup_iterations", True, WHOLE_RULE),
        ("safety_factor", "0.5", SAFETY_RULE),
        ("safety_factor", "inf", SAFETY_RULE),
        ("safety_factor", "many", SAFETY_RULE),
        ("termination_grace_time", "-1", DURATION_RULE),
        ("stack_dump_timeout", "soon", DURATION_RULE),
        ("client_request_timeout", "nan", r"must be a number of seconds > 0 \(a request must not wait forever\)"),
        ("client_request_timeout", "0", r"must be a number of seconds > 0 \(a request must not wait forever\)"),
        ("rank_termination_signal", "SIGFOO", SIGNAL_RULE),
        ("rank_termination_signal", "0", SIGNAL_RULE),
        ("rank_termination_signal", "SIGSTOP", r"SIGSTOP cannot be used here"),
        ("stack_dump_signal", "cont", r"SIGCONT cannot be used here"),
        ("stack_dump_signal", 1.5, SIGNAL_RULE),
        ("skip_section_response", "maybe", r"must be true or false"),
        ("skip_section_response", 2, r"must be true or false"),
        ("log_level", "LOUD", r"must be DEBUG, INFO, WARNING, ERROR, CRITICAL or a number"),
        ("on_monitor_lost", "panic", r"must be 'warn' \(log once, keep training\) or 'raise'"),
        ("report_dir", 5, r"must be a directory path"),
        ("rank_section_timeouts", "step:30,ckpt", r"entry 'ckpt' is not NAME:SECONDS \(CLI form: step:30,ckpt:none\)"),
        ("rank_section_timeouts", ":5", r"entry ':5' is not NAME:SECONDS \(CLI form: step:30,ckpt:none\)"),
        ("rank_section_timeouts", "step:x", rf"section 'step' = 'x': {TIMEOUT_RULE}"),
        ("rank_section_timeouts", "step:0", rf"section 'step' = '0': {TIMEOUT_RULE}"),
        ("rank_section_timeouts", 5,
         r"must be a map of section name to seconds or null \(CLI form: step:30,ckpt:none\)"),
        ("rank_section_timeouts", {" ": 5}, r"section name ' ' must be a non-empty string"),
        ("metrics_port", "70000", r"must be a TCP port from 0 to 65535 \(0: any free port, logged\), or null .*"),
        ("metrics_port", "http", r"must be a TCP port .*"),
        ("metrics_address", "", r"must be an address to listen on, e\.g\. 127\.0\.0\.1 .*"),
        ("metrics_textfile", "/var/lib/node_exporter/ft.txt", r"must be an absolute path ending in \.prom .*"),
        ("metrics_textfile", "ft.prom", r"must be an absolute path ending in \.prom .*"),
        ("slow_rank_ratio", "1", r"must be a number > 1 \(a rank is slow when .*"),
        ("slow_rank_section", "", r"section name must be 1\.\.256 bytes of UTF-8, got 0 bytes"),
    ],
)
def test_cli_errors_name_field_value_source_and_rule(field: str, value: Any, rule: str) -> None:
    flag = "--ft-" + field.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"^invalid setting {field} = {re.escape(repr(value))} "
                                          rf"\(from {re.escape(flag)}\): {rule}$"):
        load_config(environ=NO_ENV, cli={field: value})


@pytest.mark.parametrize(
    ("var", "value", "pattern"),
    [
        ("FT_SAFETY_FACTOR", "0.5", rf"^invalid setting safety_factor = '0\.5' \(from env FT_SAFETY_FACTOR\): "
                                    rf"{SAFETY_RULE}$"),
        ("FT_RANK_HEARTBEAT_TIMEOUT", "x", rf"^invalid setting rank_heartbeat_timeout = 'x' "
                                           rf"\(from env FT_RANK_HEARTBEAT_TIMEOUT\): {TIMEOUT_RULE}$"),
        ("FT_LOG_LEVEL", "chatty", r"^invalid setting log_level = 'chatty' \(from env FT_LOG_LEVEL\): must be DEBUG"),
    ],
)
def test_env_errors_name_the_variable(var: str, value: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(environ={var: value})


def test_error_source_is_the_layer_that_won(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "fault_tolerance:\n  safety_factor: 0.1\n")
    with pytest.raises(ConfigError, match=r"\(from env FT_SAFETY_FACTOR\)"):
        load_config(path, {"FT_SAFETY_FACTOR": "0.2"})
    # a valid CLI value hides the bad ones below it
    assert load_config(path, {"FT_SAFETY_FACTOR": "0.2"}, {"safety_factor": "2"}).safety_factor == 2.0


def test_several_errors_one_line_each() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(environ=NO_ENV, cli={"rank_heartbeat_timeout": "abc", "safety_factor": "x"})
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("invalid setting rank_heartbeat_timeout = 'abc' (from --ft-rank-heartbeat-timeout)")
    assert lines[1].startswith("invalid setting safety_factor = 'x' (from --ft-safety-factor)")


# ---------------------------------------------------------------------------
# `ft-monitor serve` with a bad value: exit 2, one line, no socket


@pytest.mark.usefixtures("clean_logging", "no_daemon")
@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--ft-rank-heartbeat-timeout", "abc"],
         rf"^ft-monitor: invalid setting rank_heartbeat_timeout = 'abc' \(from --ft-rank-heartbeat-timeout\): "
         rf"{TIMEOUT_RULE}$"),
        (["--ft_safety_factor", "0"],
         rf"^ft-monitor: invalid setting safety_factor = '0' \(from --ft-safety-factor\): {SAFETY_RULE}$"),
        (["--ft-rank-section-timeouts", "step"],
         r"^ft-monitor: invalid setting rank_section_timeouts = 'step' \(from --ft-rank-section-timeouts\): "
         r"entry 'step' is not NAME:SECONDS"),
        (["--config", "/nonexistent/ft.yaml"],
         r"^ft-monitor: cannot read config file /nonexistent/ft\.yaml: No such file or directory$"),
    ],
)
def test_serve_bad_value_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], pattern: str
) -> None:
    sock = tmp_path / "run" / "rank0.sock"
    assert cli.main(["serve", "--socket", str(sock), *argv]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert re.match(pattern, lines[0]), lines[0]
    assert not sock.parent.exists()


@pytest.mark.usefixtures("clean_logging", "no_daemon")
def test_serve_bad_env_value_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FT_NUM_WARMUP_ITERATIONS", "-2")
    assert cli.main(["serve", "--socket", str(tmp_path / "s.sock")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err == ("ft-monitor: invalid setting num_warmup_iterations = '-2' (from env FT_NUM_WARMUP_ITERATIONS): "
                   "must be a whole number >= 0 and <= 9223372036854775807\n")


def test_serve_bad_flag_choice_is_an_argparse_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # serve checks its arguments in a helper process; its exit code and message come through
    assert cli.main(["serve", "--socket", "/nonexistent/s.sock", "--loop", "tokio"]) == cli.EXIT_USAGE
    assert "argument --loop: invalid choice: 'tokio'" in capsys.readouterr().err


def test_serve_requires_socket(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve"]) == cli.EXIT_USAGE
    assert "the following arguments are required: --socket" in capsys.readouterr().err


def test_serve_parses_command_after_double_dash() -> None:
    args = cli.build_parser().parse_args(["serve", "--socket", "s", "--ft-rank-heartbeat-timeout", "5",
                                          "--", "python", "train.py", "--ft-safety-factor", "3"])
    assert args.cmd == ["--", "python", "train.py", "--ft-safety-factor", "3"]
    assert cli_overrides(args) == {"rank_heartbeat_timeout": "5"}
    assert args.config is None and args.loop == "auto"


def test_ft_cfg_path_alias() -> None:
    args = cli.build_parser().parse_args(["serve", "--socket", "s", "--ft-cfg-path", "ft.yaml"])
    assert args.config == "ft.yaml"


def test_status_arguments() -> None:
    args = cli.build_parser().parse_args(["status", "--socket", "s", "--json", "--timeout", "2"])
    assert (args.command, args.socket, args.json, args.timeout) == ("status", "s", True, 2.0)


def test_section_caps_are_checked_at_start() -> None:
    many = {f"s{i}": 1.0 for i in range(300)}
    with pytest.raises(ConfigError, match=r"^invalid setting rank_section_timeouts = .*: has 300 sections; at most 256$"):
        load_config(environ=NO_ENV, cli={"rank_section_timeouts": many})
    with pytest.raises(ConfigError, match=r"section name must be 1\.\.256 bytes of UTF-8, got 300 bytes$"):
        load_config(environ=NO_ENV, cli={"rank_section_timeouts": {"x" * 300: 1.0}})
    big = {f"{i:03d}" + "n" * 240: 1.0 for i in range(200)}  # within both caps, too big for a frame
    with pytest.raises(ConfigError, match=r"^invalid settings: the timeouts map takes \d+ bytes encoded; at most "):
        load_config(environ=NO_ENV, cli={"rank_section_timeouts": big})


# -- `serve` starts without pydantic when it can ---------------------------------------------
def _quick(argv: list[str], env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """cli._quick_serve in a fresh interpreter, with the daemon replaced by printing its spec."""
    code = ("import sys\nfrom ft_monitor import cli\ncli._run_checked = lambda spec: print(spec.to_json()) or 0\n"
            f"rc = cli._quick_serve({argv!r})\nprint('RC', rc, 'pydantic' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={k: v for k, v in {**os.environ, **(env or {})}.items() if not k.startswith("FT_")
                              or k in (env or {})})
    assert out.returncode == 0, out.stderr
    *spec, last = out.stdout.strip().splitlines()
    _, rc, pydantic = last.split()
    assert pydantic == "False", "the quick start imported pydantic"
    return (None if rc == "None" else int(rc)), "\n".join(spec)


def test_serve_starts_from_the_text_parsers_when_every_value_is_good(tmp_path: Path) -> None:
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  rank_heartbeat_timeout: 30\n  rank_section_timeouts: {step: 10}\n")
    rc, spec = _quick(["--socket", "/run/x/r.sock", "--config", str(cfg), "--ft-safety-factor", "2",
                       "--", "python", "t.py"], env={"FT_STACK_DUMP_SIGNAL": "usr1"})
    assert rc == 0
    from ft_monitor.core.settings import ServeSpec

    got = ServeSpec.from_json(spec)
    want = Settings.from_config(load_config(cfg, {"FT_STACK_DUMP_SIGNAL": "usr1"}, {"safety_factor": "2"}))
    assert got.settings == want and got.cmd == ("python", "t.py") and got.socket == "/run/x/r.sock"


@pytest.mark.parametrize("argv", [
    ["--ft-rank-heartbeat-timeout", "-1"],  # a bad value: the pydantic check says which, where from
    ["--ft-workload-check-interval", "5"],  # a reference field that means nothing here: warned about
    ["--ft-rank-section-timeouts", "step:30", "--ft-process-group-timeout", "10"],  # an inversion: warned
])
def test_serve_takes_the_pydantic_way_when_something_needs_saying(argv: list[str]) -> None:
    rc, _ = _quick(["--socket", "/run/x/r.sock", *argv])
    assert rc is None


def test_snapshot_max_bytes_from_every_source(tmp_path: Path) -> None:
    assert load_config(environ=NO_ENV).snapshot_max_bytes == 16 * 2**30 == 17179869184
    cfg = write_yaml(tmp_path, "fault_tolerance:\n  snapshot_max_bytes: 1073741824\n")
    assert load_config(cfg, NO_ENV).snapshot_max_bytes == 2**30
    assert load_config(cfg, {"FT_SNAPSHOT_MAX_BYTES": "0"}).snapshot_max_bytes == 0
    assert load_config(cfg, {"FT_SNAPSHOT_MAX_BYTES": "0"},
                       parse_cli("--ft-snapshot-max-bytes", "4096")).snapshot_max_bytes == 4096
    with pytest.raises(ConfigError, match=r"^invalid setting snapshot_max_bytes = '-1' \(from env "
                                          r"FT_SNAPSHOT_MAX_BYTES\): must be a whole number of bytes from 0"):
        load_config(environ={"FT_SNAPSHOT_MAX_BYTES": "-1"})


def test_the_text_parsers_agree_with_the_pydantic_model_on_every_table_value() -> None:
    from ft_monitor.config_text import PARSERS, quick_settings
    from tests.test_hostile_input import BAD
    from tests.test_settings import NON_DEFAULT

    assert set(PARSERS) == set(FaultToleranceConfig.model_fields)
    quick = quick_settings(None, {}, NON_DEFAULT)
    assert quick is not None and quick == Settings.from_config(load_config(environ={}, cli=NON_DEFAULT))
    for field, values in BAD.items():
        for value in values:
            assert quick_settings(None, {}, {field: value}) is None, (field, value)
