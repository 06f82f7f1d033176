"""What an adversarial review found in the landed code, one test per finding.

Each test reproduces the finding as a hostile local user, a buggy same-user tool or a
broken environment would, with real processes where the finding is about processes:
another uid through `setpriv`, a private pid namespace through `unshare` where a pid
must be reused on purpose, a lowered open-file limit through `prlimit`. docs/reliability.md
lists them (section "Adversarial review").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ft_client import RankMonitorClient, RankMonitorClientError, wire
from ft_client.safefiles import UnsafeFileError, open_append, read_bounded
from ft_client.wire.transport import TransportError, resolve_socket_path
from ft_monitor.config import ConfigError, load_config
from ft_monitor.launcher.agent.control import EventKind, LauncherServer
from ft_monitor.launcher.incident.rootcause import read_stack
from ft_monitor.launcher.store.store_auth import (
    HangRecord,
    SecretError,
    ShutdownRequest,
    StoreChannel,
    StoreMessageError,
    load_job_secret,
)
from tests import other_user, zygote
from tests.launchers import launcher_argv
from tests.procs import ROOT, Daemon, Rank, pid_alive, raw_client, status, wait_until

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another uid, a pid namespace)")
NOBODY = 65534
e2e = pytest.mark.e2e


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def read_messages(s: socket.socket, n: int) -> list[wire.Message]:
    dec = wire.FrameDecoder()
    out: list[wire.Message] = []
    while len(out) < n:
        chunk = s.recv(1 << 20)
        if not chunk:
            raise AssertionError(f"connection closed after {out}")
        out.extend(dec.feed(chunk))
    return out


def hello(role: str, rank: int = 0, info: dict[str, Any] | None = None) -> bytes:
    return wire.encode(wire.Hello(wire.PROTOCOL_VERSION, role, rank, info or {}))


def rss_kb(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])


# == High 1: launcher messages in the rendezvous store are authenticated ====================

SECRET = b"s" * 32


def test_store_messages_round_trip_under_the_job_secret() -> None:
    ch = StoreChannel(SECRET, "job-1")
    raw = ch.encode("ft_launcher/hang/0", HangRecord(3, 1700000000.5, "section 'step' open", "node-a"))
    assert ch.decode("ft_launcher/hang/0", raw, HangRecord) == HangRecord(3, 1700000000.5, "section 'step' open",
                                                                         "node-a")
    raw = ch.encode("ft_launcher/shutdown", ShutdownRequest("done", 1, "node-b"))
    assert ch.decode("ft_launcher/shutdown", raw, ShutdownRequest) == ShutdownRequest("done", 1, "node-b")


@pytest.mark.parametrize(("what", "raw", "error"), [
    ("the old plain value", b"rank 0: stop now", "not JSON"),
    ("unsigned JSON", json.dumps({"v": 1, "kind": "shutdown"}).encode(), "not signed"),
    ("another secret", StoreChannel(b"x" * 32, "job-1").encode("ft_launcher/shutdown",
                                                                ShutdownRequest("x", 0, "h")), "bad signature"),
    ("another job's run", StoreChannel(SECRET, "job-2").encode("ft_launcher/shutdown",
                                                               ShutdownRequest("x", 0, "h")), "another key or"),
    ("a value copied from another key", StoreChannel(SECRET, "job-1").encode("ft_launcher/other",
                                                                             ShutdownRequest("x", 0, "h")),
     "another key or"),
    ("a hang record where a shutdown belongs", StoreChannel(SECRET, "job-1").encode(
        "ft_launcher/shutdown", HangRecord(1, 1.0, "m", "h")), "not a version-1 shutdown message"),
])
def test_store_messages_that_are_not_authentic_are_refused(what: str, raw: bytes, error: str) -> None:
    with pytest.raises(StoreMessageError, match=error):
        StoreChannel(SECRET, "job-1").decode("ft_launcher/shutdown", raw, ShutdownRequest)


def test_a_signed_but_malformed_hang_record_is_refused_not_compared() -> None:
    # the review's case: onset_time "forged" made min() over mixed types raise at the next real hang
    ch = StoreChannel(SECRET, "job-1")
    envelope = {"v": 1, "kind": "hang", "key": "k", "run": "job-1",
                "body": {"rank": 0, "onset_time": "forged", "message": "m", "host": "h"}}
    raw = json.dumps({**envelope, "mac": ch._mac(envelope)}).encode()
    with pytest.raises(StoreMessageError, match="onset_time must be a finite number"):
        ch.decode("k", raw, HangRecord)


def test_job_secret_must_be_private_and_long_enough(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("a" * 40 + "\n")
    os.chmod(f, 0o600)
    assert load_job_secret(str(f), {}) == b"a" * 40
    os.chmod(f, 0o644)
    with pytest.raises(SecretError, match=r"has mode 0644: other users could read it; chmod 600 it"):
        load_job_secret(str(f), {})
    assert load_job_secret(None, {"FT_JOB_SECRET": "b" * 16}) == b"b" * 16
    with pytest.raises(SecretError, match=r"\$FT_JOB_SECRET holds 5 bytes: a job secret must have 16"):
        load_job_secret(None, {"FT_JOB_SECRET": "short"})
    assert load_job_secret(None, {}) is None


def test_a_secret_file_made_for_one_launch_is_removed_once_read_good_or_bad(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 49: the launcher left the file FT_JOB_SECRET_FILE named in place for the whole run
    from ft_monitor.launcher.agent import secret_env

    def fresh(name: str, text: str) -> Path:
        f = tmp_path / name
        f.write_text(text)
        f.chmod(0o600)
        return f

    for content, error in (("c" * 32 + "\n", None), ("short\n", "holds 5 bytes")):
        monkeypatch.setattr(secret_env, "_value", bytearray())
        monkeypatch.setattr(secret_env, "_file", {})
        f = fresh("once", content)
        env = {"FT_JOB_SECRET_FILE": str(f), "FT_JOB_SECRET_FILE_ONCE": "1", "OTHER": "kept"}
        if error is None:
            assert secret_env.job_secret(None, env) == b"c" * 32
        else:
            with pytest.raises(SecretError, match=error):
                secret_env.job_secret(None, env)
        assert env == {"OTHER": "kept"} and not f.exists()
    monkeypatch.setattr(secret_env, "_value", bytearray())
    monkeypatch.setattr(secret_env, "_file", {})
    kept = fresh("kept", "k" * 20)  # the user's own file, no once-flag: read, left in place
    assert secret_env.job_secret(None, {"FT_JOB_SECRET_FILE": str(kept)}) == b"k" * 20 and kept.exists()
    link = tmp_path / "link"
    link.symlink_to(kept)
    with pytest.raises(SecretError, match="is a symbolic link; refusing to follow it"):
        load_job_secret(str(link), {})
    monkeypatch.setattr(secret_env, "_file", {})
    value = secret_env._value
    assert secret_env.job_secret(None, {"FT_JOB_SECRET": "v" * 16}) == b"v" * 16
    assert value == bytes(16)  # the taken value, overwritten once handed over


# == High 2: no process group is signalled once its id may have been recycled ================

@ROOT_ONLY
@e2e
def test_leftover_group_kill_spares_a_session_leader_that_reused_the_worker_pid() -> None:
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                          str(ROOT / "tests/workers/pid_reuse.py"), "groups"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["unrelated_pid_is_old_pgid"], result  # the reuse really happened
    assert result["unrelated_survives"], result
    assert result["leftover_child_killed"], result  # a worker's leftover child still goes


@ROOT_ONLY
@e2e
def test_hello_from_a_connection_whose_process_exited_does_not_pin_the_pids_new_owner(workdir: Path) -> None:
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                          str(ROOT / "tests/workers/pid_reuse.py"), "hello-after-exit", str(workdir)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["reply"] == "Error" and result["code"] == "forbidden", result
    assert f"the process that connected (pid {result['connected_pid']}) has exited" in result["message"]
    assert "rank 0 pid" not in result["log"]  # no session was started for the new process


# == High 3: a hang is acted on even when connections use up the descriptors ===============

def _nofile_1024() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def _connect_until_refused(path: Path, n: int, wait: float = 2.0) -> list[socket.socket]:
    """Up to ``n`` idle connections, half of them observers after HELLO and half silent
    inside the handshake window; stops early once the daemon takes no more (its accept
    queue stays full for ``wait`` seconds: it is out of descriptors)."""
    socks: list[socket.socket] = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        end = time.monotonic() + wait
        while True:
            try:
                s.connect(str(path))
                break
            except BlockingIOError:  # the accept queue is full
                if time.monotonic() > end:
                    s.close()
                    return socks
                time.sleep(0.01)
        if i % 2 == 0:
            try:
                s.send(hello(wire.Role.OBSERVER, -1))
            except OSError:
                pass
        socks.append(s)
    return socks


@e2e
def test_hang_is_acted_on_with_a_thousand_idle_connections_at_rlimit_1024(workdir: Path) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 <= hard:  # this process holds the connections
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:2", "--ft-stack-dump-timeout", "1",
               "--ft-termination-grace-time", "2", preexec=_nofile_1024).wait_ready()
    rank = Rank("hang-after-stdin", d.socket, stdin=True)
    socks: list[socket.socket] = []
    try:
        rank.wait_line("steps done")  # connected first: then the connections take what is left
        socks = _connect_until_refused(d.socket, 1100)
        assert rank.proc.stdin is not None
        rank.proc.stdin.write("\n")  # the rank opens "step" and hangs in it
        rank.proc.stdin.flush()
        rc = rank.wait(30)
        report = d.report()
        # before: /proc/PID/stat failed with EMFILE, read as "exited": no signal, the rank stayed hung
        assert rc == -signal.SIGTERM, d.log()
        assert report["terminated_by"] == "SIGTERM", report
        assert "already exited" not in d.log()
        assert "connection cap (256) reached" in d.log() or "max_connections lowered" in d.log()
    finally:
        rank.kill()
        for s in socks:
            s.close()
        d.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_process_liveness_needs_no_descriptor_and_is_not_fooled_by_emfile() -> None:
    import resource

    from ft_monitor.processes.procinfo import ProcessHandle

    child = subprocess.Popen(["sleep", "600"])
    h = ProcessHandle(child.pid)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hogs: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        try:
            while True:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        assert h.alive()  # before: /proc/PID/stat failed with EMFILE and read as "exited"
        assert h.pgid() == os.getpgrp()
    finally:
        for fd in hogs:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        child.kill()
        child.wait()
    assert not h.alive()
    h.close()


# == High 4: directories and files another user prepared are refused ======================

@ROOT_ONLY
@e2e
def test_report_dir_owned_by_another_user_is_refused(workdir: Path) -> None:
    reports = workdir / "reports-of-nobody"
    reports.mkdir(mode=0o700)
    os.chown(reports, NOBODY, NOBODY)
    d = Daemon(workdir, "--ft-report-dir", str(reports))
    try:
        assert d.proc.wait(20) == 1  # before: it served
    finally:
        d.stop()
    assert f"report directory: {reports} belongs to uid {NOBODY}" in d.log(), d.log()


@e2e
def test_report_dir_writable_by_others_is_refused(workdir: Path) -> None:
    reports = workdir / "shared-reports"
    reports.mkdir()
    os.chmod(reports, 0o777)
    d = Daemon(workdir, "--ft-report-dir", str(reports))
    try:
        assert d.proc.wait(20) == 1  # before: it served
    finally:
        d.stop()
    assert "has mode 0777: other users can write there" in d.log(), d.log()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_planted_fifo_or_symlink_at_the_dump_path_neither_blocks_nor_is_followed(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "rank0-pid1-stack.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(victim)

    def bounded(fn: Any, *args: Any) -> object:
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(_try(fn, *args)), daemon=True)
        t.start()
        t.join(10)  # before the fix, opening a FIFO blocked until the other end came: forever
        assert result, f"{fn.__name__} blocked on a planted {kind}"
        return result[0]

    # the launcher's read (before: followed the symlink, or blocked on the FIFO), then the client's write
    assert bounded(read_stack, str(path)) is None
    assert isinstance(bounded(open_append, path), UnsafeFileError)
    assert victim.read_text() == "precious\n"


def _try(fn: Any, *args: Any) -> object:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return e


@e2e
def test_client_with_a_planted_fifo_at_its_dump_path_initializes_and_trains(workdir: Path) -> None:
    d = Daemon(workdir).wait_ready()
    try:
        os.mkfifo(d.report_dir / f"rank0-pid{os.getpid()}-stack.txt")
        c = RankMonitorClient(str(d.socket))
        done = threading.Event()

        def run() -> None:
            c.init_workload_monitoring()
            c.send_heartbeat()
            c.shutdown_workload_monitoring()
            done.set()

        threading.Thread(target=run, daemon=True).start()
        assert done.wait(20), "init_workload_monitoring() blocked on a FIFO at the stack dump path"
    finally:
        d.stop()


def test_read_bounded_reads_only_the_tail(tmp_path: Path) -> None:
    p = tmp_path / "dump.txt"
    p.write_text("a" * 100 + "END")
    assert read_bounded(p, 10) == "a" * 7 + "END"


# == Medium 5: a peer that asks and never reads cannot grow the daemon ======================

@e2e
def test_status_requests_never_read_do_not_grow_the_daemon(workdir: Path) -> None:
    sections = ",".join(f"section{i:03d}-{'x' * 80}:{i + 1}" for i in range(200))
    d = Daemon(workdir, "--ft-rank-section-timeouts", sections).wait_ready()
    try:
        base = rss_kb(d.proc.pid)
        s = raw_client(d.socket)
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        payload = hello(wire.Role.OBSERVER, -1) + wire.encode(wire.STATUS) * 100_000  # 0.6 MB of requests
        sent = 0
        end = time.monotonic() + 30
        while sent < len(payload) and time.monotonic() < end:
            try:
                sent += s.send(payload[sent:])
            except BlockingIOError:
                time.sleep(0.01)  # the daemon stopped reading us: that is the fix
            except OSError:
                break  # or it dropped us
        growth = rss_kb(d.proc.pid) - base
        assert growth < 20 * 1024, f"daemon grew by {growth} kB"  # before: +1.6 GiB
        c = RankMonitorClient(str(d.socket))
        c.init_workload_monitoring()
        c.shutdown_workload_monitoring()
        s.close()
    finally:
        d.stop()


# == Medium 6 and 7: request timeouts, and a stalled daemon never slows training ============

def _rcvtimeo(t: Any) -> float:
    import struct as st

    sec, usec = st.unpack("ll", t._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
    return sec + usec / 1e6


@e2e
def test_client_request_timeout_is_what_the_kernel_enforces_also_after_reconnecting(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-client-request-timeout", "1.5").wait_ready()
    c = RankMonitorClient(str(d.socket))
    try:
        c.init_workload_monitoring()
        assert _rcvtimeo(c._transport) == pytest.approx(1.5)  # before: the 10 s connect timeout
        d.proc.kill()
        d.proc.wait(10)
        d.stop()
        wait_until(lambda: (c.send_heartbeat(), c.lost_reason)[1], 10, "the client to notice the daemon is gone")
        d2 = Daemon(workdir, "--ft-client-request-timeout", "1.5").wait_ready()
        try:
            wait_until(lambda: c._transport is not None, 30, "the client to reconnect")
            assert _rcvtimeo(c._transport) == pytest.approx(1.5)  # before: 0.5 s whatever the setting
        finally:
            c.shutdown_workload_monitoring()
            d2.stop()
    finally:
        d.stop()


@e2e
def test_progress_calls_return_while_reconnecting_blocks(monkeypatch: pytest.MonkeyPatch, workdir: Path) -> None:
    """A stalled daemon's backlog makes every reconnect attempt wait; those waits happen on
    the client's background thread, never inside send_heartbeat()/section()."""
    from ft_client.client import link as client_link

    d = Daemon(workdir).wait_ready()
    c = RankMonitorClient(str(d.socket))
    c.init_workload_monitoring()
    stalled = threading.Event()
    entered: list[str] = []

    def connect_into_a_stalled_daemon(*args: Any, **kwargs: Any) -> Any:
        entered.append(threading.current_thread().name)
        stalled.wait(30)
        raise TransportError("monitor did not answer")

    monkeypatch.setattr(client_link, "connect", connect_into_a_stalled_daemon)
    monkeypatch.setattr(client_link, "RECONNECT_INTERVAL", 0.01)
    d.stop()  # the monitor goes away; the client notices at its next call and reconnects
    done = threading.Event()

    def train() -> None:  # until a reconnection attempt has begun (bounded), then some more steps
        end = time.monotonic() + 10
        while not entered and time.monotonic() < end:
            with c.section("step"):
                pass
            c.send_heartbeat()
        for _ in range(100):
            with c.section("step"):
                pass
            c.send_heartbeat()
        done.set()

    threading.Thread(target=train, daemon=True).start()
    try:
        # before: each attempt ran on the training thread, which waited in it
        assert done.wait(20), f"a progress call waited for a reconnection attempt (on {entered})"
        assert entered and all(name == "ft-client-reconnect" for name in entered), entered
    finally:
        stalled.set()
        c.shutdown_workload_monitoring()


