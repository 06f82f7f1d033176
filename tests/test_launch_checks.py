"""Checks made at launch, before anything starts: timeouts in the right order, a torch
whose internals ft-launcher relies on, and the SDK helper that makes the process-group
timeout known. In-process: the launch itself is replaced by a recorder."""

from __future__ import annotations

import logging
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import ft_client
from ft_client.process_group import ProcessGroupTimeoutError, process_group_timeout
from ft_monitor import cli
from ft_monitor.config import FaultToleranceConfig, load_config
from ft_monitor.core import timeout_order
from ft_monitor.core.settings import Settings
from ft_monitor.core.timeout_order import Facts, Limit, facts, inversions
from ft_monitor.launcher import main as launcher_main
from ft_monitor.launcher.agent import torch_support

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

ROOT = Path(__file__).resolve().parent.parent
GLOO_DEFAULT = Limit(1800.0, "torch's default process-group timeout, 1800 s")


def settings(**kw: Any) -> Settings:
    return Settings.from_config(FaultToleranceConfig(**kw))


# -- the rules (pure) ---------------------------------------------------------------------
def test_a_gloo_timeout_of_5_s_under_a_30_s_step_is_one_inversion_naming_both_and_the_fix() -> None:
    cfg = settings(process_group_timeout=5, rank_section_timeouts={"step": 30})
    (found,) = inversions(cfg, facts(cfg, {}, torch_default=GLOO_DEFAULT))
    assert found.message() == (
        "rank_section_timeouts['step'] = 30 s (+ stack_dump_timeout 5 s) is not below the process-group timeout of "
        "5 s (process_group_timeout): ranks waiting for the hung rank in a collective or in init_process_group would "
        "time out first, and the hang would be reported as their crash. Fix: process_group_timeout above 35 s, passed "
        "as init_process_group(timeout=ft_client.process_group_timeout())")


def test_the_example_config_is_in_order_against_torchs_default() -> None:
    cfg = Settings.from_config(load_config(ROOT / "examples" / "ft.yaml", {}, {}))
    assert inversions(cfg, facts(cfg, {}, torch_default=GLOO_DEFAULT)) == []


def test_every_detection_timeout_is_checked_and_the_lower_fix_offered_when_there_is_one() -> None:
    cfg = settings(startup_timeout=700, initial_rank_heartbeat_timeout=900, rank_heartbeat_timeout=100,
                   rank_section_timeouts={"step": 60, "ckpt": 650, "eval": None}, on_hang="inprocess",
                   inprocess_restart_timeout=30)
    nccl = Limit(600.0, "torch's default process-group timeout for NCCL, 600 s")
    found = inversions(cfg, facts(cfg, {}, torch_default=nccl))
    assert [f.inner.split(" = ")[0] for f in found] == ["startup_timeout", "initial_rank_heartbeat_timeout",
                                                      "rank_section_timeouts['ckpt']"]
    assert found[0].fix.endswith(", or startup_timeout below 595 s")


def test_nccl_heartbeat_timeout_from_the_environment_unless_monitoring_is_off() -> None:
    cfg = settings(rank_section_timeouts={"step": 600})
    env = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480"}
    (found,) = inversions(cfg, facts(cfg, env))
    assert "NCCL's heartbeat timeout of 480 s (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)" in found.outer
    assert found.fix.startswith("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC above 605 s")
    assert inversions(cfg, facts(cfg, {**env, "TORCH_NCCL_ENABLE_MONITORING": "0"})) == []
    assert inversions(cfg, facts(cfg, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "soon"})) == []


def test_a_scheduler_grace_shorter_than_stopping_a_hang_being_handled() -> None:
    cfg = settings(scheduler_grace_time=30, stack_dump_timeout=5, termination_grace_time=5)
    assert inversions(cfg, Facts()) == []  # serve: dump + grace = 10 s
    (found,) = inversions(cfg, Facts(shutdown_timeout=30.0))  # the launcher adds torch's wait and its monitors'
    assert found.inner == ("stopping a hang being handled (stack_dump_timeout 5 s + termination_grace_time 5 s + "
                           "torch's shutdown timeout 30 s + the monitors' stop (termination_grace_time) 5 s = 45 s)")
    assert "scheduler_grace_time = 30 s" in found.outer and "terminationGracePeriodSeconds" in found.fix


