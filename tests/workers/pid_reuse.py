"""Scenarios that need a pid to be reused on purpose; run inside a private pid namespace.

    unshare --pid --fork --mount-proc python tests/workers/pid_reuse.py SCENARIO [ARGS]

In a new pid namespace /proc/sys/kernel/ns_last_pid is ours to write: setting it to
P - 1 makes the next process get pid P, so "a pid recycled by an unrelated process"
happens at once instead of after a full wrap-around. Prints one JSON line with what
it observed; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ft_client import wire  # noqa: E402


def spawn_with_pid(pid: int, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
    """Start ``argv`` so that it gets ``pid`` (free by now), as an unrelated process would."""
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))
    proc = subprocess.Popen(argv, **kwargs)  # type: ignore[call-overload]
    if proc.pid != pid:
        raise SystemExit(f"could not force pid reuse: got {proc.pid}, wanted {pid}")
    return proc


def survives(proc: subprocess.Popen[bytes], seconds: float = 0.5) -> bool:
    """Whether ``proc`` is still running ``seconds`` later: the behaviour under test is
    that nothing kills it, so the test waits out a bounded interval."""
    try:
        proc.wait(seconds)
        return False
    except subprocess.TimeoutExpired:
        return True


def groups() -> dict[str, object]:
    """The launcher's leftover-group kill must not reach a session leader that reused a
    finished worker's pid, and must still reach a worker's leftover child."""
    from ft_monitor.launcher.agent.groups import WorkerGroups  # here: "hello-after-exit" needs none of the launcher

    out: dict[str, object] = {}
    # 1. a worker that finished and was reaped; its pid is then reused by a new session leader
    worker = subprocess.Popen(["sleep", "600"], start_new_session=True)
    wg = WorkerGroups()
    wg.track([worker.pid])
    wg.pin_members()
    worker.kill()
    worker.wait()
    unrelated = spawn_with_pid(worker.pid, ["sleep", "600"], start_new_session=True)
    out["unrelated_pid_is_old_pgid"] = os.getpgid(unrelated.pid) == worker.pid
    wg.kill()
    out["unrelated_survives"] = survives(unrelated)
    unrelated.kill()
    unrelated.wait()
    wg.close()
    # 2. a worker whose child is still in its group after the worker itself exited
    leader = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; exec sleep 600"], start_new_session=True,
                              stdout=subprocess.PIPE)
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    wg = WorkerGroups()
    wg.track([leader.pid])
    wg.pin_members()  # while the worker leads its group: the child is pinned
    leader.kill()
    leader.wait()
    wg.kill()
    end = time.monotonic() + 10
    gone = False
    while time.monotonic() < end and not gone:
        try:
            os.kill(child, 0)
            with open(f"/proc/{child}/stat") as f:
                gone = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except ProcessLookupError:
            gone = True
        time.sleep(0.01)
    out["leftover_child_killed"] = gone
    wg.close()
    return out


def hello_after_exit(workdir: str) -> dict[str, object]:
    """A connection made by a process that then exits; its pid is reused; the HELLO comes
    afterwards. The daemon (in this namespace too) must not take the new process for the rank."""
    from tests.procs import Daemon

    daemon = Daemon(Path(workdir)).wait_ready()
    try:
        out = _hello_after_exit(str(daemon.socket))
    finally:
        daemon.stop()
    out["log"] = daemon.log()
    return out


def _hello_after_exit(sock_path: str) -> dict[str, object]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            s.connect(sock_path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    impostor = spawn_with_pid(pid, ["sleep", "600"], start_new_session=True)
    s.settimeout(10)
    s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, 0, {})))
    reply = wire.read_frame_blocking(lambda n: _recv_exact(s, n))
    s.close()
    impostor.send_signal(signal.SIGKILL)
    impostor.wait()
    return {"reply": type(reply).__name__, "code": getattr(reply, "code", None),
            "message": getattr(reply, "message", None), "connected_pid": pid}


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


if __name__ == "__main__":
    scenario = sys.argv[1]
    if scenario == "groups":
        result = groups()
    elif scenario == "hello-after-exit":
        result = hello_after_exit(sys.argv[2])
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps(result), flush=True)
