"""nvidia-resiliency-ext's ft_launcher flags that torchrun's parser lacks (ft_monitor/launcher/nvrx_flags.py):
every one is accepted and carried over to ours (torch's flag or our setting), accepted and ignored
with one warning line saying why, or refused with one line saying what to do instead; checked
at the argument level (the early check before torch is imported, then the full parse and
`nvrx_flags.apply`), and one real run of ``ft_launcher --term-timeout=5`` (issue 39, item 5)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ft_monitor.config_text import cli_overrides
from ft_monitor.launcher import exit_codes, nvrx_flags
from ft_monitor.launcher.early_check import problem
from ft_monitor.launcher.nvrx_flags import FLAGS, NvrxFlag, Outcome
from tests.launchers import Launcher
from tests.procs import ROOT

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

TRAIN = "examples/train_ddp.py"
CFG = str(ROOT / "examples" / "ft.yaml")

REFERENCE_FLAGS = """
--fault-tol-cfg-path --ft-attribution-analysis-backend --ft-attribution-compute-timeout --ft-attribution-decision-timeout
--ft-attribution-endpoint --ft-attribution-export-url --ft-attribution-llm-api-key-file --ft-attribution-llm-base-url
--ft-attribution-llm-model --ft-attribution-log-level --ft-attribution-startup-timeout --ft-attribution-stop-action
--ft-attrsvc-host --ft-attrsvc-port --ft-base-logfile --ft-cfg-path --ft-cfg_path --ft-check-remaining-processes
--ft-check_remaining_processes --ft-checkpoint-iteration-file --ft-checkpoint_iteration_file --ft-cycle-info-dir
--ft-domain-id-from-node-name --ft-domain-id-prefix --ft-domain_id_from_node_name --ft-domain_id_prefix
--ft-enable-dist-storage-healthcheck --ft-enable-gpu-memory-check --ft-enable-log-server --ft-enable-nic-healthcheck
--ft-enable-nic-monitor --ft-enable-rank-monitors --ft-enable_gpu_memory_check --ft-enable_nic_healthcheck
--ft-enable_nic_monitor --ft-enable_rank_monitors --ft-gpu-memory-poll-interval --ft-gpu-memory-reclaim-timeout
--ft-gpu-memory-tolerance-mb --ft-gpu_memory_poll_interval --ft-gpu_memory_reclaim_timeout --ft-gpu_memory_tolerance_mb
--ft-ignore-missing-cfg --ft-ignore_missing_cfg --ft-initial-rank-heartbeat-timeout --ft-initial_rank_heartbeat_timeout
--ft-install-exception-hook --ft-install_exception_hook --ft-link-down-path-template --ft-link-state-path-template
--ft-link_down_path_template --ft-link_state_path_template --ft-log-aggregator-count --ft-log-leaf-max-queue-chunks
--ft-log-level --ft-log-server-graceful-shutdown-timeout --ft-log-server-log --ft-log-server-log-prefix
--ft-log-server-port --ft-log_level --ft-max-no-progress-cycles --ft-max-no-progress-restarts
--ft-max_no_progress_cycles --ft-max_no_progress_restarts --ft-min-progress-iterations --ft-min_progress_iterations
--ft-no-restart-exit-code --ft-node-health-check-endpoint --ft-node-health-check-interval
--ft-node_health_check_endpoint --ft-node_health_check_interval --ft-num-warmup-iterations --ft-num_warmup_iterations
--ft-numa-bind-strict --ft-numa_bind_strict --ft-nvrx-logfile --ft-param-cfg-path --ft-param-enable-nic-monitor
--ft-param-enable_nic_monitor --ft-param-ignore-missing-cfg --ft-param-ignore_missing_cfg
--ft-param-initial-rank-heartbeat-timeout --ft-param-initial_rank_heartbeat_timeout
--ft-param-link-down-path-template --ft-param-link_down_path_template --ft-param-log-level --ft-param-log_level
--ft-param-node-health-check-interval --ft-param-node_health_check_interval --ft-param-pci-topo-file
--ft-param-pci_topo_file --ft-param-rank-heartbeat-timeout --ft-param-rank-out-of-section-timeout
--ft-param-rank-section-timeouts --ft-param-rank-termination-signal --ft-param-rank_heartbeat_timeout
--ft-param-rank_out_of_section_timeout --ft-param-rank_section_timeouts --ft-param-rank_termination_signal
--ft-param-restart-check-interval --ft-param-restart-policy --ft-param-restart_check_interval
--ft-param-restart_policy --ft-param-safety-factor --ft-param-safety_factor --ft-param-workload-check-interval
--ft-param-workload_check_interval --ft-pci-topo-file --ft-pci_topo_file --ft-per-cycle-applog-prefix
--ft-rank-heartbeat-timeout --ft-rank-out-of-section-timeout --ft-rank-section-timeouts --ft-rank-termination-signal
--ft-rank_heartbeat_timeout --ft-rank_out_of_section_timeout --ft-rank_section_timeouts --ft-rank_termination_signal
--ft-rdzv-impl --ft-rdzv_impl --ft-restart-check-interval --ft-restart-policy --ft-restart_check_interval
--ft-restart_policy --ft-safety-factor --ft-safety_factor --ft-segment --ft-skip-section-response
--ft-skip_section_response --ft-storage-health-check-path --ft-use-infra-group-rank --ft-use_infra_group_rank
--ft-workload-check-interval --ft-workload_check_interval --ft_attribution_analysis_backend
--ft_attribution_compute_timeout --ft_attribution_decision_timeout --ft_attribution_endpoint
--ft_attribution_export_url --ft_attribution_llm_api_key_file --ft_attribution_llm_base_url
--ft_attribution_llm_model --ft_attribution_log_level --ft_attribution_startup_timeout --ft_attribution_stop_action
--ft_attrsvc_host --ft_attrsvc_port --ft_base_logfile --ft_cycle_info_dir --ft_enable_dist_storage_healthcheck
--ft_enable_log_server --ft_log_aggregator_count --ft_log_leaf_max_queue_chunks
--ft_log_server_graceful_shutdown_timeout --ft_log_server_log --ft_log_server_log_prefix --ft_log_server_port
--ft_no_restart_exit_code --ft_nvrx_logfile --ft_param_enable_nic_monitor --ft_param_link_down_path_template
--ft_param_pci_topo_file --ft_per_cycle_applog_prefix --ft_segment --ft_storage_health_check_path
--ignore-missing-fault-tol-cfg --restart-policy --restart_policy --term-timeout --term_timeout
--workers-stop-timeout --workers_stop_timeout
""".split()
"""Every option of the reference's ft_launcher parser that torch 2.13's torchrun parser lacks: its
launcher.py and cli_args.py at NVIDIA/nvidia-resiliency-ext d8686d9c7015 and in every earlier
commit of its main line (v0.1.3 on). Its other options (--nnodes, --rdzv-*, --max-restarts,
--monitor-interval, --log-dir, ...) are torchrun's own."""


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from ft_monitor.launcher.main import build_parser

    return build_parser()


