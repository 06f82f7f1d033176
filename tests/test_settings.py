"""ft_monitor.core.settings: the typed settings the daemon runs from, and the ServeSpec that
`--check-serve` prints and ft-launcher writes for `--run-checked`."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ft_monitor import cli
from ft_monitor.config import FaultToleranceConfig, load_config
from ft_monitor.core.settings import ServeSpec, Settings, SettingsError

ROOT = Path(__file__).resolve().parent.parent

NON_DEFAULT: dict[str, Any] = {
    "initial_rank_heartbeat_timeout": "120", "rank_heartbeat_timeout": 30, "rank_section_timeouts": "step:30,ckpt:none",
    "rank_out_of_section_timeout": 2.5, "num_warmup_iterations": 0, "safety_factor": 1, "min_learned_timeout": 0,
    "rank_termination_signal": "SIGINT", "termination_grace_time": "0.5", "stack_dump_signal": "usr1",
    "stack_dump_timeout": 0, "report_dir": "/tmp/reports", "skip_section_response": "no", "log_level": "debug",
    "on_monitor_lost": "RAISE", "client_request_timeout": 0.1, "launcher_response_timeout": 0,
    "handshake_timeout": 1, "max_no_progress_cycles": 0, "min_progress_iterations": 10, "max_connections": 1,
    "observer_idle_timeout": 3,
    "on_hang": "inprocess", "inprocess_restart_timeout": 7.5, "max_inprocess_restarts": 2,
    "metrics_port": "0", "metrics_address": "::", "metrics_textfile": "/tmp/ft.prom", "slow_rank_ratio": "none",
    "slow_rank_section": "data",
    "startup_timeout": "45", "startup_until": "First_Step", "process_group_timeout": 600, "scheduler_grace_time": 30,
    "timeout_check": "strict", "progress_record": "off",
    "flight_recorder_entries": "2000", "roll_call_timeout": "2.5", "native_stacks": "yes",
    "snapshot_max_bytes": "0",
}


def test_fields_types_and_defaults_are_the_configs() -> None:
    assert Settings.names() == tuple(FaultToleranceConfig.model_fields)
    hints = typing.get_type_hints(Settings)
    for name, info in FaultToleranceConfig.model_fields.items():
        want = info.annotation
        if name == "rank_section_timeouts":
            assert want == dict[str, float | None] and hints[name] == Mapping[str, float | None]
        else:
            assert hints[name] == want, name
    assert Settings().to_dict() == FaultToleranceConfig().model_dump(mode="json")
    assert NON_DEFAULT.keys() == FaultToleranceConfig.model_fields.keys()


@pytest.mark.parametrize("values", [{}, NON_DEFAULT, {"rank_section_timeouts": {"warmup": 300, " step ": "none"}},
                                    {"stack_dump_signal": 34, "rank_termination_signal": 9, "log_level": 0}])
def test_settings_from_config_are_its_json_form(values: dict[str, Any]) -> None:
    config = load_config(environ={}, cli=values)
    settings = Settings.from_config(config)
    assert settings.to_dict() == config.model_dump(mode="json")
    for name in Settings.names():
        assert getattr(settings, name) == getattr(config, name), name
        assert type(getattr(settings, name)) is type(getattr(config, name)) or name == "rank_section_timeouts"
    assert settings.timeouts() == config.timeouts()
    assert Settings.from_json(settings.to_json()) == settings
    assert Settings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings


def test_settings_are_frozen_and_typed() -> None:
    s = Settings(rank_termination_signal=2, rank_section_timeouts={"step": 3}, safety_factor=2)
    assert s.rank_termination_signal is signal.SIGINT and isinstance(s.safety_factor, float)
    assert s.rank_section_timeouts == {"step": 3.0}
    with pytest.raises(AttributeError):
        s.safety_factor = 3.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.rank_section_timeouts["ckpt"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        s.no_such_setting  # type: ignore[attr-defined]  # noqa: B018
    assert Settings().log_level == logging.INFO


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rank_heartbeat_timeout": 0}, "invalid setting rank_heartbeat_timeout = 0: must be a number of seconds > 0, "
                                        "or null to disable"),
        ({"rank_heartbeat_timeout": "30"}, "invalid setting rank_heartbeat_timeout = '30': must be a number of "
                                           "seconds > 0, or null to disable"),
        ({"safety_factor": 0.5}, "invalid setting safety_factor = 0.5: must be a number >= 1.0 (a factor below 1 "
                                 "makes timeouts shorter than observed) and <= 100 (a larger one learns nothing)"),
        ({"termination_grace_time": float("nan")}, "invalid setting termination_grace_time = nan: must be a number "
                                                   "of seconds >= 0"),
        ({"client_request_timeout": 0}, "invalid setting client_request_timeout = 0: must be a number of seconds > 0 "
                                        "(a request must not wait forever)"),
        ({"handshake_timeout": -1}, "invalid setting handshake_timeout = -1: must be a number of seconds > 0"),
        ({"num_warmup_iterations": True}, "invalid setting num_warmup_iterations = True: must be a whole number >= 0 "
                                          "and <= 9223372036854775807"),
        ({"max_connections": 0}, "invalid setting max_connections = 0: must be a whole number from 1 to 65536 "
                                 "(connections besides the rank's)"),
        ({"rank_termination_signal": 19}, "invalid setting rank_termination_signal = 19: SIGSTOP cannot be used here"),
        ({"stack_dump_signal": "SIGNOPE"}, "invalid setting stack_dump_signal = 'SIGNOPE': must be a signal name "
                                           "or number"),
        ({"stack_dump_signal": 15}, "invalid settings: stack_dump_signal = SIGTERM is also rank_termination_signal: "
                                    "the dump signal must not stop the rank; choose another (default SIGUSR2)"),
        ({"stack_dump_signal": 11}, "invalid settings: stack_dump_signal = SIGSEGV is kept by faulthandler"),
        ({"skip_section_response": 1}, "invalid setting skip_section_response = 1: must be true or false"),
        ({"on_hang": "stop"}, "invalid setting on_hang = 'stop': must be 'kill' (stop the rank; the launcher "
                              "restarts the group), 'inprocess'"),
        ({"flight_recorder_entries": -1}, "invalid setting flight_recorder_entries = -1: must be a whole number "
                                          "from 0 (Flight Recorder off) to 1000000"),
        ({"snapshot_max_bytes": -1}, "invalid setting snapshot_max_bytes = -1: must be a whole number of bytes "
                                     "from 0 (snapshots off) to 9223372036854775807"),
        ({"snapshot_max_bytes": 1.5}, "invalid setting snapshot_max_bytes = 1.5: must be a whole number of bytes"),
        ({"roll_call_timeout": 0}, "invalid setting roll_call_timeout = 0: must be a number of seconds > 0"),
        ({"on_monitor_lost": "ignore"}, "invalid setting on_monitor_lost = 'ignore': must be 'warn' (log once, keep "
                                        "training) or 'raise'"),
        ({"report_dir": "reports"}, "invalid setting report_dir = 'reports': must be an absolute directory path, "
                                    "or null"),
        ({"log_level": "INFO"}, "invalid setting log_level = 'INFO': must be DEBUG, INFO, WARNING, ERROR, CRITICAL or a number"),
        ({"rank_section_timeouts": {"step": -1}}, "invalid setting rank_section_timeouts = {'step': -1}: section "
                                                  "'step' = -1: must be a number of seconds > 0, or null to disable"),
        ({"rank_section_timeouts": [1]}, "invalid setting rank_section_timeouts = [1]: must be a map of section name"),
        ({"rank_section_timeouts": {f"{i:03d}" + "n" * 240: 1.0 for i in range(200)}},
         "invalid settings: the timeouts map takes"),
    ],
)
def test_a_bad_value_names_the_field_the_value_and_the_rule(values: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError) as e:
        Settings.from_dict(values)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_fields_and_non_maps_are_refused() -> None:
    with pytest.raises(SettingsError, match=r"^invalid settings: unknown field 'workload_check_interval' = 5 "
                                            r"\(known fields: initial_rank_heartbeat_timeout, "):
        Settings.from_dict({"workload_check_interval": 5})
    with pytest.raises(SettingsError, match=r"^invalid settings: must be a map of field to value, not list$"):
        Settings.from_dict([1])
    with pytest.raises(SettingsError, match=r"^invalid settings: not JSON"):
        Settings.from_json("{")


def test_missing_fields_take_their_defaults() -> None:
    assert Settings.from_dict({"rank_heartbeat_timeout": 4}) == Settings(rank_heartbeat_timeout=4.0)


def test_built_from_the_json_form_as_a_mapping_and_keywords() -> None:
    dump = FaultToleranceConfig(safety_factor=2).model_dump(mode="json")
    assert Settings(dump) == Settings(safety_factor=2.0) == Settings.from_dict(dump)
    assert Settings(dump, safety_factor=3).safety_factor == 3.0  # keywords win
    with pytest.raises(SettingsError, match=r"^invalid settings: must be a map of field to value, not int$"):
        Settings(5)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match=r"^invalid settings: must be a map of field to value, not NoneType$"):
        Settings.from_json("null")


# -- ServeSpec -------------------------------------------------------------------------------


def test_serve_spec_round_trip_and_json_layout() -> None:
    spec = ServeSpec(Settings(rank_heartbeat_timeout=3), "/run/r.sock", loop="asyncio", cmd=["python", "t.py"],
                     log_file="/run/m.log", launcher_socket="/run/l.sock", parent_pid=42)
    assert spec.cmd == ("python", "t.py")
    data = json.loads(spec.to_json())
    assert data == {"config": Settings(rank_heartbeat_timeout=3).to_dict(), "socket": "/run/r.sock",
                    "loop": "asyncio", "cmd": ["python", "t.py"], "log_file": "/run/m.log",
                    "launcher_socket": "/run/l.sock", "parent_pid": 42}
    assert ServeSpec.from_json(spec.to_json()) == spec
    assert ServeSpec.from_dict({"config": {}, "socket": "s"}) == ServeSpec(Settings(), "s")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"socket": "s"}, "invalid serve spec: config is missing"),
        ({"config": {}}, "invalid serve spec: socket is missing"),
        ({"config": {}, "socket": 5}, "invalid serve spec socket = 5: must be a path"),
        ({"config": {}, "socket": "s", "loop": "tokio"}, "invalid serve spec loop = 'tokio': must be one of auto, "
                                                         "asyncio, uvloop"),
        ({"config": {}, "socket": "s", "cmd": "python"}, "invalid serve spec cmd = 'python': must be a list of "
                                                         "strings"),
        ({"config": {}, "socket": "s", "cmd": ["python", 3]}, "invalid serve spec cmd = ('python', 3): must be a list"),
        ({"config": {}, "socket": "s", "log_file": 3}, "invalid serve spec log_file = 3: must be a path, or null"),
        ({"config": {}, "socket": "s", "parent_pid": 0}, "invalid serve spec parent_pid = 0: must be a process id > 0"),
        ({"config": {}, "socket": "s", "extra": 1}, "invalid serve spec: unknown field 'extra'"),
        ({"config": {"safety_factor": 0}, "socket": "s"}, "invalid setting safety_factor = 0: must be a number"),
        ([], "invalid serve spec: must be a map, not list"),
    ],
)
def test_a_bad_serve_spec_is_refused(data: Any, message: str) -> None:
    with pytest.raises(SettingsError) as e:
        ServeSpec.from_json(json.dumps(data))
    assert str(e.value).startswith(message), str(e.value)


# -- through the CLI ---------------------------------------------------------------------------


@pytest.mark.usefixtures("clean_logging")
def test_check_serve_prints_a_serve_spec(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in __import__("os").environ if k.startswith("FT_")]:
        monkeypatch.delenv(key)
    rc = cli.main([cli.CHECK_SERVE, "--socket", "/run/r.sock", "--loop", "asyncio", "--ft-rank-heartbeat-timeout",
                   "7", "--", "python", "t.py"])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_OK and out.startswith(cli.SETTINGS_MARKER)
    spec = ServeSpec.from_json(out[len(cli.SETTINGS_MARKER):])
    assert spec == ServeSpec(Settings(rank_heartbeat_timeout=7), "/run/r.sock", loop="asyncio",
                             cmd=("python", "t.py"))


@pytest.mark.usefixtures("clean_logging")
def test_run_checked_refuses_a_bad_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import ft_monitor.daemon.server

    async def forbidden(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("served from a bad spec")

    monkeypatch.setattr(ft_monitor.daemon.server, "run_daemon", forbidden)
    bad = tmp_path / "monitor0.json"
    bad.write_text(json.dumps({"config": {"max_connections": 0}, "socket": str(tmp_path / "r.sock")}))
    assert cli.main([cli.RUN_CHECKED, str(bad)]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == ("ft-monitor: invalid setting max_connections = 0: must be a whole number from "
                                       "1 to 65536 (connections besides the rank's)\n")
    assert cli.main([cli.RUN_CHECKED, str(tmp_path / "missing.json")]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith(f"ft-monitor: cannot read {tmp_path / 'missing.json'}: ")


@pytest.mark.usefixtures("clean_logging")
def test_run_checked_serves_what_the_spec_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ft_monitor.daemon.server

    seen: dict[str, Any] = {}

    async def fake_run_daemon(settings: Settings, socket: str, *, command: list[str] | None,
                              launcher_socket: str | None) -> int:
        seen.update(settings=settings, socket=socket, command=command, launcher_socket=launcher_socket)
        return 0

    monkeypatch.setattr(ft_monitor.daemon.server, "run_daemon", fake_run_daemon)
    spec = ServeSpec(Settings(log_level=30), str(tmp_path / "r.sock"), loop="asyncio", launcher_socket="/l.sock")
    path = tmp_path / "monitor0.json"
    path.write_text(spec.to_json())
    assert cli.main([cli.RUN_CHECKED, str(path)]) == 0
    assert seen == {"settings": spec.settings, "socket": spec.socket, "command": None, "launcher_socket": "/l.sock"}


def test_the_daemon_still_imports_no_pydantic() -> None:
    code = ("import sys, ft_monitor.core.settings, ft_monitor.daemon.server, ft_monitor.cli; "
            "bad = [m for m in ('pydantic', 'yaml', 'torch') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
