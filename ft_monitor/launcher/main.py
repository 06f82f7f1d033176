"""`ft-launcher`: torchrun's command line plus the --ft-* settings.

Parses with torchrun's own parser (every torchrun flag keeps its meaning), adds
``--ft-cfg-path`` and ``--ft-<field>`` for every FaultToleranceConfig field (also
spelled ``--ft-param-<field>``, as nvidia-resiliency-ext's launcher once had them),
carries nvidia-resiliency-ext's other ft_launcher flags over (nvrx_flags.py),
validates them once (ft_monitor.config) into the typed `settings.Settings` that
the launcher and every daemon run with, starts the launcher socket and the
monitors, then runs torchrun's launch path with FtLocalElasticAgent in place of
LocalElasticAgent. Exit codes are in exit_codes.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ft_client import torch_features
from ft_client.safefiles import write_json_atomic
from ft_monitor.config import ConfigError, FaultToleranceConfig, cli_overrides, load_config
from ft_monitor.core import timeout_order
from ft_monitor.core.server_log import printable
from ft_monitor.core.settings import Settings, SettingsError
from ft_monitor.launcher import early_check, exit_codes, nvrx_flags
from ft_monitor.launcher.agent import secret_env, torch_support
from ft_monitor.launcher.rdzv import store_gone
from ft_monitor.launcher.store import agreed_key, store_board
from ft_monitor.launcher.store.store_auth import SecretError
from ft_monitor.launcher.warm import template_fork

log = logging.getLogger("ft_monitor.launcher")

SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ft-launcher"
    parser.description = ("torchrun with a hang monitor beside every rank: hung or crashed ranks are detected, "
                          "dumped and the job restarted. Every torchrun flag keeps its meaning.")
    early_check.add_launcher_flags(parser)
    early_check.refuse_in_one_line(parser)
    return parser


@contextlib.contextmanager
def _agent_swapped_in(ft: Any, telemetry: Any) -> Iterator[None]:
    """torch's launch_agent builds `LocalElasticAgent(...)`; make that ours for this run."""
    import torch.distributed.launcher.api as launcher_api

    from ft_monitor.launcher.agent.observed import FtObservedAgent

    original = getattr(launcher_api, "LocalElasticAgent")  # torch internals: checked to exist at start
    setattr(launcher_api, "LocalElasticAgent", functools.partial(FtObservedAgent, ft=ft, telemetry=telemetry))
    try:
        yield
    finally:
        setattr(launcher_api, "LocalElasticAgent", original)


def status_main(argv: list[str]) -> int:
    """`ft-launcher status [DIR ...] [--json] [--watch [S]] [--count N]`: the live view of running launchers
    (DIR: a launcher's run directory, or the run's log folder that `ft-monitor report` takes; default:
    every running one of this user's under /tmp)."""
    from ft_monitor.cli import EXIT_FAILURE, add_live_view_flags, live_view
    from ft_monitor.views.live_view import find_run_dirs, run_dir_of_log_folder

    parser = argparse.ArgumentParser(prog="ft-launcher status", description=status_main.__doc__)
    parser.add_argument("dirs", nargs="*", metavar="DIR")
    add_live_view_flags(parser)
    args = parser.parse_args(argv)
    dirs = []
    for d in args.dirs:  # or the run's log folder (what `ft-monitor report` takes): its launcher's, if it runs
        if os.path.isfile(os.path.join(d, "events.jsonl")):
            found = run_dir_of_log_folder(d)
            if found is None:
                print(f"ft-launcher status: no running launcher of yours writes to {d} (it has exited); "
                      f"ft-monitor report {d} makes the run's page", file=sys.stderr)
                return EXIT_FAILURE
            d = str(found)
        dirs.append(d)
    dirs = dirs or [str(d) for d in find_run_dirs()]
    if not dirs:
        print("ft-launcher status: no running ft-launcher of yours found under /tmp (give its run directory, "
              "logged as 'monitor(s) ready in DIR')", file=sys.stderr)
        return EXIT_FAILURE
    return live_view(dirs, args.json, args.watch, args.count, prog="ft-launcher status")


