"""The launcher's side of the worker template: start it, ask it, and watch what it forks.

`Template` starts ``python -m ft_monitor.launcher.warm.template`` (`ft_monitor.launcher.warm.template`)
in a directory the launcher made, waits until it answers, asks for its status and asks it to
fork a worker (`Template.spawn`), which comes back as a `ForkedProcess`: a
``subprocess.Popen``-compatible object over a pid that is this process's child by
reparenting. That needs this process to be a child subreaper (`set_child_subreaper`, once,
before the template forks anything): the template double-forks, and the worker, orphaned by
the intermediate child, is reparented to its nearest subreaper ancestor.

torch's SubprocessContext uses ``proc.pid``, ``proc.poll()``, ``proc.wait(timeout)`` (which
raises ``subprocess.TimeoutExpired``) and ``os.killpg(proc.pid, sig)`` (the worker leads its
own process group); `ForkedProcess` gives those, with ``returncode`` as Popen reports it
(negative signal number for a signal), ``send_signal``, ``terminate``, ``kill`` and ``args``.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ft_monitor.core.template_argv import Refusal
from ft_monitor.core.template_request import encode_spawn, parse_spawn_reply, parse_status_reply
from ft_monitor.launcher.warm import template_wire
from ft_monitor.launcher.warm.template_wire import TemplateError, TemplateRefused

__all__ = ["ForkedProcess", "Template", "TemplateError", "TemplateRefused", "set_child_subreaper"]

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
UNKNOWN_RETURNCODE = 1
"""The returncode reported for a worker whose exit status this process cannot read (it is not
this process's child: ECHILD)."""
STOP_GRACE = 5.0
_started = itertools.count()
LOG_TAIL = 2000


def set_child_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (PR_SET_CHILD_SUBREAPER): an
    orphaned descendant (a worker forked by the template) becomes its child. False if refused."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class ForkedProcess:
    """A worker forked by the template, watched as ``subprocess.Popen`` watches its child."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._pidfd: int | None = os.pidfd_open(pid)

    def __repr__(self) -> str:
        return f"<ForkedProcess: returncode: {self.returncode} args: {self.args!r}>"

    def _reap(self, block: bool) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            try:
                pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                if not self._exited(0):
                    return None
                log.warning("ft-launcher: worker pid %d is not this process's child (no child subreaper?): "
                            "its exit status cannot be read; reported as %d", self.pid, UNKNOWN_RETURNCODE)
                self.returncode = UNKNOWN_RETURNCODE
            else:
                if pid == 0:
                    return None
                self.returncode = os.waitstatus_to_exitcode(status)
            self._close_pidfd()
            return self.returncode

    def _exited(self, timeout: float | None) -> bool:
        """Whether the pidfd says the process has exited within ``timeout`` seconds (None: no limit)."""
        fd = self._pidfd
        if fd is None:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1)))

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        return self._reap(block=False)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self._reap(block=False)
            if code is not None:
                return code
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout if timeout is not None else 0)
            self._exited(left)

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        fd = self._pidfd
        if fd is None:
            return
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()

    def __del__(self) -> None:
        try:
            self._close_pidfd()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass


class Template:
    """The launcher's handle on its worker template process."""

    def __init__(self, proc: subprocess.Popen[bytes] | ForkedProcess, socket_path: Path, log_path: Path,
                 owned_dir: Path | None = None) -> None:
        """``proc``: the template's process (started, or forked from this one: `template_fork`);
        ``owned_dir``: a folder of the template's own, removed at `close`."""
        self.proc = proc
        self.socket_path = socket_path
        self.log_path = log_path
        self.owned_dir = owned_dir

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, directory: Path, preload: Sequence[str], env: Mapping[str, str], *,
              sys_path: Sequence[str] = (), cwd: str | None = None) -> Template:
        """Start the template (its socket ``directory/template-PID-N.sock``, one per template so
        that a template started to replace another never shares its path; its log appended to
        ``directory/template.log``; ``directory`` private to this user) importing ``preload``,
        with ``env``; ``sys_path``: directories put first on its sys.path while it imports (the
        script's directory, where the user's modules are). Returns at once: see `wait_ready`."""
        socket_path = directory / f"template-{os.getpid()}-{next(_started)}.sock"
        log_path = directory / "template.log"
        try:
            socket_path.unlink()
        except FileNotFoundError:
            pass
        argv = [sys.executable, "-m", "ft_monitor.launcher.warm.template", "--socket", str(socket_path),
                "--parent", str(os.getpid())]
        if preload:  # through a file: one argument holds at most 128 KiB (E2BIG past ~5000 module names)
            names = socket_path.with_suffix(".preload")
            fd = os.open(names, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(preload))
            argv += ["--preload-file", str(names)]
        for p in sys_path:
            argv += ["--path", p]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(env), cwd=cwd, start_new_session=True)
        return cls(proc, socket_path, log_path)

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _dead(self) -> TemplateError:
        return TemplateError(f"the worker template (pid {self.pid}) exited with {self.proc.returncode}; "
                             f"see {self.log_path}:\n{self.log_tail()}")

    def wait_ready(self, timeout: float) -> None:
        """Return once the template answers its status; TemplateError if it exits first or does
        not answer within ``timeout`` seconds (it is left running: it may still be importing,
        and a later call can wait again)."""
        end = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise self._dead()
            if self.socket_path.exists():
                try:
                    self.status(timeout=max(0.1, min(2.0, end - time.monotonic())))
                    return
                except TemplateRefused:
                    raise
                except TemplateError:
                    pass
            if time.monotonic() >= end:
                raise TemplateError(f"the worker template (pid {self.pid}) did not answer within {timeout:g}s "
                                    f"(still importing?); see {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.02)

    def _request(self, obj: dict[str, Any], fds: Sequence[int], timeout: float) -> object:
        if not self.alive():
            raise self._dead()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(str(self.socket_path))
                template_wire.send(sock, obj, fds)
                reply, extra = template_wire.receive(sock)
            except TimeoutError as e:
                raise TemplateError(f"the worker template (pid {self.pid}) did not answer within "
                                    f"{timeout:g}s") from e
            except OSError as e:
                raise TemplateError(f"the worker template (pid {self.pid}) cannot be reached: {e}") from e
        for fd in extra:
            os.close(fd)
        return reply

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        reply = parse_status_reply(self._request({"op": "status"}, (), timeout))
        if isinstance(reply, Refusal):
            raise TemplateRefused(reply.why)
        return reply

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout: IO[Any] | None,
              stderr: IO[Any] | None, timeout: float = 10) -> ForkedProcess:
        """Fork a worker running ``argv`` (``[python, "-u", script, *args]``) with exactly ``env``
        in ``cwd``, its stdout and stderr on those files (None: the template's own). Raises
        TemplateRefused (why) when the template will not, TemplateError when it is dead or does
        not answer within ``timeout`` seconds (it is stopped then: a template that does not
        answer serves no more)."""
        stdio = [name for name, f in (("stdout", stdout), ("stderr", stderr)) if f is not None]
        fds = [f.fileno() for f in (stdout, stderr) if f is not None]
        for f in (stdout, stderr):
            if f is not None:
                f.flush()
        request = encode_spawn([str(a) for a in argv], dict(env), os.path.abspath(cwd), stdio)
        try:
            raw = self._request(request, fds, timeout)
        except TemplateError:
            if self.alive():
                self.close()
            raise
        reply = parse_spawn_reply(raw)
        if isinstance(reply, Refusal):
            orphan = raw.get("pid") if isinstance(raw, dict) else None
            if isinstance(orphan, int) and not isinstance(orphan, bool) and orphan > 1:
                self._reap_orphan(orphan)
            raise TemplateRefused(reply.why)
        if reply.ignored_env:
            log.info("ft-launcher: in the forked worker pid %d, these variables cannot take effect (read when "
                     "the interpreter or a preloaded module starts): %s", reply.pid, ", ".join(reply.ignored_env))
        return ForkedProcess(reply.pid, argv)

    @staticmethod
    def _reap_orphan(pid: int) -> None:
        """A worker that failed its set-up has exited as this process's child: reap it."""
        try:
            ForkedProcess(pid, []).wait(STOP_GRACE)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) a template that is importing, so that its imports
        do not take the CPU from the workers of a restart while they start."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def terminate(self) -> None:
        """Ask the template to stop (SIGTERM) without waiting; `close` reaps it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one takes the SIGTERM only once continued
            self.proc.terminate()

    def close(self) -> None:
        """Stop the template: SIGTERM, then SIGKILL after a grace period; reaped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in (self.socket_path, self.socket_path.with_suffix(".preload")):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