# == Medium 8: a daemon that was stopped reads pending progress before judging ==============

@e2e
def test_daemon_stopped_longer_than_a_timeout_does_not_kill_a_healthy_rank(workdir: Path,
                                                                          progress: tuple[str, ...]) -> None:
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:1", "--ft-rank-heartbeat-timeout", "1",
               *progress).wait_ready()
    rank = Rank("train-until-stdin", d.socket, stdin=True)
    try:
        rank.wait_line("steps done")
        for _ in range(3):  # every trial failed before the fix, on both loops
            os.kill(d.proc.pid, signal.SIGSTOP)
            time.sleep(2.5)  # the behaviour under test: the daemon frozen past the 1 s timeouts
            os.kill(d.proc.pid, signal.SIGCONT)
            wait_until(lambda: status(d.socket)["connected"], 10, "the daemon to answer again")
        st = status(d.socket)
        assert st["hangs_detected"] == 0 and st["phase"] == "active", d.log()
        assert rank.proc.stdin is not None
        rank.proc.stdin.write("\n")
        rank.proc.stdin.flush()
        assert rank.wait(30) == 0, d.log()
        assert "hang detected" not in d.log()
    finally:
        rank.kill()
        d.stop()


# == Medium 9: the client checks who it connected to =======================================

@ROOT_ONLY
@e2e
def test_client_refuses_a_monitor_running_as_another_user(workdir: Path) -> None:
    os.chmod(workdir, 0o711)  # the other user may pass through
    squatted = workdir / "shared"
    squatted.mkdir()
    os.chmod(squatted, 0o777)  # ours, but anyone may create a socket in it
    sock = squatted / "rank0.sock"
    impostor = subprocess.Popen(other_user.command([sys.executable, str(ROOT / "tests/workers/impostor.py"), str(sock)]),
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == "listening"
        c = RankMonitorClient(str(sock))
        with pytest.raises(RankMonitorClientError, match=rf"runs as uid {NOBODY}, not as this user"):
            c.init_workload_monitoring()
    finally:
        impostor.kill()
        impostor.wait(10)
        if impostor.stdout is not None:
            impostor.stdout.close()


@ROOT_ONLY
@e2e
def test_socket_path_through_another_users_symlink_is_refused(workdir: Path) -> None:
    real = workdir / "real"
    real.mkdir(mode=0o700)
    d = Daemon(real).wait_ready()  # a real monitor of ours: only the symlink's owner is wrong
    link = workdir / "link"
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)
    try:
        c = RankMonitorClient(str(link / "rank0.sock"))
        with pytest.raises(RankMonitorClientError,
                           match=rf"goes through the symbolic link {link}, owned by uid {NOBODY}"):
            c.init_workload_monitoring()  # before: followed it and connected
        os.lchown(link, 0, 0)
        assert resolve_socket_path(str(link / "rank0.sock")) == str(d.socket)
        c.init_workload_monitoring()
        c.shutdown_workload_monitoring()
    finally:
        d.stop()