def main(argv: list[str] | None = None, early: Any = None) -> int:
    """ft-launcher; ``early``: `template_fork.Early`, the worker template `entrypoint` forked."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"] and not os.path.exists("status"):
        return status_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="[ft-launcher] %(asctime)s %(levelname)s %(message)s")
    refused = early_check.problem(argv, os.environ)  # before torch is imported: one line within a second
    if refused is not None:
        print(f"ft-launcher: {refused}", file=sys.stderr)
        return exit_codes.LAUNCHER_ERROR
    unsupported = torch_support.problem()  # before anything of torch's is used: never fail mid-run
    if unsupported is not None:
        print(f"ft-launcher: {unsupported}", file=sys.stderr)
        return exit_codes.LAUNCHER_ERROR
    untested = torch_support.untested()
    if untested is not None:
        log.warning("ft-launcher: %s", untested)
    for line in torch_features.off():  # what this torch lacks, said once here and never a traceback later
        log.warning("ft-launcher: %s", line)
    parser = build_parser()
    args = early_check.parse_launch(parser, argv)
    nvrx = nvrx_flags.apply(args)  # nvidia-resiliency-ext's ft_launcher flags, carried over to ours
    if nvrx.refusal is not None:
        print(f"ft-launcher: {nvrx.refusal}", file=sys.stderr)
        return exit_codes.LAUNCHER_ERROR
    for line in nvrx.warnings:
        log.warning("ft-launcher: %s", line)
    for line in nvrx.notes:
        log.info("ft-launcher: %s", line)
    absolute_paths(args)
    if args.ft_preload:
        from ft_monitor.core.preload import PreloadError, parse_preload

        try:
            parse_preload(args.ft_preload)
        except PreloadError as e:
            print(f"ft-launcher: {e}", file=sys.stderr)
            return exit_codes.LAUNCHER_ERROR
    cli = cli_overrides(args)
    try:
        config = Settings.from_config(load_config(args.ft_cfg_path, os.environ, cli, log=log))
    except (ConfigError, SettingsError) as e:
        print(f"ft-launcher: {e}", file=sys.stderr)
        return exit_codes.LAUNCHER_ERROR
    try:
        secret = secret_env.job_secret(args.ft_job_secret_file, os.environ)
    except SecretError as e:
        print(f"ft-launcher: {e}", file=sys.stderr)
        return exit_codes.LAUNCHER_ERROR
    logging.getLogger("ft_monitor").setLevel(config.log_level)
    if config.startup_timeout is None:
        log.info("ft-launcher: start-up is not timed (startup_timeout off): --ft-startup-timeout 600 times it")
    if not _timeouts_in_order(config, args):
        return exit_codes.LAUNCHER_ERROR
    missing = early_check.missing_script(argv)  # one line, not torch's 32 and exit 1
    if missing is not None:
        print(f"ft-launcher: {missing}", file=sys.stderr)
        return exit_codes.LAUNCHER_ERROR
    # torch >= 2.4 shares the agent's rendezvous TCPStore with the workers, with no
    # per-attempt key prefix: after a restart, gloo reads the previous attempt's peer
    # addresses and fails ("connectFullMesh failed ... Connection refused") or hangs.
    # torch's own opt-out gives every attempt a fresh store hosted by its rank 0.
    os.environ.setdefault(SHARED_STORE_OPT_OUT, "1")
    return launch(args, config, args.ft_summary_json, secret, early)


def max_nodes(nnodes: object) -> int | None:
    """The most nodes ``--nnodes`` (``N`` or ``MIN:MAX``) allows; None when it cannot be read."""
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        return None


PATH_ARGS = ("log_dir", "ft_summary_json", "ft_cfg_path", "ft_job_secret_file")
"""The launcher's flags that name files or folders: made absolute at start."""