def test_every_flag_of_the_reference_launcher_is_one_of_ft_launchers(parser: argparse.ArgumentParser) -> None:
    from torch.distributed.run import get_args_parser

    known = parser._option_string_actions  # noqa: SLF001 - argparse's
    assert [f for f in REFERENCE_FLAGS if f not in known] == []
    assert set(REFERENCE_FLAGS).isdisjoint(get_args_parser()._option_string_actions)  # noqa: SLF001
    table = {name for entry in FLAGS for name in entry.names + entry.old}
    assert sorted(table - set(REFERENCE_FLAGS)) == []  # the table invents none


def _sample(entry: NvrxFlag) -> str | None:
    """A value the flag takes here without a refusal (None: a flag without one)."""
    if entry.value == "switch":
        return None
    if entry.only:
        return entry.only[0]
    if entry.choices:
        return entry.choices[0]
    if entry.target in ("ft_cfg_path", "ft_max_no_progress_cycles"):
        return CFG if entry.target == "ft_cfg_path" else "4"
    return {"float": "5", "int": "7"}.get(entry.value, "/data/x")


CASES = [pytest.param(entry, name, id=name) for entry in FLAGS for name in entry.names + entry.old]


def _torchrun_has_shutdown_timeout() -> bool:
    from torch.distributed.run import get_args_parser

    return any(a.dest == "shutdown_timeout" for a in get_args_parser()._actions)