@ROOT_ONLY
@e2e
def test_socket_directory_of_another_user_is_refused(workdir: Path) -> None:
    theirs = workdir / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    sock = theirs / "rank0.sock"
    # a server of our uid answers there: only the directory's owner (who can swap the socket) is wrong
    server = subprocess.Popen([sys.executable, str(ROOT / "tests/workers/impostor.py"), str(sock)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        c = RankMonitorClient(str(sock))
        with pytest.raises(RankMonitorClientError, match=rf"belongs to uid {NOBODY}, not to this user"):
            c.init_workload_monitoring()  # before: connected and took its HELLO_OK
    finally:
        server.kill()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()


def test_the_refusal_message_recommends_a_private_runtime_directory(tmp_path: Path) -> None:
    from ft_monitor.daemon.listener import ListenerError, bind_unix_listener

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ListenerError, match=r"\$XDG_RUNTIME_DIR/ft/rank0\.sock"):
        bind_unix_listener(shared / "r.sock")


# == Medium 10: forked children neither speak for the rank nor keep its session ===========

@e2e
def test_a_forked_child_cycling_steps_does_not_hide_the_ranks_hang(workdir: Path, progress: tuple[str, ...]) -> None:
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:1", "--ft-stack-dump-timeout", "1",
               "--ft-termination-grace-time", "2", *progress).wait_ready()
    rank = Rank("fork-child-cycles", d.socket)
    try:
        child = int(rank.wait_line("child pid=").split("=")[1])
        rc = rank.wait(30)  # before: the child's steps kept the rank's session alive
        report = d.report()
        assert rc == -signal.SIGTERM and report["section"] == "step", d.log()
        assert report["elapsed_s"] < 1 + 2.0  # caught at the timeout, not seconds later
        wait_until(lambda: not pid_alive(child), 10, "the child to go with the rank's group")
    finally:
        rank.kill()
        d.stop()


