"""The worker template: a preloaded interpreter that forks the workers of the next attempt.

Runs in its own process, started by the launcher (`ft_monitor.launcher.warm.forked.Template`)::

    python -m ft_monitor.launcher.warm.template --socket PATH [--preload torch,numpy,...]
                                           [--preload-file FILE] [--parent PID] [--path DIR]...

At start it dies with the launcher (PR_SET_PDEATHSIG, SIGKILL), ignores SIGINT (the
terminal's Ctrl-C is the launcher's), imports each ``--preload`` module (one that fails
is one line on stderr and a ``failed`` entry in its status; the template goes on without
it), then serves requests on the Unix socket PATH (mode 0600), one connection and one
request at a time, blocking: no thread, no event loop, so that it can fork safely. Only
its parent (the launcher, SO_PEERCRED) is served. SIGTERM ends it cleanly. The requests
and replies are `ft_monitor.core.template_request`'s.

A spawn double-forks: the template forks a child, which forks the worker and exits; the
template reaps the child, so the worker is reparented to the nearest child subreaper (the
launcher, `forked.set_child_subreaper`), which waits for it and signals it as its own
child. The worker makes itself a session leader (``setsid``: its pgid is its pid, as
torchrun's ``Popen(start_new_session=True)`` gives), takes the passed stdout and stderr,
stdin from /dev/null, Python's default signal handlers, exactly the environment given,
the cwd, and then waits for the template's go (sent once it is the launcher's child) before
running the script as ``python script.py`` would: a fresh ``__main__`` module, ``sys.argv``,
``sys.path[0]`` (the script's real directory), ``__file__`` (absolute), exit codes and the
uncaught exception's traceback on stderr.

What a forked worker cannot have (the interpreter started before its environment existed):

* variables read when the interpreter starts: PYTHONHASHSEED (every worker has the
  template's hash seed), PYTHONOPTIMIZE, PYTHONWARNINGS, PYTHONMALLOC, PYTHONUTF8,
  PYTHONSAFEPATH, PYTHONNOUSERSITE, PYTHONHOME, ...; those applied here are PYTHONPATH
  (sys.path rebuilt), PYTHONUNBUFFERED (as ``-u``), PYTHONDONTWRITEBYTECODE (as ``-B``),
  PYTHONFAULTHANDLER and PYTHONIOENCODING. ``sitecustomize`` and ``.pth`` files ran in the
  template; ft-monitor's own start-up hook (``FT_STARTUP_DUMP``) is armed here instead;
* anything a preloaded module read at its import: BLAS thread pools (the template sets
  OPENBLAS_NUM_THREADS=1 unless given, so that loading OpenBLAS starts no thread; workers
  keep one BLAS thread), torch's import-time settings. OMP_NUM_THREADS is applied to torch
  (``torch.set_num_threads``), numpy's global random state is reseeded (Python's ``random``
  reseeds itself at fork);
* the spawn reply's ``ignored_env`` names those of the first two kinds that differ between
  the template's environment and the worker's (`ft_monitor.core.template_argv.ignored_env`).

Smaller differences from a worker started the normal way: its /proc/PID/cmdline (what
``ps`` shows) is the template's command line; stdin is /dev/null (torchrun's workers inherit
the launcher's); ``sys.flags`` are the template's (``-u`` and ``-B`` are
applied, not flagged); an uncaught KeyboardInterrupt's traceback starts in the template's
frames (the exit, by SIGINT, is the interpreter's).
"""

from __future__ import annotations

import argparse
import builtins
import faulthandler
import gc
import importlib
import importlib.machinery
import io
import os
import select
import signal
import socket
import stat
import sys
import types
from dataclasses import dataclass
from typing import Any

from ft_client import startup
from ft_client.parent_death import die_with_parent
from ft_client.peer import peer_credentials
from ft_monitor.core import template_argv
from ft_monitor.core.template_argv import Plan, Refusal, ctype_locale, stdio_codec
from ft_monitor.core.template_request import SpawnRequest, StatusRequest, parse_request
from ft_monitor.launcher.warm import template_wire
from ft_monitor.launcher.warm.template_wire import TemplateError

REQUEST_TIMEOUT = 10.0
"""How long one connection may take to send its request."""
CHILD_TIMEOUT = 5.0
"""How long the forked worker may take to say it is ready (its set-up: a few milliseconds);
less than the launcher's wait for the reply (`forked.Template.spawn`'s timeout, 10 s)."""
_PR_SET_PDEATHSIG = 1
_LOG = "ft-monitor template"


def _say(text: str) -> None:
    sys.stderr.write(f"{_LOG} (pid {os.getpid()}): {text}\n")
    sys.stderr.flush()


def thread_names() -> list[str]:
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for t in sorted(tasks):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip() or "?")
        except OSError:
            names.append("?")
    return names


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support, half imported: not initialised
        return False


def rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def preload(names: list[str]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Import each module; those that fail are one line on stderr each, and left out. Also
    returns the modules seen starting a thread or initialising CUDA at import (the template
    will refuse to fork: the refusal names them)."""
    done: list[str] = []
    failed: dict[str, str] = {}
    unsafe: dict[str, str] = {}
    for name in names:
        threads, cuda = len(thread_names()), cuda_initialized()
        try:
            importlib.import_module(name)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a module may even sys.exit() at import: go on without it
            why = f"{type(e).__name__}: {e}".strip()
            failed[name] = why
            _say(f"preload {name} failed, going on without it: {why}")
            continue
        finally:
            did = []
            started = len(thread_names()) - threads
            if started > 0:
                did.append(f"started {started} thread(s)")
            if cuda_initialized() and not cuda:
                did.append("initialised CUDA")
            if did:
                unsafe[name] = " and ".join(did)
                _say(f"preload {name} {unsafe[name]} at import: the template cannot fork")
        done.append(name)
    return done, failed, unsafe


@dataclass
class Worker:
    """In the forked worker: what `main` runs once the template's code is behind it."""

    path: str
    """The script's absolute path (``__file__``)."""


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
        _say(f"serving on {self.socket_path}; preloaded {', '.join(self.preloaded) or 'nothing'}"
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
                _say(f"refused a connection from pid {cred.pid} (uid {cred.uid}): not the launcher")
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
            _say(f"could not reply: {e}")

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
                _say(f"forked pid {pid}: {' '.join(req.argv[1:])[:200]}")
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
            _worker_signals(self.inherited_ignored)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            step = "setsid"
            os.setsid()
            step = "the parent-death signal"
            _clear_pdeathsig()
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
            path = _prepare_interpreter(plan, req, env, self.template_only_paths)
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


def _worker_signals(inherited_ignored: frozenset[int]) -> None:
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


def _clear_pdeathsig() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0)


def _pythonpath(value: str | None, cwd: str) -> list[str]:
    return [os.path.abspath(os.path.join(cwd, p)) for p in (value or "").split(os.pathsep) if p]


def _prepare_interpreter(plan: Plan, req: SpawnRequest, env: dict[str, str],
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
    sys.path[:] = [os.path.dirname(os.path.realpath(path)), *_pythonpath(env.get("PYTHONPATH"), req.cwd), *rest]
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
    return startup.HOOK_DIR in _pythonpath(pythonpath, cwd)


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


def ignored_signals() -> frozenset[int]:
    """The signals this process ignores now. Read at the template's start, before it changes any:
    those it inherited ignored from the launcher (``nohup`` ignores SIGHUP, a background shell
    SIGINT and SIGQUIT), which an exec'd worker inherits ignored too (exec keeps SIG_IGN)."""
    found = set()
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                found.add(int(sig))
        except (OSError, ValueError):
            continue
    return frozenset(found)


def _parent_alive(parent: int) -> bool:
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_monitor.launcher.warm.template")
    parser.add_argument("--socket", required=True, help="the Unix socket to serve on (its directory private)")
    parser.add_argument("--preload", default="", help="modules to import, comma-separated")
    parser.add_argument("--preload-file", default=None,
                        help="a file of modules to import, one per line (the launcher's: a long list)")
    parser.add_argument("--parent", type=int, default=None, help="the launcher's pid (default: the parent's)")
    parser.add_argument("--path", action="append", default=[],
                        help="a directory put first on sys.path while preloading (the script's)")
    args = parser.parse_args(argv)
    parent = args.parent if args.parent is not None else os.getppid()
    if not die_with_parent(signal.SIGKILL):
        _say("could not set PR_SET_PDEATHSIG: the template will outlive a launcher killed outright")
    if not _parent_alive(parent):
        _say(f"the launcher (pid {parent}) is gone; exiting")
        return 1
    names = [n.strip() for n in args.preload.split(",") if n.strip()]
    if args.preload_file is not None:
        try:
            with open(args.preload_file) as f:
                names += [n.strip() for n in f.read().splitlines() if n.strip()]
        except (OSError, UnicodeDecodeError) as e:
            _say(f"cannot read the preload list {args.preload_file}: {e}; going on without it")
    return serve_template(args.socket, parent, names, args.path)


def serve_template(socket_path: str, parent: int, names: list[str], paths: list[str]) -> int:
    """Import ``names`` (``paths`` first on sys.path meanwhile) and serve on ``socket_path`` until
    SIGTERM; in a forked worker, run its script. In the template's process: started as
    ``python -m ft_monitor.launcher.warm.template`` (`main`), or forked from the launcher
    (`ft_monitor.launcher.warm.template_fork`), whose imports it then has already."""
    inherited_ignored = ignored_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start_env = dict(os.environ)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # else loading OpenBLAS starts its thread pool
    # sys.path entries of the template's own, which a worker does not get: -m's cwd, --path, PYTHONPATH
    template_only = {sys.path[0]} if sys.path else set()
    template_only |= set(_pythonpath(start_env.get("PYTHONPATH"), os.getcwd()))
    extra = [os.path.abspath(p) for p in paths]
    template_only |= set(extra)
    sys.path[:0] = extra
    preloaded, failed, unsafe = preload(names)
    # What is imported now lives as long as every worker: out of the collector's sight, so that a
    # worker's collections and its exit do not write to (and so copy) the pages it shares with the
    # template (a worker with torch exited in 0.63 s after a fork, 0.23 s with this).
    gc.collect()
    gc.freeze()
    server = Server(socket_path, parent, preloaded, failed, start_env, template_only, unsafe, inherited_ignored)
    worker = server.serve()
    if worker is None:
        _say("stopped")
        return 0
    run_worker(worker)  # outside every try and with of the template's: the interpreter ends as the script's
    return 0


if __name__ == "__main__":
    sys.exit(main())
