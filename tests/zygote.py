"""Pay torch's import once per test worker: Python processes forked from a preloaded interpreter.

Most of the suite's CPU went to starting interpreters that import torch: every rank, worker
and launcher of every end-to-end test imported it afresh (about 1 s of CPU each, 2.3 s with
DDP's torch._dynamo). Here each pytest(-xdist) worker keeps one *zygote*: the product's own
worker template (`ft_monitor.launcher.warm.template`, started through `forked.Template`), which
has imported torch, DDP, the elastic agent, numpy and ft-monitor's modules once, and forks a
ready interpreter for every ``python script.py ...`` a test starts, run as that command would
run it (``sys.argv``, ``__main__``, ``sys.path[0]``, the environment, the cwd, stdout and
stderr, exit codes; its own session and process group, as ``start_new_session=True`` gives).
docs/launcher.md lists what such a fork cannot have (variables read when the interpreter
starts: PYTHONHASHSEED, PYTHONWARNINGS, ...; stdin is /dev/null).

The forked process is this process's child: the template double-forks, and this process is
a child subreaper while it asks (`_adopting`), so the worker is reparented here and
`ForkedProcess` waits for it, reads its exit status and signals it as `subprocess.Popen`
does. The subreaper flag is set only for the request's duration: any other orphan of the
tests' process tree goes to init, as it would without the zygote.

`popen` is the one entry point: it forks when the command is a script run by this
interpreter and nothing asks for what a fork cannot give (stdin, a pre-exec hook, ``-c``,
``-m``); anything else is started by `subprocess.Popen`. ``cold=True`` always starts a fresh
interpreter: tests of a cold start (an import-time hook, the template itself, an environment
variable read at start) say so. ``FT_TEST_ZYGOTE=0`` turns the zygote off for a whole run.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ft_monitor.core.template_argv import Plan, plan
from ft_monitor.launcher.warm.forked import ForkedProcess, Template, TemplateError, TemplateRefused

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
ENV_SWITCH = "FT_TEST_ZYGOTE"
PRELOAD = [
    "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.optim",
    "torch.distributed.run", "torch.distributed.launcher.api", "torch.distributed.elastic.agent.server.local_elastic_agent",
    "numpy", "msgpack", "yaml",
    "ft_client", "ft_client.inprocess", "ft_client.snapshot",
    "ft_monitor.launcher.main", "ft_monitor.launcher.agent.agent", "ft_monitor.launcher.agent.control",
    "ft_monitor.launcher.agent.monitors", "ft_monitor.launcher.telemetry.telemetry", "ft_monitor.launcher.agent.observed",
    "ft_monitor.launcher.telemetry.torch_events", "ft_monitor.launcher.telemetry.metrics_http", "ft_monitor.launcher.telemetry.summary_text",
    "ft_monitor.launcher.warm.warm", "ft_monitor.launcher.warm.forked",
]
"""What the tests' processes import: torch with DDP (which imports torch._dynamo), the elastic
agent (ft-launcher), and ft-monitor's own modules. Each must start no thread at import."""
READY_TIMEOUT = 120.0
_PR_SET_CHILD_SUBREAPER = 36
_lock = threading.Lock()
_zygote: Template | None = None
_dir: Path | None = None
_broken: str | None = None
_registered: list[bool] = []


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