@e2e
def test_a_rank_that_exits_while_a_child_holds_its_socket_ends_its_session(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-rank-heartbeat-timeout", "1", "--ft-initial-rank-heartbeat-timeout", "1").wait_ready()
    rank = Rank("fork-child-holds-socket", d.socket)
    child = 0
    try:
        child = int(rank.wait_line("child pid=").split("=")[1])
        assert rank.wait(30) == 0
        # before: the child's copy of the socket kept the session, later judged a hang of an exited process
        wait_until(lambda: not status(d.socket)["connected"], 10, "the exited rank's session to end")
        time.sleep(1.5)  # the behaviour under test: past the 1 s heartbeat timeout, no hang of an exited rank
        assert status(d.socket)["hangs_detected"] == 0, d.log()
        d.wait_log("exited while its connection is still open")
        d.wait_log("disconnected without shutdown_workload_monitoring(); the process exited")
        assert pid_alive(child)
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        rank.kill()
        d.stop()


# == Medium 11: a rank the daemon cannot see is refused with the reason ====================

@ROOT_ONLY
@e2e
def test_rank_in_a_pid_namespace_the_daemon_cannot_see_is_refused(workdir: Path) -> None:
    sock = workdir / "rank0.sock"
    log = open(workdir / "daemon.log", "w")
    daemon = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "ft_monitor.cli",
                               "serve", "--socket", str(sock), "--ft-rank-section-timeouts", "step:1"],
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        from ft_client.observer import ping

        wait_until(lambda: ping(str(sock)), 20, "the daemon in its own pid namespace")
        c = RankMonitorClient(str(sock))
        with pytest.raises(RankMonitorClientError, match=r"pid namespace the monitor cannot see.*"
                                                         r"shareProcessNamespace"):
            c.init_workload_monitoring()
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(20)
        log.close()
    assert "refused a rank connection from another pid namespace" in (workdir / "daemon.log").read_text()