needs_shutdown_timeout = pytest.mark.skipif(not _torchrun_has_shutdown_timeout(),
                                            reason="torchrun has --shutdown-timeout from torch 2.12")


@pytest.mark.parametrize(("entry", "name"), CASES)
def test_each_reference_flag_is_carried_over_ignored_with_a_warning_or_refused(
        entry: NvrxFlag, name: str, parser: argparse.ArgumentParser) -> None:
    value = _sample(entry)
    given = [name] if value is None else [f"{name}={value}"]
    assert problem(["--standalone", *given, TRAIN], {}) is None  # the early check, before torch
    args = parser.parse_args(["--standalone", *given, TRAIN])
    outcome = nvrx_flags.apply(args)
    assert outcome.refusal is None
    if entry.kind == "alias":
        assert getattr(args, entry.target) == value and outcome == Outcome()
    elif entry.kind == "torch" and not _torchrun_has_shutdown_timeout():  # torch 2.6-2.11
        assert outcome.notes[0].startswith(f"{entry.flag} 5 (nvidia-resiliency-ext) is ignored: ")
    elif entry.kind == "torch":
        assert args.shutdown_timeout == 5
        assert outcome == Outcome(notes=(f"{entry.flag} 5 (nvidia-resiliency-ext): torch's --shutdown-timeout 5 s",))
    elif entry.kind == "setting":
        assert cli_overrides(args)["termination_grace_time"] == "5"
        assert outcome.notes == (f"{entry.flag} 5 (nvidia-resiliency-ext): termination_grace_time = 5 s",)
        assert not outcome.warnings
    elif entry.kind == "same":
        assert outcome == Outcome()  # what ft-launcher does anyway: nothing to say
    else:
        assert outcome == Outcome(warnings=(f"ignored nvidia-resiliency-ext flag {entry.flag}: {entry.why}",))


@pytest.mark.parametrize(("argv", "line"), [
    (["--ft-restart-policy", "min-healthy"],
     "--ft-restart-policy min-healthy: ft-launcher restarts every worker group when any worker fails (any-failed, "
     "torchrun's way); drop the flag (for a job that goes on with fewer nodes, torch's --nnodes MIN:MAX)"),
    (["--restart-policy=min-healthy"], "--ft-restart-policy min-healthy: ft-launcher restarts every worker group"),
    (["--ft-no-restart-exit-code", "93"],
     "--ft-no-restart-exit-code 93: ft-launcher's exit code when it stops restarting for lack of progress is 3"),
    (["--term-timeout=-1"], "--term-timeout -1: must be a number of seconds >= 0"),
    (["--workers-stop-timeout", "inf"], "--workers-stop-timeout inf: must be a number of seconds >= 0"),
    (["--workers-stop-timeout", "7", "--ft-termination-grace-time", "3"],
     "--workers-stop-timeout 7 and --ft-termination-grace-time 3 set the same setting (termination_grace_time): "
     "give one of them"),
    (["--term-timeout=soon"], "argument --term-timeout: invalid float value: 'soon'"),
    (["--ft-rdzv-impl", "ring"], "argument --ft-rdzv-impl: invalid choice: 'ring' (choose from 'barrier', 'legacy')"),
], ids=["min-healthy", "old spelling", "exit code", "negative", "infinite", "two values", "not a number",
        "unknown impl"])