@contextlib.contextmanager
def _adopting() -> Iterator[None]:
    """This process is a child subreaper while the template forks: the worker, orphaned by the
    template's intermediate child, becomes this process's child."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise TemplateError("prctl(PR_SET_CHILD_SUBREAPER) refused")
    try:
        yield
    finally:
        prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _template() -> Template | None:
    """This process's zygote, started on first use (and waited for: about 3 s of imports); None
    when it cannot run (then everything starts cold, and `broken` says why)."""
    global _zygote, _dir, _broken
    with _lock:
        if _broken is not None:
            return None
        if _zygote is not None and _zygote.alive():
            return _zygote
        if _dir is None:
            _dir = Path(tempfile.mkdtemp(prefix="ft-zygote-", dir="/tmp"))
        if not _registered:
            atexit.register(close)
            _registered.append(True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_CORE_"))}
        try:
            _zygote = Template.start(_dir, PRELOAD, env)
            _zygote.wait_ready(READY_TIMEOUT)
            status = _zygote.status()
        except (OSError, TemplateError) as e:
            _broken = f"the test zygote did not start: {e}"
            return None
        if status.get("failed") or status.get("unsafe"):
            _broken = f"the test zygote cannot serve: failed {status.get('failed')}, unsafe {status.get('unsafe')}"
            _zygote.close()
            _zygote = None
            return None
        return _zygote


def pids() -> frozenset[int]:
    """This process's zygote, if it runs: kept for the session, not a test's leak."""
    z = _zygote
    return frozenset({z.pid}) if z is not None else frozenset()


def fds() -> frozenset[int]:
    """Descriptors this module keeps open between tests: none (each spawn's are closed after it)."""
    return frozenset()


def broken() -> str | None:
    """Why the zygote is not used (None: it is, or has not been asked yet)."""
    return _broken


def close() -> None:
    """Stop this process's zygote (at exit, or by a test that wants none)."""
    global _zygote, _dir
    with _lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None
        if _dir is not None:
            shutil.rmtree(_dir, ignore_errors=True)
            _dir = None


def forkable(argv: Sequence[str]) -> Plan | None:
    """How the zygote would run ``argv``, or None when it cannot (not a script of this interpreter)."""
    got = plan([str(a) for a in argv], sys.executable, realpath=os.path.realpath)
    return got if isinstance(got, Plan) else None


class Forked(ForkedProcess):
    """A forked process with `subprocess.Popen`'s pipes and `communicate`."""

    def __init__(self, pid: int, args: Sequence[str], stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
        super().__init__(pid, args)
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = None

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (those that are pipes) to their end, then wait; as Popen's
        (``TimeoutExpired`` when the process has not closed them and exited within ``timeout``)."""
        import time

        end = None if timeout is None else time.monotonic() + timeout
        streams = [f for f in (self.stdout, self.stderr) if f is not None and not f.closed]
        chunks: dict[int, list[bytes]] = {id(f): [] for f in streams}
        with selectors.DefaultSelector() as sel:
            for f in streams:
                sel.register(f.fileno(), selectors.EVENT_READ, f)
            while sel.get_map():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[id(key.data)].append(data)
                    else:
                        sel.unregister(key.fd)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        out = []
        for f in (self.stdout, self.stderr):
            if f is None:
                out.append(None)
                continue
            raw = b"".join(chunks.get(id(f), []))
            out.append(raw.decode(getattr(f, "encoding", None) or "utf-8", "replace")
                       if isinstance(f, io.TextIOBase) else raw)
            f.close()
        return out[0], out[1]

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def _stream(spec: Any, default_fd: int, stdout_file: IO[Any] | None, text: bool
            ) -> tuple[IO[Any] | None, IO[Any] | None, list[int]]:
    """(what the child writes to, the parent's end of a pipe or None, descriptors to close after the spawn)."""
    if spec is None:
        return os.fdopen(os.dup(default_fd), "wb", closefd=True), None, []
    if spec == subprocess.DEVNULL:
        return open(os.devnull, "wb"), None, []
    if spec == subprocess.STDOUT:
        assert stdout_file is not None
        return stdout_file, None, []
    if spec == subprocess.PIPE:
        r, w = os.pipe2(os.O_CLOEXEC)
        ours: IO[Any] = os.fdopen(r, "r" if text else "rb", **({"encoding": "utf-8", "errors": "replace"} if text else {}))
        return os.fdopen(w, "wb"), ours, []
    if isinstance(spec, int):
        return os.fdopen(os.dup(spec), "wb"), None, []
    return spec, None, []


def popen(argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike[str] | None = None, stdout: Any = None, stderr: Any = None,
          text: bool = False, cold: bool = False, **kwargs: Any) -> Any:
    """Start ``argv`` as `subprocess.Popen` would (``start_new_session=True`` implied when forked),
    forked from the zygote when it can be; a `subprocess.Popen` otherwise."""
    args = [os.fspath(a) for a in argv]
    fork_ok = (not cold and enabled() and forkable(args) is not None
               and kwargs.get("stdin") in (None, subprocess.DEVNULL)
               and not (set(kwargs) - {"stdin", "start_new_session", "universal_newlines"}))
    template = _template() if fork_ok else None
    if template is None:
        return subprocess.Popen(args, env=None if env is None else dict(env), cwd=cwd, stdout=stdout, stderr=stderr,
                                text=text, **kwargs)
    text = text or bool(kwargs.get("universal_newlines"))
    child_out, our_out, _ = _stream(stdout, 1, None, text)
    child_err, our_err, _ = _stream(stderr, 2, child_out, text)
    owned = [f for f, spec in ((child_out, stdout), (child_err, stderr))
             if spec is None or spec in (subprocess.PIPE, subprocess.DEVNULL) or isinstance(spec, int)]
    try:
        with _adopting():
            proc = template.spawn(args, dict(os.environ if env is None else env),
                                  os.fspath(cwd) if cwd is not None else os.getcwd(), child_out, child_err,
                                  timeout=30)
    except TemplateRefused:  # e.g. a script that does not exist: the interpreter says so, as it would
        for f in (our_out, our_err):
            if f is not None:
                f.close()
        return subprocess.Popen(args, env=None if env is None else dict(env), cwd=cwd, stdout=stdout, stderr=stderr,
                                text=text, **kwargs)
    finally:
        for f in {id(f): f for f in owned}.values():
            f.close()
    forked = Forked(proc.pid, args, our_out, our_err)
    proc._close_pidfd()
    return forked


def run(argv: Sequence[str | os.PathLike[str]], *, timeout: float | None = None, capture_output: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` through `popen`: the process is killed (its group) when ``timeout`` passes."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    proc = popen(argv, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, 9) if kwargs.get("start_new_session") or isinstance(proc, Forked) else proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