# == Low ===================================================================================

def test_rank_beyond_any_real_rank_is_a_client_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", str(2**70))
    with pytest.raises(RankMonitorClientError, match=r"RANK='1180591620717411303424' is out of range"):
        RankMonitorClient()


@e2e
def test_hello_with_an_unusable_error_file_is_served(workdir: Path) -> None:
    d = Daemon(workdir).wait_ready()
    try:
        for error_file in ["/" + "x" * 300 + "/error.json", "/a/" * 2000, "relative/error.json", 5, "/a\0b"]:
            s = raw_client(d.socket)
            try:
                s.sendall(hello(wire.Role.RANK, 0, {"error_file": error_file}))
                (reply,) = read_messages(s, 1)
                assert isinstance(reply, wire.HelloOk), reply
                s.sendall(wire.encode(wire.GOODBYE))
            finally:
                s.close()
            wait_until(lambda: not status(d.socket)["connected"], 10, "the rank slot to be free")
        assert "Traceback" not in d.log()
    finally:
        d.stop()


class _Launcher:
    def __init__(self, tmp: Path) -> None:
        self.server = LauncherServer(str(tmp / "l.sock"))
        self.monitors: set[int] = set()
        self.workers: set[int] = set()
        self.server.authorize(monitor=self.monitors.__contains__, worker=self.workers.__contains__)