def absolute_paths(args: argparse.Namespace) -> None:
    """Every path the launcher takes, absolute from the directory it was started in: the
    monitors and workers resolve a relative one from elsewhere (a monitor put the stack dumps
    of a relative ``--log-dir`` in the launcher's private folder, deleted at exit), and every
    path the launcher prints must still name the same file after it has exited."""
    for name in PATH_ARGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            setattr(args, name, os.path.abspath(value))


def _timeouts_in_order(config: Settings, args: argparse.Namespace) -> bool:
    """The launch check of timeout_order.py with what the launcher knows: torch's default
    process-group timeout and its shutdown wait. One warning per inversion, or with
    ``timeout_check: strict`` one line and False."""
    if config.timeout_check == "off":
        return True
    shutdown = getattr(args, "shutdown_timeout", None)
    if shutdown is None:
        try:
            shutdown = float(os.environ.get(timeout_order.SHUTDOWN_TIMEOUT_ENV, timeout_order.TORCH_SHUTDOWN_TIMEOUT))
        except ValueError:
            shutdown = timeout_order.TORCH_SHUTDOWN_TIMEOUT
    known = timeout_order.facts(config, os.environ, torch_default=torch_support.process_group_default(),
                                shutdown_timeout=float(shutdown))
    found = timeout_order.inversions(config, known)
    if found and config.timeout_check == "strict":
        print(f"ft-launcher: {timeout_order.refusal(found)}", file=sys.stderr)
        return False
    for inversion in found:
        log.warning("ft-launcher: timeouts in the wrong order: %s", inversion.message())
    return True


