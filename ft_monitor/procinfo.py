"""What the daemon learns about a rank process from the kernel (Linux).

Peer credentials of a Unix-socket connection (SO_PEERCRED: the pid comes from
the kernel, not from what the client claims), process identity (a pidfd pins
the process: a signal sent through it can never reach a later process that
reused the pid), process group, and the exit status of a process that is not
our child, when the kernel still has it.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3 onwards)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    close = data.rfind(b")")
    return data[close + 2 :].decode("ascii", "replace").split()


def start_time(pid: int) -> int | None:
    """The process start time in clock ticks since boot (field 22), or None if gone."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def zombie_exit_status(pid: int) -> int | None:
    """The wait status of a process that exited but was not yet reaped (field 52), else None."""
    fields = _stat_fields(pid)
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    return int(fields[49])


def describe_wait_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by {name}"
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


class ProcessHandle:
    """A pidfd on one process: signals reach exactly that process, and its exit is observable.

    Falls back to pid + start-time checks where pidfd_open is unavailable.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start_time = start_time(pid)
        self.fd: int | None
        try:
            self.fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self.fd = None

    def alive(self) -> bool:
        """Running (not exited, not a zombie) and still the process we opened."""
        if self.fd is not None:
            try:
                signal.pidfd_send_signal(self.fd, 0)
            except OSError:
                return False
        elif self.start_time is None or start_time(self.pid) != self.start_time:
            return False
        fields = _stat_fields(self.pid)
        return bool(fields) and fields[0] != "Z"

    def send(self, sig: int) -> bool:
        """Signal the process itself. False if it no longer exists (or is another process now)."""
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            elif self.alive():
                os.kill(self.pid, sig)
            else:
                return False
            return True
        except ProcessLookupError:
            return False

    def pgid(self) -> int | None:
        if not self.alive():
            return None
        try:
            return os.getpgid(self.pid)
        except ProcessLookupError:
            return None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False if no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(children.get(child, []))
    return out
