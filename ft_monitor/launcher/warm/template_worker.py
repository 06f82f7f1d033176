"""In a worker just forked from the template: the process made to look like ``python script.py``
started with the worker's own environment, cwd and standard streams (`prepare_interpreter`,
`worker_signals`, `clear_pdeathsig`), then the script run as ``__main__`` (`run_worker`). What a
forked worker cannot have is in template.py's docstring.
"""

from __future__ import annotations

import builtins
import faulthandler
import importlib.machinery
import io
import os
import signal
import sys
import types
from dataclasses import dataclass
from typing import Any

from ft_client import startup
from ft_monitor.core.template_argv import Plan, ctype_locale, stdio_codec
from ft_monitor.core.template_request import SpawnRequest

_PR_SET_PDEATHSIG = 1


@dataclass
class Worker:
    """In the forked worker: what `main` runs once the template's code is behind it."""

    path: str
    """The script's absolute path (``__file__``)."""


def worker_signals(inherited_ignored: frozenset[int]) -> None:
    """The dispositions an exec'd worker starts with: what the launcher ignored stays ignored
    (exec keeps SIG_IGN; a launcher started by ``nohup ... &`` ignores SIGHUP, SIGINT and
    SIGQUIT, and so do its cold workers); the rest of what the template set goes back to the
    default, SIGINT to Python's KeyboardInterrupt as the interpreter sets it at start."""
    for sig in inherited_ignored:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):
            continue
    for sig, handler in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGCHLD, signal.SIG_DFL),
                         (signal.SIGINT, signal.default_int_handler)):
        if int(sig) not in inherited_ignored:
            signal.signal(sig, handler)


def clear_pdeathsig() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0)


def pythonpath_dirs(value: str | None, cwd: str) -> list[str]:
    """The directories of a PYTHONPATH ``value``, made absolute from ``cwd``."""
    return [os.path.abspath(os.path.join(cwd, p)) for p in (value or "").split(os.pathsep) if p]


def prepare_interpreter(plan: Plan, req: SpawnRequest, env: dict[str, str],
                         template_only_paths: set[str]) -> str:
    """Make this forked interpreter look like ``python [-u] script.py args`` started with ``env``
    in ``cwd``; the script's absolute path."""
    unbuffered = plan.unbuffered or bool(env.get("PYTHONUNBUFFERED"))
    codec = _worker_locale(env)
    sys.stdin = _stdio(0, "r", False, env, codec)
    sys.stdout = _stdio(1, "w", unbuffered, env, codec)
    sys.stderr = _stdio(2, "w", unbuffered, env, (codec[0], "backslashreplace"))
    # as the interpreter has them at start (typeshed marks them final)
    setattr(sys, "__stdin__", sys.stdin)  # noqa: B010
    setattr(sys, "__stdout__", sys.stdout)  # noqa: B010
    setattr(sys, "__stderr__", sys.stderr)  # noqa: B010
    if plan.dont_write_bytecode or env.get("PYTHONDONTWRITEBYTECODE"):
        sys.dont_write_bytecode = True
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    path = os.path.abspath(plan.script)
    sys.argv = [plan.script, *plan.args]
    sys.orig_argv = list(req.argv)
    # sys.path as `python script.py` makes it: the script's real directory, PYTHONPATH, then the rest
    # (the template's own entries and its PYTHONPATH's left out)
    rest = [p for p in sys.path if p not in template_only_paths]
    sys.path[:] = [os.path.dirname(os.path.realpath(path)), *pythonpath_dirs(env.get("PYTHONPATH"), req.cwd), *rest]
    if startup_hook_on(env.get("PYTHONPATH"), req.cwd):
        _start_up_hook()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # a fresh process draws its own seed; forks would all share the template's
    return path


def startup_hook_on(pythonpath: str | None, cwd: str) -> bool:
    """Whether ft-monitor's start-up hook is on this PYTHONPATH: a fresh interpreter would run it."""
    return startup.HOOK_DIR in pythonpath_dirs(pythonpath, cwd)


def _start_up_hook() -> None:
    """What ft-monitor's start-up hook (its ``sitecustomize`` on PYTHONPATH) does in a fresh
    worker: arm the start-up stack dump, and take the hook's directory off sys.path."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != startup.HOOK_DIR]
    try:
        startup.arm()
    except Exception as e:  # noqa: BLE001 - as the hook: never stop the worker from starting
        sys.stderr.write(f"ft-monitor start-up hook: no start-up stack dump for pid {os.getpid()}: {e}\n")


def _worker_locale(env: dict[str, str]) -> tuple[str, str]:
    """Set LC_CTYPE from the worker's ``env`` as the interpreter does at start, and return its
    stdio's (encoding, errors) before PYTHONIOENCODING (`stdio_codec`): the worker's locale
    decides them, not the template's."""
    import locale

    name = ctype_locale(env)
    try:
        locale.setlocale(locale.LC_CTYPE, name)
    except locale.Error:  # not installed: the interpreter stays in the C locale
        name = "C"
        locale.setlocale(locale.LC_CTYPE, "C")
    return stdio_codec(env, name, locale.getencoding())


def _stdio(fd: int, mode: str, unbuffered: bool, env: dict[str, str], codec: tuple[str, str]) -> io.TextIOWrapper:
    """A standard stream on ``fd`` as the interpreter opens it at start (closefd=False);
    ``codec``: its (encoding, errors) but for PYTHONIOENCODING."""
    encoding, err = codec
    io_encoding = env.get("PYTHONIOENCODING")
    if io_encoding:
        enc, _, errs = io_encoding.partition(":")
        encoding = enc or encoding
        if errs and fd != 2:
            err = errs
    raw = io.FileIO(fd, mode, closefd=False)
    tty = raw.isatty()
    buffer: Any
    if mode == "r":
        buffer = io.BufferedReader(raw)
    elif unbuffered:
        buffer = raw
    else:
        buffer = io.BufferedWriter(raw)
    line_buffering = mode == "w" and not unbuffered and (tty or fd == 2)
    return io.TextIOWrapper(buffer, encoding=encoding, errors=err, newline="\n",
                            line_buffering=line_buffering, write_through=mode == "w" and unbuffered)


def run_worker(worker: Worker) -> None:
    """Run the script as ``__main__``, as ``python script.py`` does. A SystemExit ends the
    process as the interpreter would (raised on from here); an uncaught exception prints
    its traceback (from the script's frame on) with ``sys.excepthook`` and exits with 1."""
    main = types.ModuleType("__main__")
    main.__dict__.update({
        "__file__": worker.path, "__cached__": None, "__builtins__": builtins, "__annotations__": {},
        "__loader__": importlib.machinery.SourceFileLoader("__main__", worker.path),
    })
    sys.modules["__main__"] = main
    try:
        with io.open_code(worker.path) as f:
            source = f.read()
        code = compile(source, worker.path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # from the script's frame on
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)

