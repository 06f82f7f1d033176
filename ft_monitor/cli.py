"""`ft-monitor`: the only place that reads argv, configures logging and exits.

    ft-monitor serve  --socket PATH [--config FILE] [--loop auto|asyncio|uvloop] [--ft-<field> VALUE ...] [-- CMD ...]
    ft-monitor status --socket PATH [--json]
    ft-monitor status --all DIR [--json] [--watch [SECONDS]] [--count N]
    ft-monitor report RUN_DIR [RUN_DIR ...] [-o FILE]

`serve` reads its arguments and config with the parsers of ft_monitor.config_text
(no pydantic) and, when every value is good and nothing calls for a warning, runs the
daemon from that at once. Otherwise it checks them with the pydantic model in a helper
process (`python -m ft_monitor.cli --check-serve ...`) while it imports the daemon,
which says exactly what is wrong, or runs the daemon from the validated result, a
`settings.ServeSpec` passed as one JSON line: the daemon never loads pydantic, which
keeps it small and quick to start. ft-launcher writes the same `ServeSpec` to a file
for each of its daemons (`--run-checked FILE`).

Exit codes: 0 success; 1 runtime failure (socket in use, daemon unreachable);
2 bad usage or configuration (one line naming the field, the value and the rule).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ft_client.errors import FtError

if TYPE_CHECKING:
    from ft_monitor.core.settings import ServeSpec, Settings


from ft_monitor.core.serve_argv import CHECK_SERVE, RUN_CHECKED
from ft_monitor.core.server_log import LOG_FORMAT

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

SETTINGS_MARKER = "ft-monitor-settings: "


class UsageError(FtError):
    pass


def _new_loop_factory(name: str) -> Callable[[], Any]:
    """One table entry per loop; `auto` prefers uvloop and falls back to asyncio."""
    import asyncio

    if name in ("auto", "uvloop"):
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError as e:
            if name == "uvloop":
                raise UsageError("--loop uvloop: uvloop is not installed (pip install uvloop)") from e
    return asyncio.new_event_loop


def build_parser() -> argparse.ArgumentParser:
    from ft_monitor.config_text import add_config_flags

    parser = argparse.ArgumentParser(prog="ft-monitor", description="Per-rank hang monitor for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the monitor daemon for one rank",
                           description="Run the monitor daemon for one rank. With `-- CMD ...` it also starts CMD "
                                       "with FT_RANK_MONITOR_IPC_SOCKET set, and exits with CMD's exit code.")
    serve.add_argument("--socket", required=True, help="Unix socket path (its directory is made private, mode 0700)")
    serve.add_argument("--config", "--ft-cfg-path", dest="config", default=None, metavar="FILE",
                       help="YAML file with a fault_tolerance: mapping")
    serve.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                       help="event loop (default: uvloop when installed)")
    serve.add_argument("--log-file", default=None, help="also write the log to this file")
    serve.add_argument("--launcher-socket", default=None, help=argparse.SUPPRESS)  # set by ft-launcher
    add_config_flags(serve)
    serve.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS: a rank process to start and watch")

    status = sub.add_parser("status", help="print a running monitor's live state")
    which = status.add_mutually_exclusive_group(required=True)
    which.add_argument("--socket", help="one monitor's socket")
    which.add_argument("--all", metavar="DIR", help="every monitor socket in DIR (ft-launcher's run directory): "
                                                    "one line per rank")
    add_live_view_flags(status)
    status.add_argument("--timeout", type=float, default=5.0)

    report = sub.add_parser("report", help="render a run as one self-contained HTML page",
                            description="Render a run (ft-launcher's events.jsonl and the evidence beside it) as one "
                                        "HTML file: what happened, the verdict, the stacks, links to every evidence "
                                        "file, a timeline with a lane per rank, the incidents, goodput. Several run "
                                        "folders of one job (one per node, or a shared --log-dir) make one page.")
    report.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                        help="a run folder (holds events.jsonl), its events.jsonl, or a --log-dir holding run folders")
    report.add_argument("-o", "--output", default=None,
                        help="where to write the page (default: RUN_DIR/report.html, or with several run folders "
                             "report.html in the folder that holds them all)")
    return parser


def add_live_view_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--watch", nargs="?", type=float, const=1.0, default=None, metavar="SECONDS",
                        help="with --all: redraw every SECONDS (default 1) until interrupted")
    parser.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N views")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    if argv[:1] == [CHECK_SERVE]:
        return _check_serve(argv[1:])
    if argv[:1] == [RUN_CHECKED] and len(argv) == 2:
        return _run_checked_file(argv[1])
    args = build_parser().parse_args(argv)
    if args.command == "report":
        return _report(args)
    if args.all is not None:
        return live_view([args.all], args.json, args.watch, args.count, args.timeout, prog="ft-monitor status --all")
    return _status(args)


def live_view(dirs: list[str], as_json: bool, watch: float | None, count: int | None, timeout: float = 2.0,
              prog: str = "ft-monitor status") -> int:
    """`status --all DIR` and `ft-launcher status`: one table per run directory; --watch redraws
    in place. On a terminal each view fits its width and --watch's its height too, and a
    redraw goes back to the top and writes over the last one (erasing what is left of each
    line and below), so the terminal never scrolls and its history does not grow; elsewhere
    (a pipe, a file) the tables are whole and --watch appends them."""
    import shutil
    import time

    from ft_monitor.views import live_view as lv

    tty = sys.stdout.isatty()
    in_place = watch is not None and not as_json and tty
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "").replace("_", "")
    mark = lv.ELLIPSIS if encoding == "utf8" else "~"
    shown = 0
    try:
        while True:
            views = [(d, lv.gather(d, timeout)) for d in dirs]
            if as_json:
                print(json.dumps({d: lv.to_json(rows) for d, rows in views}, indent=2, sort_keys=True), flush=True)
            else:
                size = shutil.get_terminal_size() if tty else None
                heading = None if watch is None else (
                    f"{prog}: every {watch:g}s, {time.strftime('%H:%M:%S')} (Ctrl-C stops)")
                # in place, a column short of the window: a line that fills the last column leaves the
                # cursor there (xterm), where erasing to the end of the line would take its last character
                width = None if size is None else max(1, size.columns - (1 if in_place else 0))
                lines = lv.view_lines(views, width, size.lines if in_place and size is not None else None, heading,
                                      mark)
                if in_place:
                    # home, each line over the last view's (erasing its rest), then erase below; no
                    # newline after the last line, which may be the screen's bottom row: nothing scrolls
                    sys.stdout.write(("\033[?25l\033[H" if shown == 0 else "\033[H")
                                     + "".join(f"{line}\033[K" + ("\n" if i + 1 < len(lines) else "")
                                               for i, line in enumerate(lines)) + "\033[J")
                    sys.stdout.flush()
                else:
                    print("\n".join(lines), flush=True)
            shown += 1
            if watch is None or (count is not None and shown >= count):
                break
            time.sleep(watch)  # the refresh interval is what --watch asks for
    except KeyboardInterrupt:
        pass
    finally:
        if in_place and shown:
            sys.stdout.write("\033[?25h\n")  # the cursor shown again, below the last view
            sys.stdout.flush()
    return EXIT_OK if all(lv.monitor_sockets(d) for d in dirs) else EXIT_FAILURE


def _report(args: argparse.Namespace) -> int:
    from ft_monitor.launcher.telemetry.events import EventSchemaError
    from ft_monitor.views.report_html import ReportError, write_report

    try:
        path = write_report(args.run_dir, args.output)
    except (OSError, EventSchemaError, ReportError) as e:
        print(f"ft-monitor report: {e}", file=sys.stderr)
        return EXIT_FAILURE
    print(path)
    return EXIT_OK


def _configure_logging(level: int, log_file: str | None) -> None:
    """stderr, and ``log_file`` if given: opened without following a symlink or
    waiting on a FIFO (raises OSError, e.g. UnsafeFileError, naming the path)."""
    from ft_client.safefiles import open_append

    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.StreamHandler(os.fdopen(open_append(log_file), "a")))
    logging.basicConfig(level=level, format=LOG_FORMAT, handlers=handlers, force=True)


def _check_serve(argv: list[str]) -> int:
    """In the helper process: parse `serve`'s arguments, load and validate the config,
    print the result as one JSON line (or the error, exit 2)."""
    from ft_monitor.config import ConfigError, cli_overrides, load_config

    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    args = build_parser().parse_args(["serve", *argv])
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    try:
        config = load_config(args.config, os.environ, cli_overrides(args), log=logging.getLogger("ft_monitor"))
    except ConfigError as e:
        print(f"ft-monitor: {e}", file=sys.stderr)
        return EXIT_USAGE
    from ft_monitor.core.settings import ServeSpec, Settings, SettingsError

    try:
        spec = ServeSpec(Settings.from_config(config), args.socket, loop=args.loop, cmd=tuple(command),
                         log_file=args.log_file, launcher_socket=args.launcher_socket)
    except SettingsError as e:  # pydantic accepted what the daemon's own check refuses: a bug, said in one line
        print(f"ft-monitor: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not _timeouts_in_order(spec.settings):
        return EXIT_USAGE
    print(SETTINGS_MARKER + spec.to_json())
    return EXIT_OK


def _timeouts_in_order(settings: Settings) -> bool:
    """The launch check of timeout_order.py, without torch (the process-group timeout is
    known only when process_group_timeout is set): one warning per inversion, or with
    ``timeout_check: strict`` one line and False."""
    from ft_monitor.core import timeout_order

    if settings.timeout_check == "off":
        return True
    found = timeout_order.inversions(settings, timeout_order.facts(settings, os.environ))
    if found and settings.timeout_check == "strict":
        print(f"ft-monitor: {timeout_order.refusal(found)}", file=sys.stderr)
        return False
    for inversion in found:
        logging.getLogger("ft_monitor").warning("timeouts in the wrong order: %s", inversion.message())
    return True


def _serve(argv: list[str]) -> int:
    code = _quick_serve(argv)
    if code is not None:
        return code
    import subprocess

    checker = subprocess.Popen([sys.executable, "-m", "ft_monitor.cli", CHECK_SERVE, *argv],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from ft_monitor.daemon import server  # noqa: F401 - imported while the checker works

    out, err = checker.communicate()
    sys.stderr.write(err)
    if checker.returncode != 0 or not out.startswith(SETTINGS_MARKER):
        sys.stdout.write(out)  # --help lands here
        return checker.returncode
    return _run_checked_text(out[len(SETTINGS_MARKER):])


def _quick_serve(argv: list[str]) -> int | None:
    """Serve at once from the settings the text-form parsers make (no pydantic, no helper
    process): when every value parses, no field is unknown or unused here, and the timeouts
    are in order. None: the helper's pydantic check decides (and says what is wrong)."""
    from ft_monitor.config_text import cli_overrides, quick_settings
    from ft_monitor.core import timeout_order
    from ft_monitor.core.settings import ServeSpec, SettingsError

    try:
        args = build_parser().parse_args(["serve", *argv])  # a usage error (or --help) ends here, as in the helper
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    settings = quick_settings(args.config, os.environ, cli_overrides(args))
    if settings is None:
        return None
    if settings.timeout_check != "off" and timeout_order.inversions(settings, timeout_order.facts(settings,
                                                                                                  os.environ)):
        return None  # the helper logs each inversion (or refuses, strict)
    try:
        spec = ServeSpec(settings, args.socket, loop=args.loop, cmd=tuple(command), log_file=args.log_file,
                         launcher_socket=args.launcher_socket)
    except SettingsError:
        return None
    return _run_checked(spec)


