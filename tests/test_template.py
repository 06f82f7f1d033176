"""The worker template (issue 27) with real processes: a helper (tests/workers/template_launcher.py)
plays ft-launcher, a child subreaper that starts templates and asks them to fork
tests/workers/template_script.py; each forked worker is compared with the same script
started cold (``python -u script.py``)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ft_client import startup
from ft_monitor.launcher.warm import template_wire
from ft_monitor.launcher.warm.forked import UNKNOWN_RETURNCODE, ForkedProcess
from tests.procs import ROOT, WORKERS, cleanup_dir, short_tmpdir, slack, wait_until

pytestmark = pytest.mark.e2e

SCRIPT = WORKERS / "template_script.py"
PY = sys.executable


class Launcher:
    """The helper process, one JSON command a line."""

    def __init__(self, directory: Path, ignoring: str = "") -> None:
        """``ignoring``: signals the helper starts with ignored (``trap '' INT HUP``: as
        ``nohup ... &`` starts a launcher)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FT_TEMPLATE_ONLY": "1"}
        self.dir = directory
        argv = [PY, str(WORKERS / "template_launcher.py")]
        if ignoring:
            argv = ["sh", "-c", f"trap '' {ignoring}; exec \"$0\" \"$@\"", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=ROOT, start_new_session=True)
        self._buf = b""
        hello = self._line(20)
        assert hello["ready"] and hello["subreaper"], hello
        self.pid: int = hello["pid"]

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = timeout * slack()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], end)
            assert ready, f"the helper launcher did not answer within {end:.0f}s"
            chunk = os.read(fd, 65536)
            assert chunk, f"the helper launcher exited with {self.proc.wait()}"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, timeout: float = 30, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self._line(timeout)
        assert "exception" not in answer, answer
        return answer

    def spawn(self, *args: str, name: str = "main", env: dict[str, str] | None = None, cwd: str | None = None,
              argv: list[str] | None = None) -> dict[str, Any]:
        out, err = self.dir / f"out{len(os.listdir(self.dir))}", self.dir / f"err{len(os.listdir(self.dir))}"
        answer = self.call(cmd="spawn", name=name, argv=argv or [PY, "-u", str(SCRIPT), *args],
                           env=env or WORKER_ENV, cwd=cwd or str(self.dir), stdout=str(out), stderr=str(err))
        answer["out"], answer["err"] = out, err
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()  # the helper's cue to stop its templates and exit
        except BrokenPipeError:
            pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


WORKER_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ONLY_WORKER": "yes"}


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    d = short_tmpdir()
    (d / "template_only_dir").mkdir()
    helper = Launcher(d)
    try:
        started = helper.call(cmd="start", name="main", dir=str(d), preload=["json", "no_such_module_xyz"],
                              path=[str(d / "template_only_dir")])
        assert "error" not in started, started
        helper.template_pid = started["pid"]  # type: ignore[attr-defined]
        helper.socket = started["socket"]  # type: ignore[attr-defined]
        yield helper
    finally:
        helper.close()
        cleanup_dir(d)