def test_without_a_known_process_group_timeout_nothing_is_compared_to_it() -> None:
    cfg = settings(rank_section_timeouts={"step": 1e6})
    assert inversions(cfg, facts(cfg, {})) == []


# -- ft-launcher and ft-monitor serve: warn, strict, off ------------------------------------
@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch, clean_logging: None) -> list[Any]:
    """Run ft-launcher's main up to the launch, which records its arguments instead."""
    calls: list[Any] = []
    monkeypatch.setattr(launcher_main, "launch", lambda *a, **k: calls.append(a) or 0)
    monkeypatch.setenv(launcher_main.SHARED_STORE_OPT_OUT, "1")
    for key in [k for k in os.environ if k.startswith(("FT_", "TORCH_NCCL_"))]:
        monkeypatch.delenv(key)
    return calls


def _launch(*flags: str) -> list[str]:
    return ["--standalone", "--nproc-per-node", "1", *flags, str(ROOT / "examples" / "train_ddp.py")]  # a script that exists: main checks it


def test_launcher_warns_once_per_inversion_and_launches(launcher: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "ft_monitor.launcher"):
        rc = launcher_main.main(_launch("--ft-process-group-timeout", "5", "--ft-rank-section-timeouts", "step:30"))
    assert rc == 0 and len(launcher) == 1
    (line,) = [r.getMessage() for r in caplog.records if "wrong order" in r.getMessage()]
    assert "rank_section_timeouts['step'] = 30 s" in line and "process-group timeout of 5 s" in line