GOOD_NOTICE = {"rank": 1, "pid": 4242, "reason": "section", "section": "step", "message": "m", "elapsed_s": 2.0,
               "timeout_s": 1.0, "onset_time": 1.0, "detected_time": 3.0, "iteration": 7, "report": "/r.json",
               "stack_dump": None, "stack_dump_captured": False, "error_file": None}
MONITOR_HELLO = wire.Hello(wire.PROTOCOL_VERSION, wire.Role.MONITOR, 1, {})


@pytest.mark.parametrize(("change", "error"), [
    ({"detected_time": "x"}, "detected_time = 'x': must be a finite number"),
    ({"onset_time": float("nan")}, "onset_time = nan: must be a finite number"),
    ({"rank": True}, "rank = True: must be a whole number"),
    ({"pid": 0}, "pid = 0: must be a whole number >= 1"),
    ({"stack_dump_captured": "yes"}, "stack_dump_captured = 'yes': must be true or false"),
    ({"message": "x" * 5000}, "must be text of at most 4096"),
    ({"extra": 1}, "unknown field"),
])
def test_hang_notice_is_validated_before_it_is_acknowledged(tmp_path: Path, change: dict[str, Any],
                                                            error: str) -> None:
    la = _Launcher(tmp_path)
    la.monitors.add(99)
    try:
        reply = la.server.accept(wire.HangNotice({**GOOD_NOTICE, **change}), MONITOR_HELLO, 99)
        assert isinstance(reply, wire.Error) and error in reply.message, reply
        assert la.server.drain() == []
        ok = la.server.accept(wire.HangNotice(GOOD_NOTICE), MONITOR_HELLO, 99)
        assert isinstance(ok, wire.Ack)
        (event,) = la.server.drain()
        assert event.kind is EventKind.HANG and event.notice is not None and event.notice.detected_time == 3.0
    finally:
        la.server.stop()