def cold(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-u", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60 * slack())


def finished(launcher: Launcher, pid: int, timeout: float = 30) -> int:
    answer = launcher.call(cmd="wait", pid=pid, seconds=timeout * slack(), timeout=timeout + 10)
    assert "returncode" in answer, answer
    code: int = answer["returncode"]
    return code


def test_a_forked_worker_sees_what_python_script_py_would(launcher: Launcher) -> None:
    d = launcher.dir
    link = d / "link.py"
    if not link.exists():
        link.symlink_to(SCRIPT)
    got = launcher.spawn(argv=[PY, "-u", "link.py", "report", "x y", "--flag"])
    assert finished(launcher, got["pid"]) == 0
    forked = json.loads(got["out"].read_text())
    assert got["err"].read_text() == "to stderr\n"
    reference = cold("link.py", "report", "x y", "--flag", env=WORKER_ENV, cwd=d)
    assert reference.returncode == 0, reference.stderr
    expected = json.loads(reference.stdout)
    assert forked["argv"] == ["link.py", "report", "x y", "--flag"]
    assert forked["file"] == str(d / "link.py")
    assert forked["path0"] == str(WORKERS)
    assert forked["cwd"] == str(d)
    assert forked["env"] == WORKER_ENV  # exactly: nothing of the template's (FT_TEMPLATE_ONLY)
    same = ("argv", "file", "path0", "sys_path", "cwd", "handlers", "pdeathsig", "main", "main_loader", "main_spec", "name",
            "sys_main_is_this", "write_through", "line_buffering", "stdout_errors", "stderr_errors",
            "path_has_template_dir", "tasks")
    assert {k: forked[k] for k in same} == {k: expected[k] for k in same}
    assert {k: v for k, v in expected["env"].items() if k != "LC_CTYPE"} == WORKER_ENV  # PEP 538's coercion
    assert forked["pid"] == forked["sid"] == forked["pgid"]
    assert forked["stdin"] == "/dev/null"


def test_a_forked_worker_keeps_the_signals_its_launcher_ignored() -> None:
    """A launcher started from a background shell (``nohup ft-launcher ... &``) ignores SIGHUP,
    SIGINT and SIGQUIT, and its exec'd workers inherit that; before, a forked worker got
    Python's SIGINT handler and SIG_DFL for the rest (the template's own, reset)."""
    d = short_tmpdir()
    helper = Launcher(d, ignoring="INT HUP QUIT")
    try:
        assert "error" not in helper.call(cmd="start", name="main", dir=str(d), preload=[])
        got = helper.spawn("report")
        assert finished(helper, got["pid"]) == 0
        forked = json.loads(got["out"].read_text())["handlers"]
        reference = subprocess.run(["sh", "-c", "trap '' INT HUP QUIT; exec \"$0\" \"$@\"", PY, "-u", str(SCRIPT),
                                    "report"], env=WORKER_ENV, cwd=d, capture_output=True, text=True,
                                   timeout=60 * slack())
        expected = json.loads(reference.stdout)["handlers"]
        assert expected["SIGINT"] == expected["SIGHUP"] == expected["SIGQUIT"] == "SIG_IGN", expected
        assert forked == expected
    finally:
        helper.close()
        cleanup_dir(d)


def test_the_start_up_hook_is_armed_as_in_a_fresh_worker(launcher: Launcher) -> None:
    """With ft-monitor's start-up hook on PYTHONPATH, a fresh worker arms the start-up stack dump
    and takes the hook out of its environment and sys.path: a forked one does the same."""
    dumps = launcher.dir / "dumps"
    dumps.mkdir(mode=0o700)
    env = {**WORKER_ENV, **startup.worker_env(startup.StartupDump(int(signal.SIGUSR2), str(dumps), False),
                                              {"PYTHONPATH": str(ROOT)})}  # ROOT: this checkout's hook
    got = launcher.spawn("report", env=env)
    assert finished(launcher, got["pid"]) == 0
    forked = json.loads(got["out"].read_text())
    reference = cold(str(SCRIPT), "report", env=env, cwd=launcher.dir)
    expected = json.loads(reference.stdout)
    assert forked["env"] == {**WORKER_ENV, "PYTHONPATH": str(ROOT)}
    assert {k: v for k, v in expected["env"].items() if k != "LC_CTYPE"} == forked["env"]
    assert forked["sys_path"] == expected["sys_path"]
    assert startup.HOOK_DIR not in forked["sys_path"]
    assert sorted(os.listdir(dumps)) == sorted(f"rank0-pid{r['pid']}-stack.txt" for r in (forked, expected))


def test_stdout_and_stderr_left_out_are_the_templates_own(launcher: Launcher) -> None:
    answer = launcher.call(cmd="spawn", name="main", argv=[PY, "-u", str(SCRIPT), "first"], env=WORKER_ENV,
                           cwd=str(launcher.dir), stdout=None, stderr=None)
    assert finished(launcher, answer["pid"]) == 0
    assert "\nfirst\n" in (launcher.dir / "template.log").read_text()


def test_exit_codes_and_the_uncaught_exception_as_the_interpreter_gives_them(launcher: Launcher) -> None:
    three = launcher.spawn("exit", "3")
    raised = launcher.spawn("raise")
    at_exit = launcher.spawn("atexit")
    assert finished(launcher, three["pid"]) == 3
    assert finished(launcher, raised["pid"]) == 1
    assert finished(launcher, at_exit["pid"]) == 0
    assert at_exit["out"].read_text() == "unflushed line\natexit ran\n"
    reference = cold(str(SCRIPT), "raise", env=WORKER_ENV, cwd=launcher.dir)
    assert reference.returncode == 1
    assert raised["err"].read_text() == reference.stderr
    assert raised["err"].read_text().startswith(f'Traceback (most recent call last):\n  File "{SCRIPT}"')


def test_signals_reach_the_worker_and_the_launcher_reaps_it(launcher: Launcher) -> None:
    for how, sig in (("killpg", signal.SIGTERM), ("signal", signal.SIGKILL)):
        got = launcher.spawn("wait")
        pid = got["pid"]
        try:
            wait_until(lambda got=got: got["out"].read_text().startswith("ready"), 20, "the worker's ready line")
            assert launcher.call(cmd="poll", pid=pid) == {"returncode": None}
            assert launcher.call(cmd="wait", pid=pid, seconds=0.05) == {"timeout": True}
            ids = launcher.call(cmd="ids", pid=pid)
            assert ids == {"sid": pid, "pgid": pid, "ppid": launcher.pid}  # its own session, the launcher's child
            launcher.call(cmd=how, pid=pid, sig=int(sig))
            assert finished(launcher, pid) == -sig
        finally:
            try:
                os.killpg(pid, signal.SIGKILL)  # a failed check leaves no sleeping worker behind
            except ProcessLookupError:
                pass


def test_what_the_template_cannot_run_is_refused_and_it_serves_on(launcher: Launcher) -> None:
    cases = [
        ([PY, "-u", "-m", "json.tool"], "a module entry point (-m json.tool)"),
        (["/bin/echo", "hi"], "is not the template's interpreter"),
        ([PY, "-c", "print(1)"], "a command string (-c)"),
        ([PY, "-u", str(launcher.dir / "missing.py")], "cannot be read"),
        ([PY, "-u", str(launcher.dir)], "not a regular file"),
    ]
    for argv, words in cases:
        answer = launcher.spawn(argv=argv)
        assert words in answer.get("refused", ""), (argv, answer)
    status = launcher.call(cmd="status", name="main")
    assert status["ok"] and status["threads"] == 1


def test_a_failed_preload_is_reported_and_the_template_serves(launcher: Launcher) -> None:
    status = launcher.call(cmd="status", name="main")
    assert status["preloaded"] == ["json"]
    assert status["failed"] == {"no_such_module_xyz": "ModuleNotFoundError: No module named 'no_such_module_xyz'"}
    assert status["pid"] == launcher.template_pid  # type: ignore[attr-defined]
    assert status["cuda_initialized"] is False and status["rss_kb"] > 0
    assert status["frozen_objects"] > 1000  # what it imported, out of the collector's sight (gc.freeze)
    log = (launcher.dir / "template.log").read_text()
    assert "preload no_such_module_xyz failed, going on without it: ModuleNotFoundError" in log


def test_a_peer_that_is_not_the_launcher_is_refused(launcher: Launcher) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10 * slack())
        s.connect(launcher.socket)  # type: ignore[attr-defined]
        reply, _ = template_wire.receive(s)  # refused at once, before any request
        assert s.recv(1) == b""  # and closed
    assert reply == {"ok": False, "error": f"only the launcher (pid {launcher.pid}) may use this template; "
                                           f"pid {os.getpid()} is not it"}