def test_launcher_strict_exits_2_with_one_line(launcher: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    rc = launcher_main.main(_launch("--ft-process-group-timeout", "5", "--ft-rank-section-timeouts", "step:30",
                                    "--ft-timeout-check", "strict"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and launcher == []
    assert len(err) == 1 and re.match(r"ft-launcher: timeouts in the wrong order \(timeout_check: strict\): "
                                      r"rank_section_timeouts\['step'\] = 30 s .* Fix: ", err[0]), err


def test_launcher_says_nothing_about_a_correct_set(launcher: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        rc = launcher_main.main(_launch("--ft-cfg-path", str(ROOT / "examples" / "ft.yaml"),
                                        "--ft-process-group-timeout", "300", "--ft-timeout-check", "strict"))
    assert rc == 0 and len(launcher) == 1
    # what an older torch lacks is said at start whatever the settings (test_what_this_torch_lacks_...)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and " is off on torch " not in r.getMessage()], caplog.text


def test_the_launcher_says_at_launch_when_start_up_is_not_timed(launcher: list[Any],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # issue 42: a start-up hang was never timed by default and nothing said so
    with caplog.at_level(logging.INFO):
        assert launcher_main.main(_launch()) == 0
    assert "start-up is not timed (startup_timeout off)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert launcher_main.main(_launch("--ft-startup-timeout", "600")) == 0
    assert "start-up is not timed" not in caplog.text


@pytest.mark.parametrize("check, rc, lines", [("warn", 0, 1), ("strict", 2, 1), ("off", 0, 0)])
def test_serve_checks_what_it_knows_without_torch(check: str, rc: int, lines: int, isolated_cli: None,
                                                  capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
                                                  tmp_path: Path) -> None:
    got = cli.main([cli.CHECK_SERVE, "--socket", str(tmp_path / "r.sock"), "--ft-process-group-timeout", "5",
                    "--ft-rank-section-timeouts", "step:30", "--ft-timeout-check", check])
    err = [line for line in (capsys.readouterr().err + caplog.text).splitlines() if "wrong order" in line]
    assert got == rc and len(err) == lines, err


# -- the SDK helper for init_process_group(timeout=) ----------------------------------------
def test_process_group_timeout_comes_from_the_setting_handed_to_the_worker() -> None:
    assert ft_client.process_group_timeout is process_group_timeout
    assert process_group_timeout(environ={}) is None  # torch's default (init_process_group accepts None)
    assert process_group_timeout(timedelta(seconds=9), environ={}) == timedelta(seconds=9)
    assert process_group_timeout(environ={"FT_PROCESS_GROUP_TIMEOUT": "300.0"}) == timedelta(seconds=300)
    with pytest.raises(ProcessGroupTimeoutError, match=r"^FT_PROCESS_GROUP_TIMEOUT='-1': must be a number of "):
        process_group_timeout(environ={"FT_PROCESS_GROUP_TIMEOUT": "-1"})


def test_the_launcher_hands_process_group_timeout_to_each_worker() -> None:
    from ft_monitor.launcher.agent.agent import FtRuntime

    class Pool:
        def socket(self, local_rank: int) -> Path:
            return Path(f"/tmp/ft-x/monitor{local_rank}.sock")

    class Server:
        path = "/tmp/ft-x/launcher.sock"

    ft = FtRuntime(settings(process_group_timeout=300), Pool(), Server(), None)  # type: ignore[arg-type]
    assert process_group_timeout(environ=ft.worker_env(0)) == timedelta(seconds=300)


def test_flight_recorder_dumps_go_to_the_first_private_place(tmp_path: Path) -> None:
    """Issue 38: torch's default is /tmp/nccl_trace_rank_<rank>, a name anyone can plant first."""
    from ft_monitor.launcher.agent.worker_env import fr_dump_prefix

    private, open_to_all, attempt = tmp_path / "reports", tmp_path / "shared", tmp_path / "attempt_0" / "1"
    for d in (private, open_to_all, attempt):
        d.mkdir(parents=True)
    open_to_all.chmod(0o777)
    error_file = str(attempt / "error.json")
    assert fr_dump_prefix(error_file, str(private)) == f"{private}/flight_recorder_rank_"
    assert fr_dump_prefix(error_file, None) == f"{attempt}/flight_recorder_rank_"
    assert fr_dump_prefix(error_file, str(open_to_all)) == f"{attempt}/flight_recorder_rank_"
    assert fr_dump_prefix(os.devnull, str(open_to_all)) is None
    (tmp_path / "link").symlink_to("/tmp")
    assert fr_dump_prefix(str(tmp_path / "link" / "error.json"), None) is None  # /tmp: others write there


# -- the torch the launcher runs on ---------------------------------------------------------
def test_the_installed_torch_has_every_internal_the_launcher_relies_on() -> None:
    assert torch_support.missing() == []
    assert torch_support.problem() is None and torch_support.untested() is None


def test_tested_is_what_ci_runs_and_the_ends_of_the_range_pyproject_admits() -> None:
    from packaging.specifiers import SpecifierSet

    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"torch(>=[^"]+)"', text)
    assert torch_support.TESTED == ("2.6.0", "2.13.0", "2.14.1")
    assert all(v in SpecifierSet(spec) for v in torch_support.TESTED)
    compat = (ROOT / "scripts" / "test-compat").read_text()  # the tier's versions, beside setup-env's default
    assert "versions=(2.6.0 2.14.1)" in compat and "torch==2.13.0" in (ROOT / "scripts" / "setup-env").read_text()
    for release, tested in [("2.6.0+cu124", True), ("2.13.0+cpu", True), ("2.14.1", True), ("2.14.0", True),
                            ("2.9.0a0+abc.nv25.10", False), ("2.10.0", False)]:
        assert (torch_support.minor(release) in torch_support.tested_minors()) is tested, release


@pytest.mark.parametrize("fake, named", [
    ("no _monitor_workers", "LocalElasticAgent's own _start_workers, _monitor_workers"),
    ("start_processes without envs", "local_elastic_agent.start_processes(envs=...)"),
])
def test_a_torch_missing_an_internal_is_refused_at_start_in_one_line(
    fake: str, named: str, launcher: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    if fake == "no _monitor_workers":
        monkeypatch.delattr(lea.LocalElasticAgent, "_monitor_workers")
    else:
        monkeypatch.setattr(lea, "start_processes", lambda name, entrypoint, args: None)
    monkeypatch.setattr("torch.__version__", "2.99.0")
    rc = launcher_main.main(_launch())
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and launcher == [], "started on a torch it cannot run on"
    assert len(err) == 1 and err[0].startswith("ft-launcher: torch 2.99.0 is not supported: it lacks ") and named in err[0]
    assert "tested with torch 2.6.0, 2.13.0, 2.14.1" in err[0]


def test_an_untested_torch_with_every_internal_runs_with_one_warning(
    launcher: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("torch.__version__", "2.10.0")
    with caplog.at_level(logging.WARNING, "ft_monitor.launcher"):
        assert launcher_main.main(_launch()) == 0
    assert len(launcher) == 1
    assert "torch 2.10.0 is not a version ft-launcher was tested with (2.6.0, 2.13.0, 2.14.1)" in caplog.text


def test_what_this_torch_lacks_is_named_in_one_line_each_at_start(
    launcher: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ft_client import torch_features

    newest = torch_features.flight_recorder().records_gloo and torch_features.store_clone()
    assert (torch_features.off() == []) is newest  # 2.13 and 2.14 lack nothing; 2.6 all three
    monkeypatch.setattr(torch_features, "store_clone", lambda: False)  # as on torch 2.6
    monkeypatch.setattr(torch_features, "fsdp2_on_cpu", lambda: False)
    monkeypatch.setattr(torch_features, "flight_recorder", lambda: torch_features.NCCL_FR)
    monkeypatch.setattr("torch.__version__", "2.6.0")
    with caplog.at_level(logging.WARNING, "ft_monitor.launcher"):
        assert launcher_main.main(_launch()) == 0
    said = [r.getMessage() for r in caplog.records if " is off on torch " in r.getMessage()]
    assert said == [
        "ft-launcher: a private connection for the launchers' counters in the rendezvous store is off on torch 2.6.0 "
        "(it works from torch 2.8): " + torch_features.STORE_CLONE.without,
        "ft-launcher: FSDP2 (fully_shard) on CPU with gloo is off on torch 2.6.0 (it works from torch 2.7): "
        + torch_features.FSDP2_CPU.without,
        "ft-launcher: the Flight Recorder of gloo's collectives (a hang's verdict from every rank's last collectives) "
        "is off on torch 2.6.0 (it works from torch 2.8): " + torch_features.FLIGHT_RECORDER.without]
    assert len(launcher) == 1


def test_timeout_order_defaults_are_torchs() -> None:
    import torch.distributed.constants as constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)  # a CUDA build (the compatibility tier's)
    expected = nccl if nccl is not None else constants.default_pg_timeout
    assert torch_support.process_group_default().seconds == expected.total_seconds() == (600 if nccl else 1800)
    assert timeout_order.TORCH_SHUTDOWN_TIMEOUT == 30.0


def test_the_workers_are_told_the_rendezvous_stores_address() -> None:
    from torch.distributed import HashStore, PrefixStore, TCPStore

    from ft_monitor.launcher.agent.agent import store_address

    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert store_address(PrefixStore("torch.rendezvous.x.0", PrefixStore("y", store))) == f"127.0.0.1:{store.port}"
    assert store_address(HashStore()) is None


def test_a_named_store_address_is_parsed_or_refused_in_our_family() -> None:
    from ft_client.errors import FtError
    from ft_client.inprocess.store import store_address

    assert store_address("node-0:29400") == ("node-0", 29400)
    assert store_address("[::1]:7") == ("::1", 7)
    for bad in ("", "node-0", ":1", "h:0", "h:65536", "h:x", "h:-1"):
        with pytest.raises(FtError, match="FT_INPROCESS_STORE"):
            store_address(bad)