def test_hang_notices_and_workload_requests_only_from_the_launchers_own_processes(tmp_path: Path) -> None:
    la = _Launcher(tmp_path)
    try:
        reply = la.server.accept(wire.HangNotice(GOOD_NOTICE), MONITOR_HELLO, 1234)
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.FORBIDDEN
        rank_hello = wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, 0, {})
        reply = la.server.accept(wire.Control("ShutdownWorkload", "x"), rank_hello, 1234)
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.FORBIDDEN
        la.workers.add(1234)
        assert isinstance(la.server.accept(wire.Control("ShutdownWorkload", "x"), rank_hello, 1234), wire.Ack)
        assert la.server.drain()[0].action is not None
    finally:
        la.server.stop()


@e2e
def test_a_worker_forging_a_hang_notice_neither_gets_it_acknowledged_nor_ends_the_job(workdir: Path) -> None:
    go = workdir / "go"
    out_path = workdir / "launcher.out"
    with open(out_path, "w") as out:
        la = zygote.popen(launcher_argv("--standalone", "--nproc-per-node", "1", "--ft-rank-section-timeouts", "step:60",
                                        str(ROOT / "tests/workers/rank.py"), "forge-hang-notice", "--until-file", str(go)),
                          stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        # the worker's next request is handled only after its forged notice (before: that notice
        # was acknowledged and the launcher exited 2 on detected_time "x" at its next tick)
        wait_until(lambda: "requests Continue" in out_path.read_text() or la.poll() is not None, 120,
                   "the launcher to handle the worker's next request")
        assert "requests Continue" in out_path.read_text(), out_path.read_text()[-3000:]
        go.touch()
        assert la.wait(60) == 0, out_path.read_text()[-3000:]
    finally:
        if la.poll() is None:
            os.killpg(la.pid, signal.SIGKILL)
            la.wait(10)
    text = out_path.read_text()
    assert "launcher replied Error forbidden" in text, text[-3000:]
    assert "not one of this launcher's monitors" in text


@pytest.mark.parametrize(("sig", "stops"), [(signal.SIGHUP, True), (signal.SIGQUIT, True),
                                             (signal.SIGUSR1, False), (signal.SIGUSR2, False)])
@e2e
def test_serve_with_a_command_never_leaves_it_running_unmonitored(workdir: Path, sig: signal.Signals,
                                                                  stops: bool) -> None:
    # a command that runs until stopped ("wait-stdin" would end by itself: its stdin is not a terminal here)
    d = Daemon(workdir, cmd=[sys.executable, str(ROOT / "tests/workers/rank.py"), "no-heartbeat"]).wait_ready()
    try:
        wait_until(lambda: status(d.socket)["connected"], 20, "the command to connect")
        cmd_pid = status(d.socket)["pid"]
        os.kill(d.proc.pid, sig)
        if stops:  # before: the daemon died and the command ran on unmonitored
            d.proc.wait(20)
            wait_until(lambda: not pid_alive(cmd_pid), 10, "the command to be stopped with the daemon")
            assert f"received {sig.name}" in d.log()
        else:
            d.wait_log(f"received {sig.name}; ignored")
            assert d.proc.poll() is None and pid_alive(cmd_pid)
    finally:
        d.stop()


@e2e
def test_section_names_cannot_forge_log_lines(workdir: Path) -> None:
    d = Daemon(workdir).wait_ready()
    evil = "x\n2026-01-01 00:00:00,000 ft-monitor[1] ERROR forged\x1b[2J\x00"
    try:
        s = raw_client(d.socket)
        try:
            s.sendall(hello(wire.Role.RANK))
            read_messages(s, 1)
            s.sendall(wire.section_open_frame(evil) * 2 + wire.encode(wire.GOODBYE))
            d.wait_log("shut down with section(s) still open")
        finally:
            s.close()
        log = d.log()
        assert "ERROR forged" not in [line.split(" ", 3)[-1] for line in log.splitlines()]
        assert not any(line.startswith("2026-01-01") for line in log.splitlines()), log
        assert "\x1b" not in log and "\x00" not in log
    finally:
        d.stop()


@pytest.mark.parametrize("doc", [
    "\n".join(f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9 if p else ['"lol"'] * 9) + "]"
              for c, p in zip("abcdefghi", [None, *"abcdefgh"])),  # the 522-byte "billion laughs"
    "x: &x\n  y: *x\n",  # a value that contains itself
    "[" * 5000 + "]" * 5000,
])
def test_yaml_alias_bombs_and_cycles_are_one_error_line(tmp_path: Path, doc: str) -> None:
    path = tmp_path / "ft.yaml"
    path.write_text(doc)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert len(str(info.value).splitlines()) == 1 and "Traceback" not in str(info.value)