def test_the_template_ignores_sigint(launcher: Launcher) -> None:
    os.kill(launcher.template_pid, signal.SIGINT)  # type: ignore[attr-defined]
    assert launcher.call(cmd="status", name="main")["ok"]


def test_a_template_replaced_by_another_in_the_same_directory_leaves_it_serving(launcher: Launcher) -> None:
    """--ft-preload auto: the launcher starts a new template, then stops the old one."""
    d = launcher.dir / "replaced"
    d.mkdir()
    old = launcher.call(cmd="start", name="old", dir=str(d), preload=[])
    new = launcher.call(cmd="start", name="new", dir=str(d), preload=["json"])
    assert old["socket"] != new["socket"]
    assert launcher.call(cmd="close", name="old") == {"returncode": 0}
    assert launcher.call(cmd="status", name="new")["preloaded"] == ["json"]
    got = launcher.spawn("exit", "0", name="new")
    assert finished(launcher, got["pid"]) == 0
    launcher.call(cmd="close", name="new")


def test_a_template_with_a_second_thread_refuses_to_fork(launcher: Launcher) -> None:
    d = launcher.dir / "threads"
    d.mkdir()
    started = launcher.call(cmd="start", name="threads", dir=str(d), preload=["tests.workers.template_thread"])
    assert "error" not in started, started
    try:
        status = launcher.call(cmd="status", name="threads")
        assert status["threads"] == 2
        assert status["unsafe"] == {"tests.workers.template_thread": "started 1 thread(s)"}
        answer = launcher.spawn("report", name="threads")
        assert answer["refused"].startswith("the template has 2 threads (")
        assert "preload-thread" in answer["refused"]
        assert answer["refused"].endswith("locks held by threads that do not exist in the child "
                                          "(tests.workers.template_thread started 1 thread(s) at import)")
    finally:
        closed = launcher.call(cmd="close", name="threads")
    assert closed == {"returncode": 0}  # SIGTERM: a clean exit
    assert not Path(started["socket"]).exists()
    assert "stopped" in (d / "template.log").read_text()