def test_a_value_with_no_meaning_here_is_refused_in_one_line_before_torch(argv: list[str], line: str) -> None:
    said = problem(["--standalone", *argv, TRAIN], {})
    assert said is not None and said.startswith(line) and "\n" not in said, said


def test_term_timeout_is_said_to_be_ignored_where_torchrun_has_no_shutdown_timeout() -> None:
    # torch 2.6-2.11: the note said "torch's --shutdown-timeout 3 s", a flag that torchrun did not have
    args = argparse.Namespace(**{f.dest: None for f in nvrx_flags.FLAGS if f.dest})
    args.nvrx_term_timeout = 2.5
    assert nvrx_flags.apply(args) == Outcome(notes=(
        "--term-timeout 2.5 (nvidia-resiliency-ext) is ignored: this torch's torchrun has no --shutdown-timeout (it "
        "has from torch 2.12) and waits its fixed 30 s",))
    assert not hasattr(args, "shutdown_timeout")


@needs_shutdown_timeout
def test_term_timeout_is_torchs_shutdown_timeout_rounded_up_and_one_of_the_two(parser: argparse.ArgumentParser) -> None:
    args = parser.parse_args(["--term-timeout", "2.5", TRAIN])
    assert nvrx_flags.apply(args).refusal is None and args.shutdown_timeout == 3
    args = parser.parse_args(["--term-timeout", "30", "--shutdown-timeout", "30", TRAIN])
    assert nvrx_flags.apply(args) == Outcome(notes=("--term-timeout 30 (nvidia-resiliency-ext): torch's "
                                                    "--shutdown-timeout 30 s",))
    args = parser.parse_args(["--term_timeout", "5", "--shutdown-timeout", "30", TRAIN])
    assert nvrx_flags.apply(args).refusal == ("--term-timeout 5 and --shutdown-timeout 30 (or PET_SHUTDOWN_TIMEOUT) "
                                              "set the same wait: give one of them")


@needs_shutdown_timeout
def test_the_launcher_says_a_conflict_only_torchs_parser_sees_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from ft_monitor.launcher.main import main

    assert main(["--standalone", "--term-timeout", "5", "--shutdown-timeout", "30", TRAIN]) == \
        exit_codes.LAUNCHER_ERROR
    assert capsys.readouterr().err.splitlines() == [
        "ft-launcher: --term-timeout 5 and --shutdown-timeout 30 (or PET_SHUTDOWN_TIMEOUT) set the same wait: give one "
        "of them"]


def test_ignored_flags_of_one_kind_share_one_warning_line(parser: argparse.ArgumentParser) -> None:
    args = parser.parse_args(["--ft-per-cycle-applog-prefix", "/l/job.log", "--ft-enable-log-server", "true",
                              "--ft-log-server-port", "5", "--ft-attribution-llm-model", "m", TRAIN])
    assert nvrx_flags.apply(args).warnings == (
        f"ignored nvidia-resiliency-ext flags --ft-per-cycle-applog-prefix, --ft-enable-log-server, "
        f"--ft-log-server-port: {nvrx_flags.LOGS}",
        f"ignored nvidia-resiliency-ext flag --ft-attribution-llm-model: {nvrx_flags.ATTRIBUTION}")


def test_ignore_missing_cfg_changes_nothing_a_config_file_that_cannot_be_read_is_still_refused(
        tmp_path: Path, parser: argparse.ArgumentParser) -> None:
    # the reference's flag once let it start without any config; ours never needs one, and its
    # launcher fails on a file that does not exist whatever the flag says (FileNotFoundError)
    missing = str(tmp_path / "nope.yaml")
    assert problem(["--ft-ignore-missing-cfg", TRAIN], {}) is None
    assert problem(["--ft-ignore-missing-cfg", "--ft-cfg-path", missing, TRAIN], {}) == \
        f"cannot read config file {missing}: No such file or directory"
    args = parser.parse_args(["--ft-ignore-missing-cfg", "--ft-cfg-path", CFG, TRAIN])
    assert nvrx_flags.apply(args) == Outcome() and args.ft_cfg_path == CFG


