"""The template's socket and its serve loop (`Server`, in the template process): one connection
and one request at a time, blocking, served only to the launcher (SO_PEERCRED); a status request
answered, a spawn double-forked (the worker reparented to the launcher, then told to go) or
refused with its reason.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import stat
import sys
import types
from typing import Any

from ft_client.wire.peer import peer_credentials
from ft_monitor.core import template_argv
from ft_monitor.core.template_argv import Plan, Refusal
from ft_monitor.core.template_request import SpawnRequest, StatusRequest, parse_request
from ft_monitor.launcher.warm import template_wire
from ft_monitor.launcher.warm.template_preload import cuda_initialized, rss_kb, say, thread_names
from ft_monitor.launcher.warm.template_wire import TemplateError
from ft_monitor.launcher.warm.template_worker import Worker, clear_pdeathsig, prepare_interpreter, worker_signals

REQUEST_TIMEOUT = 10.0
"""How long one connection may take to send its request."""
CHILD_TIMEOUT = 5.0
"""How long the forked worker may take to say it is ready (its set-up: a few milliseconds);
less than the launcher's wait for the reply (`forked.Template.spawn`'s timeout, 10 s)."""


class Server:
    """The template's socket and its serve loop (in the template process)."""

    def __init__(self, socket_path: str, parent: int, preloaded: list[str], failed: dict[str, str],
                 start_env: dict[str, str], template_only_paths: set[str],
                 unsafe: dict[str, str] | None = None, inherited_ignored: frozenset[int] = frozenset()) -> None:
        self.socket_path = socket_path
        self.parent = parent
        self.preloaded = preloaded
        self.failed = failed
        self.unsafe = unsafe or {}
        self.start_env = start_env
        self.template_only_paths = template_only_paths
        self.inherited_ignored = inherited_ignored
        """The signals the template was started with ignored: ignored in every worker too."""
        self.pid = os.getpid()
        self.stopping = False
        self.listener: socket.socket | None = None
        self.socket_id = (0, 0)
        self.wake_r = self.wake_w = -1

    # ---- the loop -------------------------------------------------------------------
    def serve(self) -> Worker | None:
        """Serve until SIGTERM (None), or, in a forked worker, return what it must run."""
        old_umask = os.umask(0o177)
        try:
            listener = self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, stat.S_IRUSR | stat.S_IWUSR)
        st = os.stat(self.socket_path)
        self.socket_id = (st.st_dev, st.st_ino)
        listener.listen(16)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_term)
        say(f"serving on {self.socket_path}; preloaded {', '.join(self.preloaded) or 'nothing'}"
            + (f"; failed: {', '.join(self.failed)}" if self.failed else ""))
        try:
            while not self.stopping:
                ready, _, _ = select.select([listener.fileno(), self.wake_r], [], [])
                if self.wake_r in ready:
                    self._drain()
                if listener.fileno() in ready and not self.stopping:
                    conn, _ = listener.accept()
                    worker = self._connection(conn)
                    if worker is not None:
                        return worker  # in the forked worker; the template's resources are closed
        finally:
            if os.getpid() == self.pid:
                self.close()
        return None

    def _on_term(self, signum: int, frame: types.FrameType | None) -> None:
        self.stopping = True

    def _drain(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        if self.listener is not None:
            self.listener.close()
            try:
                st = os.stat(self.socket_path)
                if (st.st_dev, st.st_ino) == self.socket_id:  # still ours, not a successor's
                    os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        for fd in (self.wake_r, self.wake_w):
            if fd >= 0:
                os.close(fd)
        self.wake_r = self.wake_w = -1

    # ---- one connection ---------------------------------------------------------------
    def _connection(self, conn: socket.socket) -> Worker | None:
        fds: list[int] = []
        try:
            conn.settimeout(REQUEST_TIMEOUT)
            cred = peer_credentials(conn)
            if cred.pid != self.parent or cred.uid != os.geteuid():
                say(f"refused a connection from pid {cred.pid} (uid {cred.uid}): not the launcher")
                self._reply(conn, {"ok": False, "error": f"only the launcher (pid {self.parent}) may use this "
                                                         f"template; pid {cred.pid} is not it"})
                return None
            try:
                obj, fds = template_wire.receive(conn)
            except (TemplateError, OSError) as e:
                self._reply(conn, {"ok": False, "error": f"bad request: {e}"})
                return None
            req = parse_request(obj, len(fds))
            if isinstance(req, Refusal):
                self._reply(conn, {"ok": False, "error": req.why})
            elif isinstance(req, StatusRequest):
                self._reply(conn, self.status())
            else:
                return self._spawn(conn, req, fds)
            return None
        finally:
            if os.getpid() == self.pid:
                for fd in fds:
                    os.close(fd)
                conn.close()

    def _reply(self, conn: socket.socket, obj: dict[str, Any]) -> None:
        try:
            template_wire.send(conn, obj)
        except OSError as e:
            say(f"could not reply: {e}")

    def status(self) -> dict[str, Any]:
        return {"ok": True, "pid": os.getpid(), "preloaded": list(self.preloaded), "failed": dict(self.failed),
                "threads": len(thread_names()), "cuda_initialized": cuda_initialized(), "rss_kb": rss_kb(),
                "frozen_objects": gc.get_freeze_count(),
                "unsafe": dict(self.unsafe)}

    # ---- a spawn ---------------------------------------------------------------------
    def _spawn(self, conn: socket.socket, req: SpawnRequest, fds: list[int]) -> Worker | None:
        problem = template_argv.fork_problem(thread_names(), cuda_initialized(), self.unsafe)
        plan = template_argv.plan(req.argv, sys.executable, realpath=os.path.realpath)
        if problem is None and isinstance(plan, Refusal):
            problem = plan.why
        if problem is None:
            problem = _place_problem(req.cwd, plan.script if isinstance(plan, Plan) else "")
        if problem is not None or not isinstance(plan, Plan):
            self._reply(conn, {"ok": False, "error": problem or "refused"})
            return None
        stdio = dict(zip(req.stdio, fds))
        env = dict(req.env)
        sys.stdout.flush()
        sys.stderr.flush()
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        blocked = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            child = os.fork()
        except OSError as e:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for fd in (ready_r, ready_w, go_r, go_w):
                os.close(fd)
            self._reply(conn, {"ok": False, "error": f"fork failed: {e}"})
            return None
        if child == 0:
            # The intermediate child: fork the worker and exit. Never returns into the template's
            # code but as the worker.
            try:
                if os.fork() == 0:
                    os.close(ready_r)
                    os.close(go_w)
                    return self._become_worker(conn, req, plan, stdio, env, old_mask, ready_w, go_r)
            except BaseException:  # noqa: BLE001 - the template's reply says it (no ready line comes)
                os._exit(1)
            os._exit(0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(ready_w)
        os.close(go_r)
        try:
            os.waitpid(child, 0)  # the worker is now the subreaper's child
            line = _read_line(ready_r, CHILD_TIMEOUT)
            words = line.split(" ", 1)
            if len(words) == 2 and words[0] == "ok" and words[1].isdigit():
                pid = int(words[1])
                os.write(go_w, b"g")
                ignored = template_argv.ignored_env(self.start_env, env)
                self._reply(conn, {"ok": True, "pid": pid, "ignored_env": list(ignored)})
                say(f"forked pid {pid}: {' '.join(req.argv[1:])[:200]}")
            else:
                # the worker could not set itself up, and has exited (the launcher reaps "pid")
                why = words[1] if len(words) == 2 and words[0] == "error" else "the forked worker did not start"
                pid_field = {}
                if len(words) == 2 and words[0] == "error":
                    head, _, rest = why.partition(" ")
                    if head.isdigit():
                        pid_field = {"pid": int(head)}
                        why = rest
                self._reply(conn, {"ok": False, "error": f"the forked worker could not be set up: {why}",
                                   **pid_field})
        finally:
            os.close(ready_r)
            os.close(go_w)
        return None

    # ---- in the worker ------------------------------------------------------------------
    def _become_worker(self, conn: socket.socket, req: SpawnRequest, plan: Plan, stdio: dict[str, int],
                       env: dict[str, str], old_mask: set[int | signal.Signals], ready_w: int,
                       go_r: int) -> Worker:
        step = "the signal handlers"
        try:
            signal.set_wakeup_fd(-1)
            worker_signals(self.inherited_ignored)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            step = "setsid"
            os.setsid()
            step = "the parent-death signal"
            clear_pdeathsig()
            step = "the template's descriptors"
            conn.close()
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.wake_r = self.wake_w = -1
            step = "stdin, stdout and stderr"
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            for name, target in (("stdout", 1), ("stderr", 2)):
                passed = stdio.get(name)
                if passed is not None:
                    os.dup2(passed, target)
                    os.close(passed)
            step = "the environment"
            os.environ.clear()
            os.environ.update(env)
            step = f"the working directory {req.cwd}"
            os.chdir(req.cwd)
            step = "the interpreter's state"
            path = prepare_interpreter(plan, req, env, self.template_only_paths)
            os.write(ready_w, f"ok {os.getpid()}\n".encode())
            os.close(ready_w)
        except BaseException as e:  # noqa: BLE001 - told to the template, which refuses the spawn
            try:
                os.write(ready_w, f"error {os.getpid()} {step}: {type(e).__name__}: {e}\n".encode()[:4000])
            finally:
                os._exit(127)
        # The go: the template has reaped the intermediate child, so this process is the
        # launcher's child now (ft_client's die-with-launcher check reads the parent pid).
        if os.read(go_r, 1) != b"g":
            os._exit(1)  # the template died before the go: the launcher has no pid to watch
        os.close(go_r)
        return Worker(path)


def _read_line(fd: int, timeout: float) -> str:
    data = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not data.endswith(b"\n"):
        if not poller.poll(timeout * 1000):
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


def _place_problem(cwd: str, script: str) -> str | None:
    if not os.path.isdir(cwd):
        return f"the working directory {cwd} is not a directory"
    path = os.path.join(cwd, script)
    try:
        st = os.stat(path)
    except OSError as e:
        return f"the script {script} cannot be read: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"the script {script} is not a regular file (a directory or zip archive is run the normal way)"
    return None