def test_the_template_dies_with_its_launcher() -> None:
    d = short_tmpdir()
    helper = Launcher(d)
    try:
        started = helper.call(cmd="start", name="t", dir=str(d), preload=[])
        pidfd = os.pidfd_open(started["pid"])
        try:
            os.killpg(helper.proc.pid, signal.SIGKILL)
            helper.proc.wait(10)
            ready, _, _ = select.select([pidfd], [], [], 20 * slack())
            assert ready, "the template outlived its launcher"
        finally:
            os.close(pidfd)
    finally:
        helper.close()
        cleanup_dir(d)


def test_a_process_that_is_not_our_child_is_watched_through_its_pidfd(caplog: pytest.LogCaptureFixture) -> None:
    sh = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        assert sh.stdout is not None
        pid = int(sh.stdout.readline())
        p = ForkedProcess(pid, ["sleep", "30"])
        assert p.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.05)
        p.kill()
        assert p.wait(10 * slack()) == UNKNOWN_RETURNCODE
        assert "is not this process's child" in caplog.text
    finally:
        sh.kill()
        sh.wait(10)
        if sh.stdout is not None:
            sh.stdout.close()


def test_the_workers_stdio_follows_its_environment_not_the_templates(launcher: Launcher) -> None:
    """A template whose own stdout is strict (its environment's PYTHONIOENCODING; on a machine
    with another locale, its locale) gives the worker what the worker's environment gives a
    cold interpreter (seen on a GPU machine whose locale made the template's stdio strict)."""
    d = launcher.dir / "strict"
    d.mkdir()
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    started = launcher.call(cmd="start", name="strict", dir=str(d), preload=["json"], env=env)
    assert "error" not in started, started
    try:
        for worker_env in (WORKER_ENV, {**WORKER_ENV, "PYTHONUTF8": "0", "LC_ALL": "C.UTF-8"}):
            got = launcher.spawn("report", name="strict", env=worker_env, cwd=str(d))
            assert finished(launcher, got["pid"]) == 0
            forked = json.loads(got["out"].read_text())
            reference = cold(str(SCRIPT), "report", env=worker_env, cwd=d)
            assert reference.returncode == 0, reference.stderr
            expected = json.loads(reference.stdout)
            keys = ("stdout_errors", "stderr_errors", "stdout_encoding")
            assert {k: forked[k] for k in keys} == {k: expected[k] for k in keys}, worker_env
    finally:
        launcher.call(cmd="close", name="strict")


def test_cuda_initialised_in_the_template_is_refused() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here: the refusal is unit-tested (test_template_rules.py::test_fork_problem)")
    d = short_tmpdir()
    helper = Launcher(d)
    try:
        started = helper.call(cmd="start", name="cuda", dir=str(d), preload=["tests.workers.template_cuda"],
                              seconds=120, timeout=150)
        assert "error" not in started, started
        assert helper.call(cmd="status", name="cuda")["cuda_initialized"] is True
        answer = helper.spawn("report", name="cuda")
        assert answer["refused"].startswith("the template has initialised CUDA")  # not its driver thread
        assert "tests.workers.template_cuda" in answer["refused"] and "initialised CUDA at import" in answer["refused"]
    finally:
        helper.close()
        cleanup_dir(d)


def test_torch_preloaded_stays_one_thread_and_forks_faster_than_a_cold_start(launcher: Launcher) -> None:
    pytest.importorskip("torch")
    d = launcher.dir / "torch"
    d.mkdir()
    started = launcher.call(cmd="start", name="torch", dir=str(d), preload=["torch"], seconds=120, timeout=150)
    assert "error" not in started, started
    try:
        status = launcher.call(cmd="status", name="torch")
        assert status["preloaded"] == ["torch"] and status["threads"] == 1 and not status["cuda_initialized"]
        script = d / "first.py"
        script.write_text("import torch\nprint('first', flush=True)\n")
        times = launcher.call(cmd="latency", name="torch", argv=[PY, "-u", str(script)], cwd=str(d), timeout=120)
        print(f"\nfork to first line: {times['forked'] * 1000:.0f} ms; cold python -c 'import torch': "
              f"{times['cold'] * 1000:.0f} ms; idle template with torch: {status['rss_kb'] // 1024} MiB RSS")
    finally:
        launcher.call(cmd="close", name="torch")