def launch(args: argparse.Namespace, config: Settings | FaultToleranceConfig, summary_json: str | None = None,
           job_secret: bytes | None = None, early: Any = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size
    from torch.distributed.run import run as torch_run

    from ft_monitor.launcher.agent.agent import FtRuntime
    from ft_monitor.launcher.agent.control import LauncherServer
    from ft_monitor.launcher.agent.monitors import MonitorPool
    from ft_monitor.launcher.incident.progress import ProgressTracker
    from ft_monitor.launcher.telemetry.telemetry import Telemetry
    from ft_monitor.launcher.telemetry.torch_events import routed

    if not isinstance(config, Settings):
        config = Settings.from_config(config)
    run_dir = Path(tempfile.mkdtemp(prefix="ft-launcher-", dir="/tmp"))
    os.chmod(run_dir, 0o700)
    server = LauncherServer(str(run_dir / "launcher.sock"))
    server.start()
    monitors = MonitorPool(run_dir, determine_local_world_size(args.nproc_per_node), server.path, config)
    single = max_nodes(getattr(args, "nnodes", "1")) == 1
    if job_secret is None and not single:
        warn, line = agreed_key.start_line(args.rdzv_backend, str(args.nnodes))
        log.log(logging.WARNING if warn else logging.INFO, "%s", line)
    ft = FtRuntime(config, monitors, server,
                   ProgressTracker(config.max_no_progress_cycles, config.min_progress_iterations),
                   job_secret=job_secret, local_key=os.urandom(32) if job_secret is None and single else None)
    server.authorize(monitor=monitors.is_monitor, worker=ft.is_worker)
    ft.warm = _warm_starts(args, run_dir, early)
    telemetry = Telemetry(config=config, monitors=monitors, host=socket.gethostname(), nproc=monitors.nproc,
                          max_restarts=args.max_restarts, job_secret=job_secret)
    try:
        metrics = _start_metrics(config, telemetry)
    except OSError as e:
        log.error("ft-launcher: cannot serve /metrics on %s port %s: %s", config.metrics_address, config.metrics_port,
                  e.strerror or e)
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        return exit_codes.LAUNCHER_ERROR
    code = exit_codes.SUCCESS
    if args.rdzv_backend.startswith("etcd"):
        store_board.read_etcd_folder_once()  # torch's EtcdStore reads its whole folder per key
    try:
        monitors.start()
        with _agent_swapped_in(ft, telemetry), routed(telemetry.torch_event, telemetry.torch_metrics, args), \
                store_gone.quiet_client(args.rdzv_backend):
            run_torch: Any = torch_run  # untyped in torch
            run_torch(args)
    except ChildFailedError as e:
        _report_root_cause(e)
        code = ft.outcome if ft.outcome is not None else exit_codes.WORKERS_FAILED
        if not ft.outcome_message and ft.last_failure:
            ft.outcome_message = f"{ft.last_failure}; no restart was left"
    except SignalException as e:
        log.warning("ft-launcher: stopped by %s", e.sigval.name)
        code = 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - rendezvous errors, monitors that cannot start: one clear line
        gone = store_gone.outcome(e, args.rdzv_backend, args.rdzv_endpoint, started=bool(ft.attempts))
        line, fallback = gone or (f"{type(e).__name__}: {e}", exit_codes.LAUNCHER_ERROR)
        log.error("ft-launcher: %s", line)
        code = ft.outcome if ft.outcome is not None else fallback
        if gone and not ft.outcome_message:
            ft.outcome_message = line
    finally:
        ft.groups.kill()
        ft.groups.close()
        if ft.warm is not None:
            ft.warm.close()
        _finish_telemetry(telemetry, metrics, code, ft.outcome_message, args)
        monitors.stop(config.termination_grace_time)
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    data = summary_data(ft, code, telemetry.summary())
    written = _write_summary(data, summary_json or _default_summary_path(telemetry.events.path))
    _print_summary(ft, data, written)
    return code


SUMMARY_FILE = "summary.json"
"""The summary's name in the run's log folder, beside events.jsonl, where no --ft-summary-json is given."""


def _default_summary_path(events: Path | None) -> str | None:
    """``summary.json`` beside the run's events.jsonl (torch's per-run log folder, kept after
    exit); None where no such folder was made (the launch failed before any worker started)."""
    return None if events is None else str(events.parent / SUMMARY_FILE)


def _warm_starts(args: argparse.Namespace, run_dir: Path, early: Any = None) -> Any:
    """The worker template of ``--ft-warm-restart`` (forked at the start, `template_fork`, or
    started now, warm by the first restart), or None."""
    preload = getattr(args, "ft_preload", None)
    first_attempt = bool(getattr(args, "ft_warm_start", False))
    if not getattr(args, "ft_warm_restart", False) and not first_attempt:
        if preload:
            log.warning("ft-launcher: --ft-preload does nothing without --ft-warm-restart")
        return None
    from ft_monitor.core.preload import parse_preload
    from ft_monitor.launcher.warm.warm import WarmStarts

    names, auto = parse_preload(preload)
    directory = run_dir / "template"
    directory.mkdir(mode=0o700)
    forked = early is not None and early.template is not None
    if early is not None and early.why_not:
        log.info("ft-launcher: %s", early.why_not)
    warm = WarmStarts(directory, names, auto, sys_path=template_fork.script_dirs(args), first_attempt=first_attempt,
                      template=early.template if forked else None)
    warm.start()
    if warm.template is not None:
        log.info("ft-launcher: warm %s: a worker template (pid %d%s) imports %s%s",
                 "starts and restarts" if first_attempt else "restarts", warm.template.pid,
                 ", forked from the launcher with its modules" if forked else "",
                 ", ".join(names), " and then what the workers load" if auto else "")
    return warm


def _start_metrics(config: Settings, telemetry: Any) -> Any:
    """/metrics (``metrics_port``) and the node-exporter textfile (``metrics_textfile``), if asked for."""
    from ft_monitor.launcher.telemetry.metrics import registry, write_textfile
    from ft_monitor.launcher.telemetry.metrics_http import MetricsServer

    reg = registry(lambda: telemetry.snapshot)
    server = None
    if config.metrics_port is not None:
        server = MetricsServer(reg, config.metrics_address, config.metrics_port)
        log.info("ft-launcher: metrics on %s (at most %d connections)", server.url, server.max_connections)
    textfile = config.metrics_textfile
    if textfile is not None:
        telemetry.write_textfile = functools.partial(write_textfile, textfile, reg)
    telemetry.launcher_started(None if server is None else server.url, textfile)
    return server


def _finish_telemetry(telemetry: Any, metrics: Any, code: int, outcome: str, args: argparse.Namespace) -> None:
    try:
        telemetry.finish(code, outcome)
    except Exception:  # noqa: BLE001 - the job's own exit code matters more than its last event
        log.exception("ft-launcher: recording the job's end failed")
    finally:
        telemetry.close(getattr(args, "log_dir", None))
        if metrics is not None:
            metrics.stop()


def _report_root_cause(e: Any) -> None:
    """What torchrun shows (its failure table), and the root cause's error file for a parent launcher."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    print(str(e), file=sys.stderr)
    if not e.failures:
        return
    _, failure = e.get_first_failure()
    if os.path.isfile(failure.error_file):
        handler = get_error_handler()
        handler.initialize()
        handler.dump_error_file(failure.error_file, failure.exitcode)


def summary_data(ft: Any, code: int, observed: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the run gathered, in the summary's JSON form: the --ft-summary-json file and the
    text summary (summary_text.py) both say this, and only this."""
    return {"exit_code": code, "hangs": ft.hangs, "restarts": [t.row() for t in ft.restarts],
            "inprocess_restarts": ft.inprocess_restarts, "attempts": ft.attempts,
            "diagnoses": ft.diagnoses,
            "monitor_restarts": ft.monitors.restarts, "outcome": ft.outcome_message,
            "warm_restarts": None if ft.warm is None else {
                "forked": {str(a): p for a, p in ft.warm.forked.items()},
                "fallbacks": ft.warm.fallbacks, "preload": ft.warm.preload},
            "observability": observed or {}}


def _print_summary(ft: Any, data: dict[str, Any], written: str | None = None) -> None:
    """The closing summary on stderr, once, after every run, a clean one too: aligned
    ``key : value`` lines (summary_text.py), with the summary file's path where it was written."""
    from ft_monitor.launcher.telemetry import summary_text

    rows = summary_text.rows(data, summary_text.read_evidence())
    if written is not None:
        rows.insert(len(rows) - 1, ("summary", printable(written)))  # before the exit code
    print("\n" + summary_text.format_rows(rows), file=sys.stderr)


def _write_summary(data: dict[str, Any], path: str | None) -> str | None:
    """Atomically, through a temporary file and a rename: a symlink planted at ``path``
    is replaced, never followed. The path written, or None."""
    if path is None:
        return None
    try:
        write_json_atomic(path, data)
    except OSError as e:
        log.error("ft-launcher: cannot write the summary %s: %s", path, e)
        return None
    return path


def entrypoint() -> None:
    """``ft-launcher``: with warm starts or restarts asked for, the worker template is forked
    from here first (`template_fork`: the child never comes back into `main`)."""
    argv = sys.argv[1:]
    early = None
    secret_env.take()  # before anything is forked or started: the secret is the launcher's alone (and non-dumpable)
    if argv[:1] != ["status"] and early_check.problem(argv, os.environ) is not None:
        sys.exit(main(argv))  # says why, before anything imports torch
    if template_fork.requested(argv):
        with template_fork.no_blas_pool():
            parser = build_parser()  # imports torch, as the launcher does anyway
        args = template_fork.parse_quietly(parser, argv, early_check.parse_launch)
        if args is not None:
            early = template_fork.fork_early(args, in_child=secret_env.forget)
    try:
        code = main(argv, early)
    finally:
        if early is not None:
            early.close()  # idempotent: closed by the launcher already, unless it stopped before using it
    sys.exit(code)


if __name__ == "__main__":
    entrypoint()