def _run_checked_file(path: str) -> int:
    """`--run-checked FILE`: ft-launcher's ServeSpec for this daemon."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        print(f"ft-monitor: cannot read {path}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    return _run_checked_text(text)


def _run_checked_text(text: str | bytes) -> int:
    from ft_monitor.core.settings import ServeSpec, SettingsError

    try:
        spec = ServeSpec.from_json(text)
    except SettingsError as e:
        print(f"ft-monitor: {e}", file=sys.stderr)
        return EXIT_USAGE
    return _run_checked(spec)


def _run_checked(spec: ServeSpec) -> int:
    import asyncio

    from ft_monitor.daemon import server
    from ft_monitor.daemon.listener import ListenerError

    if spec.parent_pid is not None:
        import signal

        from ft_client.startup.parent_death import die_with_parent

        die_with_parent(signal.SIGTERM)
        if os.getppid() != spec.parent_pid:  # gone before the prctl took effect
            print(f"ft-monitor: parent process {spec.parent_pid} has exited; not serving", file=sys.stderr)
            return EXIT_FAILURE

    try:
        _configure_logging(spec.settings.log_level, spec.log_file)
    except OSError as e:
        print(f"ft-monitor: --log-file: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        loop_factory = _new_loop_factory(spec.loop)
    except UsageError as e:
        print(f"ft-monitor: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(server.run_daemon(spec.settings, spec.socket, command=list(spec.cmd) or None,
                                                launcher_socket=spec.launcher_socket))
    except ListenerError as e:
        print(f"ft-monitor: {e}", file=sys.stderr)
        return EXIT_FAILURE


def _status(args: argparse.Namespace) -> int:
    from ft_client.observer import status
    from ft_client.wire.transport import TransportError

    try:
        st = status(args.socket, args.timeout)
    except (OSError, TransportError) as e:
        print(f"ft-monitor: no monitor answers at {args.socket}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return EXIT_OK
    from ft_monitor.core.status import StatusError, format_status

    try:
        print(format_status(st))
    except StatusError as e:
        print(f"ft-monitor: the monitor at {args.socket} sent a status this version cannot read: {e}",
              file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