@pytest.mark.parametrize("spelling", ["--ft-rank_heartbeat_timeout", "--ft-param-rank_heartbeat_timeout",
                                      "--ft-workload_check_interval", "--ft-max_no_progress_restarts"])
def test_the_references_settings_spellings_are_the_settings(spelling: str, parser: argparse.ArgumentParser) -> None:
    field = {"--ft-workload_check_interval": "workload_check_interval",
             "--ft-max_no_progress_restarts": "max_no_progress_cycles"}.get(spelling, "rank_heartbeat_timeout")
    assert problem([spelling, "4", TRAIN], {}) is None
    assert cli_overrides(parser.parse_args([spelling, "4", TRAIN])) == {field: "4"}


@pytest.mark.e2e
@needs_shutdown_timeout
def test_ft_launcher_with_term_timeout_runs_a_job_and_torch_gets_the_wait(workdir: Path) -> None:
    # refused before ("unrecognized arguments: --term-timeout=5", exit 2); the scheduler grace below
    # makes the launcher's own timeout check name the shutdown wait torch will use
    la = Launcher(workdir, "--term-timeout=5", "--ft-scheduler-grace-time", "1", train_args=("--steps", "10"))
    summary = la.succeed()
    assert summary["exit_code"] == exit_codes.SUCCESS
    out = la.output()
    assert "ft-launcher: --term-timeout 5 (nvidia-resiliency-ext): torch's --shutdown-timeout 5 s" in out, out
    assert "torch's shutdown timeout 5 s" in out, out  # args.shutdown_timeout, which torch's launch reads
    assert "[rank 0] attempt 0: finished 10 steps" in out, out


def test_the_training_scripts_own_arguments_are_never_parsed_as_the_launchers() -> None:
    """A script's ``--workers 2`` was refused ("ambiguous option: --workers could match
    --workers-stop-timeout, --workers_stop_timeout"), and a unique prefix of one of our flags
    after the script would have been taken as ours: only what comes before the script is parsed."""
    from ft_monitor.launcher.early_check import parse_launch
    from ft_monitor.launcher.main import build_parser

    argv = ["--nproc-per-node", "2", "--max-restarts", "1", "train.py", "--workers", "2", "--term", "x",
            "--ft-cfg-path", "mine.yaml", "--max-rest", "9"]
    assert build_parser().parse_args(argv).training_script_args == argv[5:]  # no prefix is taken for a flag now
    args = parse_launch(build_parser(), argv)
    assert args.training_script == "train.py" and args.nproc_per_node == "2" and args.max_restarts == 1
    assert args.training_script_args == argv[5:] and args.ft_cfg_path is None
    module = parse_launch(build_parser(), ["--nproc-per-node", "2", "-m", "pkg.train", "--steps", "3"])
    assert module.module and module.training_script == "pkg.train" and module.training_script_args == ["--steps", "3"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--max-restart", "2", "train.py"], "unknown flag --max-restart (did you mean --max-restarts?)"),
    (["--nproc-per-nodes", "2", "train.py"], "unknown flag --nproc-per-nodes (did you mean --nproc-per-node?)"),
    (["--nnode=1", "--rdzv-endpont=h:1", "train.py"],
     "unknown flag --nnode (did you mean --nnodes?); unknown flag --rdzv-endpont (did you mean --rdzv-endpoint?)"),
])
def test_a_torchrun_flag_mistyped_is_one_line_with_the_nearest_and_never_a_prefix_taken(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A new user's ``--max-restart 2`` was silently taken as ``--max-restarts`` and a wrong torch
    flag printed torchrun's whole usage: now one line, as for our --ft-* flags, and exit 2."""
    from ft_monitor.launcher.early_check import parse_launch
    from ft_monitor.launcher.main import build_parser

    with pytest.raises(SystemExit) as info:
        parse_launch(build_parser(), argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err == f"ft-launcher: {said} (ft-launcher --help lists the flags)\n", err
