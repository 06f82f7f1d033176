"""The worker template forked from ft-launcher itself at its start: ready when the launcher is.

A template started as ``python -m ft_monitor.launcher.warm.template`` (`forked.Template.start`) is
a second interpreter that imports torch again, beside the launcher's own import: a node paid
two imports, and a restart that came early waited for the second (docs/launcher.md, "Warm
restarts"). With ``--ft-warm-restart`` or ``--ft-warm-start``, ft-launcher's entry point
(`main.entrypoint`) instead parses its flags, which imports torch as the launcher does anyway,
and forks: the child is the template, with torch and everything else the launcher has
imported already in memory, shared copy-on-write; it imports only what ``--ft-preload`` adds.

The fork is made at the entry point, before `main.main`, so that it copies a launcher that has
done nothing yet: one thread (OpenBLAS's pool is kept from starting while torch is first
imported, as the exec'd template does), no signal handler or logging of its own, no file,
socket or child; and so that the child never returns into the launcher's code: its stack holds
only the entry point, and a worker forked from it ends as ``python script.py`` ends. The child
then does what the exec'd template does at its start: its own session, stdin from /dev/null,
stdout and stderr to its log, every other descriptor closed, killed with the launcher
(PR_SET_PDEATHSIG), served only to its parent (SO_PEERCRED).

Where it cannot fork (another thread is running), `fork_early` says why and the launcher starts
the template the usual way. ``--ft-preload auto``'s second template, made once the workers have
said what they loaded, is always started the usual way: the launcher has threads by then.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_client.errors import FtError

WARM_FLAGS = frozenset({"--ft-warm-restart", "--ft_warm_restart", "--ft-warm-start", "--ft_warm_start"})
_BLAS_THREADS = "OPENBLAS_NUM_THREADS"


@dataclass
class Early:
    """What `fork_early` made: the template (None when it did not fork) and why not."""

    template: Any = None
    """A `forked.Template` whose process is this launcher's child."""
    why_not: str | None = None

    def close(self) -> None:
        if self.template is not None:
            self.template.close()


def requested(argv: Sequence[str]) -> bool:
    """Whether ``argv`` may ask for warm starts or restarts (the parser decides; a script's own
    argument of that name is not the launcher's): a cheap look before anything is imported."""
    if "-h" in argv or "--help" in argv:
        return False
    return any(a.split("=", 1)[0] in WARM_FLAGS for a in argv)


@contextlib.contextmanager
def no_blas_pool() -> Iterator[None]:
    """While torch is first imported: OpenBLAS starts no thread pool (a fork copies one thread,
    and a pool whose threads are gone deadlocks the child's first matrix product). The variable
    is taken out again after, so that the launcher's workers get the environment they had."""
    if _BLAS_THREADS in os.environ:
        yield
        return
    os.environ[_BLAS_THREADS] = "1"
    try:
        yield
    finally:
        os.environ.pop(_BLAS_THREADS, None)


class _Refused(FtError):
    """The flags do not parse: `main` says why."""


def parse_quietly(parser: argparse.ArgumentParser, argv: Sequence[str],
                  parse: Callable[[argparse.ArgumentParser, Sequence[str]], argparse.Namespace]
                  ) -> argparse.Namespace | None:
    """The launcher's flags as ``parse`` reads them (the command line's rule: the script's own
    arguments are not parsed), or None where they do not parse (`main` then says why, once)."""
    def error(message: str) -> Any:
        raise _Refused(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        return parse(parser, argv)
    except (_Refused, SystemExit):
        return None


def threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def fork_early(args: argparse.Namespace, in_child: Callable[[], None] = lambda: None) -> Early:
    """Fork the template from this process if ``args`` ask for warm starts or restarts. In the
    parent: what was made. In the child: never returns (the template serves, then exits);
    ``in_child`` runs first there (the launcher's: drop the job secret, be dumpable again)."""
    from ft_monitor.core.preload import PreloadError, parse_preload
    from ft_monitor.launcher.warm.forked import ForkedProcess, Template

    if not (getattr(args, "ft_warm_restart", False) or getattr(args, "ft_warm_start", False)):
        return Early()
    try:
        names, _ = parse_preload(getattr(args, "ft_preload", None))
    except PreloadError:
        return Early()  # main refuses the flag
    running = threads()
    if running != 1:
        return Early(why_not=f"the launcher has {running} threads at its start, so the worker template is "
                             f"started as a new interpreter instead of forked from it")
    directory = Path(tempfile.mkdtemp(prefix="ft-template-", dir="/tmp"))
    os.chmod(directory, 0o700)
    socket_path = directory / "template.sock"
    log_path = directory / "template.log"
    paths = script_dirs(args)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            in_child()
            _become_template(log_path, parent)
        except BaseException:  # noqa: BLE001 - a template that cannot set itself up serves nobody
            os._exit(1)
        from ft_monitor.launcher.warm.template import serve_template

        sys.exit(serve_template(str(socket_path), parent, names, paths))  # up through the entry point: never main
    argv = [sys.executable, "-m", "ft_monitor.launcher.warm.template", "(forked from the launcher)"]
    return Early(Template(ForkedProcess(pid, argv), socket_path, log_path, owned_dir=directory))


def script_dirs(args: argparse.Namespace) -> list[str]:
    """The training script's directory (first on the template's path while it imports: the
    script's own modules preload too), for a script entry point."""
    script = getattr(args, "training_script", None)
    if isinstance(script, str) and not getattr(args, "module", False) and not getattr(args, "no_python", False):
        return [os.path.dirname(os.path.abspath(script))]
    return []


def _become_template(log_path: Path, parent: int) -> None:
    """In the child: what the exec'd template gets from its start (`forked.Template.start`)."""
    from ft_client.startup.parent_death import die_with_parent

    os.setsid()
    if not die_with_parent(signal.SIGKILL) or os.getppid() != parent:
        os._exit(1)  # the launcher is gone already, or the template would outlive it
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
