"""Fault injection with real processes: ranks killed at awkward moments, children that
resist, a report directory that cannot be written, and many hang/kill cycles against
one daemon. The rules: nothing of the job leaks, nothing is killed that should not be,
and the daemon's own resources come back to where they were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ft_client.wire.transport import TransportError
from tests.procs import WORKERS, Daemon, Rank, cleanup_dir, pid_alive, short_tmpdir, status, wait_until

pytestmark = pytest.mark.e2e

QUICK = ("--ft-stack-dump-timeout", "0.5", "--ft-termination-grace-time", "0.5")


def try_status(sock: Path) -> dict[str, Any] | None:
    try:
        return status(sock)
    except (OSError, TransportError, AssertionError):
        return None


def open_step(sock: Path) -> dict[str, Any] | None:
    """Status, once the rank is inside its `step` section; else None."""
    st = try_status(sock)
    if st and st.get("connected") and [s["name"] for s in st["open_sections"]] == ["step"]:
        return st
    return None


def hang_report(d: Daemon, pid: int, timeout: float = 20.0) -> dict[str, Any]:
    """The finished hang report of ``pid`` (the daemon has stopped acting on it)."""
    path = d.report_dir / f"rank0-pid{pid}-hang.json"

    def done() -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("terminated_by") else None

    return wait_until(done, timeout, f"the finished hang report of pid {pid}")


def kill_all(pids: list[int]) -> None:
    for p in pids:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- a rank killed from outside ---------------------------------------------------------------


def test_rank_sigkilled_mid_section_is_logged_as_killed_and_is_no_hang(workdir: Path) -> None:
    """`serve -- CMD`: the daemon is the rank's parent, so it can say what killed it."""
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:30", *QUICK,
               cmd=[sys.executable, str(WORKERS / "rank.py"), "sleep"])
    try:
        pid = wait_until(lambda: open_step(d.socket), 30, "the rank inside its step section")["pid"]
        os.kill(pid, signal.SIGKILL)
        assert d.proc.wait(30) == 128 + signal.SIGKILL
        log = d.log()
        assert (f"rank 0 pid {pid} disconnected without shutdown_workload_monitoring(); the process exited "
                "(killed by SIGKILL)") in log, log
        assert "hang detected" not in log and "sent SIGTERM" not in log
        assert list(d.report_dir.glob("*-hang.json")) == []
        assert list(d.report_dir.glob("*-stack.txt")) == []  # never dumped: before, a header-only file
    finally:
        d.stop()


def test_rank_killed_just_before_its_deadline_is_never_signalled(workdir: Path, progress: tuple[str, ...]) -> None:
    """The rank dies (SIGKILL from outside) 0.4 s before its section deadline; its pid
    may be reused. The daemon must send nothing to anyone: an unrelated process
    started right after the kill must survive the moment the deadline would have fired."""
    timeout = 1.0
    d = Daemon(workdir, "--ft-rank-section-timeouts", f"step:{timeout}", *QUICK, *progress).wait_ready()
    rank = Rank("sleep", d.socket)
    bystander: subprocess.Popen[bytes] | None = None
    try:
        rank.wait_line("steps done")
        st = wait_until(lambda: (lambda s: s if s and s["open_sections"][0]["elapsed_s"] >= timeout - 0.4 else None)(
            open_step(d.socket)), 10, "the step section near its deadline")
        deadline = time.monotonic() + timeout - st["open_sections"][0]["elapsed_s"]
        os.killpg(rank.proc.pid, signal.SIGKILL)
        rank.proc.wait(10)  # reaped: the pid is free for reuse from here on
        bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
        d.wait_log(f"rank 0 pid {rank.proc.pid} disconnected without shutdown_workload_monitoring()")
        # Nothing must happen at the deadline: let the clock pass it (plus dump and grace time).
        wait_until(lambda: time.monotonic() > deadline + 0.5, 10, "the former deadline to pass")
        log = d.log()
        assert "hang detected" not in log and "sent SIGTERM" not in log and "sent SIGKILL" not in log, log
        assert status(d.socket)["hangs_detected"] == 0
        assert bystander.poll() is None, "an unrelated process was killed"
        assert list(d.report_dir.glob("*-hang.json")) == []
    finally:
        rank.kill()
        if bystander is not None:
            bystander.kill()
            bystander.wait(5)
        d.stop()