def test_a_huge_aliased_value_is_shown_bounded(tmp_path: Path) -> None:
    doc = "\n".join(f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9 if p else ['"lol"'] * 9) + "]"
                    for c, p in zip("abcdefghi", [None, *"abcdefgh"]))
    path = tmp_path / "ft.yaml"
    path.write_text(doc + "\nfault_tolerance:\n  num_warmup_iterations: *i\n")
    with pytest.raises(ConfigError, match=r"^invalid setting num_warmup_iterations = \[\[\[") as info:
        load_config(path, environ={})
    assert len(str(info.value)) < 1000


@e2e
def test_listen_backlog_is_somaxconn(workdir: Path) -> None:
    d = Daemon(workdir).wait_ready()
    socks = []
    try:
        os.kill(d.proc.pid, signal.SIGSTOP)  # nothing is accepted: connections queue in the backlog
        for _ in range(300):  # more than asyncio's default backlog of 100
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect(str(d.socket))  # EAGAIN (BlockingIOError) once the backlog is full
            socks.append(s)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        for s in socks:
            s.close()
        d.stop()


@e2e
def test_log_file_and_summary_json_do_not_follow_planted_symlinks(workdir: Path) -> None:
    victim = workdir / "victim.txt"
    victim.write_text("precious\n")
    log_link = workdir / "monitor.log"
    log_link.symlink_to(victim)
    out = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "serve", "--socket", str(workdir / "r.sock"),
                          "--log-file", str(log_link)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "is a symbolic link; refusing to follow it" in out.stderr, out.stderr
    summary_link = workdir / "summary.json"
    summary_link.symlink_to(victim)
    out = zygote.run(launcher_argv("--standalone", "--nproc-per-node", "1", "--ft-summary-json", str(summary_link),
                                   "--ft-rank-section-timeouts", "step:5", str(ROOT / "tests/workers/rank.py"), "clean"),
                     capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    assert not summary_link.is_symlink() and json.loads(summary_link.read_text())["exit_code"] == 0


@pytest.mark.parametrize("path", ["/ft-unset-xdg/rank0.sock", "/ft-unset-xdg/job/rank0.sock"])
def test_a_socket_directory_is_never_created_at_the_root(path: str) -> None:
    """`--socket $XDG_RUNTIME_DIR/ft/rank0.sock` with XDG_RUNTIME_DIR unset is /ft/rank0.sock:
    before, the daemon created /ft (as root, at the file-system root)."""
    from ft_monitor.daemon.listener import ListenerError, check_socket_path

    top = Path("/ft-unset-xdg")
    assert not top.exists()
    try:
        with pytest.raises(ListenerError, match=r"^socket directory /ft-unset-xdg(/job)? does not exist and would "
                                                r"be created at the file-system root \(/ft-unset-xdg\); refusing: "
                                                r"was it written as \$XDG_RUNTIME_DIR/ft-unset-xdg"):
            check_socket_path(path)
        assert not top.exists()
    finally:
        if top.exists():
            shutil.rmtree(top)


@e2e
def test_serve_refuses_a_socket_at_the_root_naming_the_variable(workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    try:
        out = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "serve", "--socket", "/ft-unset-xdg/rank0.sock"],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=30)
    finally:
        if os.path.isdir("/ft-unset-xdg"):
            shutil.rmtree("/ft-unset-xdg")
            raise AssertionError("the daemon created /ft-unset-xdg")
    assert out.returncode == 1, out
    assert "XDG_RUNTIME_DIR" in out.stderr and "file-system root" in out.stderr, out.stderr