# -- children of a hung rank --------------------------------------------------------------------


def test_children_ignoring_sigterm_do_not_survive_the_hang(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:0.5", *QUICK).wait_ready()
    rank = Rank("children-ignore-term", d.socket)
    children: list[int] = []
    try:
        children = [int(p) for p in rank.wait_line("children pids=").split("=")[1].split(",")]
        assert len(children) == 2 and all(pid_alive(c) for c in children)
        assert rank.wait(30) == -signal.SIGTERM  # the rank itself obeys SIGTERM
        report = hang_report(d, rank.proc.pid)
        assert report["terminated_by"] == "SIGTERM", report  # what stopped the rank
        assert report["actions"][-1].startswith("sent SIGKILL to process group"), report
        wait_until(lambda: not any(pid_alive(c) for c in children), 10, "the SIGTERM-proof children to die")
        assert "rank exited, other processes remained; sent SIGKILL" in d.log()
    finally:
        rank.kill()
        kill_all(children)
        d.stop()


def test_child_in_its_own_session_does_not_survive_the_hang(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:0.5", *QUICK).wait_ready()
    rank = Rank("child-own-session", d.socket)
    children: list[int] = []
    try:
        children = [int(rank.wait_line("child pid=").split("=")[1])]
        assert rank.wait(30) == -signal.SIGTERM
        hang_report(d, rank.proc.pid)
        wait_until(lambda: not pid_alive(children[0]), 1.5, "the child to die")
    finally:
        rank.kill()
        kill_all(children)
        d.stop()


# -- the report directory cannot be written -----------------------------------------------------
#
# As root, chmod 0500 does not stop writes. What fails for root too: the report's path
# is a directory (os.replace onto it fails with EISDIR; works everywhere, no privileges),
# and a full file system (ENOSPC; needs a tmpfs mount, so only where mount is allowed).


@pytest.fixture(scope="module")
def report_path_is_a_directory() -> Iterator[dict[str, Any]]:
    workdir = short_tmpdir()
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:0.5", *QUICK).wait_ready()
    rank = Rank("sleep", d.socket)
    try:
        pid = int(rank.wait_line("connected pid=").split("=")[1])
        (d.report_dir / f"rank0-pid{pid}-hang.json").mkdir()  # before the deadline (0.5 s after the steps)
        rc = rank.wait(30)
        log = d.wait_log("rank 0: sent SIGTERM")
        wait_until(lambda: d.log().count("cannot write hang report") >= 2, 10, "the final report write")
        yield {"pid": pid, "rc": rc, "log": d.log(), "files": sorted(p.name for p in d.report_dir.iterdir()),
               "daemon_alive": d.proc.poll() is None, "first_log": log}
    finally:
        rank.kill()
        d.stop()
        cleanup_dir(workdir)


def test_unwritable_report_still_detects_kills_and_logs(report_path_is_a_directory: dict[str, Any]) -> None:
    r = report_path_is_a_directory
    assert r["rc"] == -signal.SIGTERM
    assert f"hang detected: rank=0 pid={r['pid']} reason=section section=step" in r["log"]
    assert "rank 0: cannot write hang report" in r["log"] and "Is a directory" in r["log"], r["log"]
    assert r["daemon_alive"]


def test_unwritable_report_leaves_no_temporary_files(report_path_is_a_directory: dict[str, Any]) -> None:
    r = report_path_is_a_directory
    assert [f for f in r["files"] if f.startswith(".")] == [], r["files"]  # no temporary file left


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                         capture_output=True, timeout=10)
    return out.returncode == 0


def test_full_file_system_still_detects_kills_and_logs(workdir: Path) -> None:
    reports = workdir / "reports"
    if not _mount_tmpfs(reports, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); the EISDIR case covers the path")
    d: Daemon | None = None
    rank: Rank | None = None
    try:
        d = Daemon(workdir, "--ft-rank-section-timeouts", "step:0.5", *QUICK).wait_ready()
        rank = Rank("sleep", d.socket)
        rank.wait_line("connected pid=")  # its stack-dump file exists; now fill the disk
        try:
            with open(reports / "filler", "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * 4096)
        except OSError:
            pass  # full
        assert rank.wait(30) == -signal.SIGTERM
        log = d.wait_log("rank 0: sent SIGTERM")
        assert "hang detected: rank=0" in log
        d.wait_log("No space left on device")
        assert "cannot write hang report" in d.log()
        assert d.proc.poll() is None
    finally:
        if rank is not None:
            rank.kill()
        if d is not None:
            d.stop()
        subprocess.run(["umount", "-l", str(reports)], capture_output=True, timeout=10)


# -- many hang/kill cycles against one daemon ---------------------------------------------------

CYCLES = 20


def _proc_status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _children(pid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        n += 1
            except (OSError, IndexError, ValueError):
                pass
    return n


def _resources(pid: int) -> dict[str, int]:
    st = _proc_status(pid)
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(st["Threads"]),
            "rss_kb": int(st["VmRSS"].split()[0]), "children": _children(pid)}


def _settled(pid: int, base: dict[str, int]) -> dict[str, int]:
    """Resources once transient ones (the connection that just closed) are gone; bounded."""
    try:
        wait_until(lambda: (lambda r: r["fds"] <= base["fds"] and r["threads"] <= base["threads"]
                            and r["children"] <= base["children"])(_resources(pid)), 2.0, "resources to settle")
    except AssertionError:
        pass
    return _resources(pid)


def _steady(pid: int) -> dict[str, int]:
    """Resources once the counts read the same three times in a row (20 ms apart)."""
    seen: list[Any] = [None, 0]

    def same() -> dict[str, int] | None:
        r = _resources(pid)
        key = (r["fds"], r["threads"], r["children"])
        seen[1] = seen[1] + 1 if key == seen[0] else 0
        seen[0] = key
        return r if seen[1] >= 2 else None

    return wait_until(same, 5.0, "steady resource counts", interval=0.02)


@pytest.fixture(scope="module")
def hang_cycles() -> Iterator[dict[str, Any]]:
    workdir = short_tmpdir()
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:0.2", *QUICK).wait_ready()
    pid = d.proc.pid
    try:
        after_first: dict[str, int] = {}
        outcomes = []
        for i in range(CYCLES):
            rank = Rank("sleep", d.socket, "--steps", "1")
            try:
                rc = rank.wait(30)
            finally:
                rank.kill()
            report = hang_report(d, rank.proc.pid)
            wait_until(lambda: try_status(d.socket) and not status(d.socket)["connected"], 10, "the rank slot")
            outcomes.append((rc, report["terminated_by"], report["stack_dump_captured"]))
            if i == 0:
                after_first = _steady(pid)
        after_last = _settled(pid, after_first)
        yield {"first": after_first, "last": after_last, "outcomes": outcomes,
               "hangs": status(d.socket)["hangs_detected"], "log": d.log()}
    finally:
        d.stop()
        cleanup_dir(workdir)


def test_every_cycle_is_a_caught_and_killed_hang(hang_cycles: dict[str, Any]) -> None:
    assert hang_cycles["hangs"] == CYCLES
    assert hang_cycles["outcomes"] == [(-signal.SIGTERM, "SIGTERM", True)] * CYCLES, hang_cycles["outcomes"]
    assert "Traceback" not in hang_cycles["log"]


def test_cycles_leave_no_threads_children_or_memory_behind(hang_cycles: dict[str, Any]) -> None:
    first, last = hang_cycles["first"], hang_cycles["last"]
    assert last["threads"] == first["threads"], (first, last)
    assert last["children"] == first["children"] == 0, (first, last)
    assert last["rss_kb"] - first["rss_kb"] < 2048, (first, last)


def test_cycles_leave_no_file_descriptors_behind(hang_cycles: dict[str, Any]) -> None:
    first, last = hang_cycles["first"], hang_cycles["last"]
    assert last["fds"] == first["fds"], (first, last)
