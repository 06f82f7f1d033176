"""What the daemon and the launcher learn about processes from the kernel (Linux).

Peer credentials of a Unix-socket connection (SO_PEERCRED: the pid comes from
the kernel, not from what the client claims), process identity (a pidfd pins
the process: a signal sent through it can never reach a later process that
reused the pid, and it tells the process's exit without opening anything),
process groups signalled only while a pinned member is still in them, and the
exit status of a process that is not our child, when the kernel still has it.

Only "no such process" (ENOENT from /proc, ESRCH from a signal) counts as gone;
any other error (EMFILE, EACCES, ...) says nothing about the process and is
never taken as its exit.
"""

from __future__ import annotations

import errno
import os
import select
import signal
from collections.abc import Collection

from ft_client.errors import FtError
from ft_client.wire.peer import PeerCred, peer_credentials, peer_pidfd

__all__ = ["PeerCred", "peer_credentials", "ProcessHandle", "PinnedGroup", "descendants", "group_members",
           "describe_wait_status", "peer_pidfd", "parent_pid", "signal_group", "start_time", "zombie_exit_status",
           "descends_from", "catches_signal"]

_GONE = (errno.ENOENT, errno.ESRCH)


class Unknown(FtError):
    """/proc could not be read for a reason other than the process being gone."""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3 onwards); None if the
    process is gone. Raises Unknown for any other failure (e.g. out of descriptors)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise Unknown(f"cannot read /proc/{pid}/stat: {e.strerror or e}") from e
    close = data.rfind(b")")
    return data[close + 2 :].decode("ascii", "replace").split()


def _stat_or_none(pid: int) -> list[str] | None:
    try:
        return _stat_fields(pid)
    except Unknown:
        return None


def start_time(pid: int) -> int | None:
    """The process start time in clock ticks since boot (field 22), or None if unknown."""
    fields = _stat_or_none(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (field 4), or None if unknown."""
    fields = _stat_or_none(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has); False when unknown."""
    fields = _stat_or_none(pid)
    return fields is not None and bool(fields) and fields[0] != "Z"


def zombie_exit_status(pid: int) -> int | None:
    """The wait status of a process that exited but was not yet reaped (field 52), else None."""
    fields = _stat_or_none(pid)
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

    Open it while the pid is known to be the intended process (a child not yet
    reaped, or a peer at the moment it connected). Where pidfd_open is not
    available, falls back to pid + start-time checks through /proc.
    """

    __slots__ = ("pid", "fd", "_start_time")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: int | None
        self._start_time: int | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: a handle on nothing, never alive
            self.fd = None
        except (OSError, AttributeError):
            self.fd = None
            self._start_time = start_time(pid)

    @classmethod
    def adopt(cls, pid: int, fd: int) -> ProcessHandle:
        """A handle on a pidfd obtained elsewhere (SO_PEERPIDFD); it now owns ``fd``."""
        h = cls.__new__(cls)
        h.pid, h.fd, h._start_time = pid, fd, None
        return h

    @classmethod
    def open(cls, pid: int) -> ProcessHandle | None:
        """A handle on ``pid``, or None when no such process exists."""
        h = cls(pid)
        if h.fd is None and h._start_time is None:
            return None
        return h

    def alive(self) -> bool:
        """Running (not exited, not a zombie) and still the process we opened.

        With a pidfd this needs no descriptor and no /proc: the pidfd polls readable
        once the process has exited. An error that does not mean "gone" answers True.
        """
        if self.fd is not None:
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            return not poller.poll(0)
        if self._start_time is None:
            return False
        try:
            fields = _stat_fields(self.pid)
        except Unknown:
            return True
        return fields is not None and len(fields) > 19 and int(fields[19]) == self._start_time and fields[0] != "Z"

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
        """Its process group, or None once it has exited."""
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

    def __repr__(self) -> str:
        return f"ProcessHandle(pid={self.pid})"


class PinnedGroup:
    """A process group that is signalled only while a process we pinned is still in it
    (or, with ``pgid=None``, just a set of pinned processes).

    A group id is a pid: once every member has exited, the kernel may hand it to
    an unrelated process that starts its own session, and `killpg` would reach
    it. As long as a pinned member is alive and still in the group, the id is in
    use and cannot have been recycled. Pinned members that left the group (setsid)
    are signalled one by one, so they are not missed; each process gets a signal once.
    """

    def __init__(self, pgid: int | None, members: list[ProcessHandle], *,
                 borrowed: tuple[ProcessHandle, ...] = ()) -> None:
        self.pgid = pgid
        self.members = members
        self._borrowed = {id(h) for h in borrowed}
        """Handles owned by someone else: used, never closed here."""

    @classmethod
    def of_leader(cls, leader: ProcessHandle, *, borrowed: bool = False) -> PinnedGroup | None:
        pgid = leader.pgid()
        if pgid is None:
            return None
        return cls(pgid, [leader], borrowed=(leader,) if borrowed else ())

    def _anchor(self) -> ProcessHandle | None:
        """A pinned member still in the group: proof that the group id is still ours."""
        if self.pgid is None:
            return None
        for h in self.members:
            if h.alive():
                try:
                    if os.getpgid(h.pid) == self.pgid:
                        return h
                except ProcessLookupError:
                    continue
        return None

    def pin_members(self, pids: list[int] | None = None) -> None:
        """Pin the group's current members (from /proc unless ``pids`` is given), while
        the group is provably ours; a process that has exited is let go."""
        if self.pgid is None or self._anchor() is None:
            return
        known = {h.pid for h in self.members}
        for pid in pids if pids is not None else group_members(self.pgid):
            if pid in known:
                continue
            h = ProcessHandle.open(pid)
            if h is None:
                continue
            try:
                in_group = os.getpgid(pid) == self.pgid
            except ProcessLookupError:
                in_group = False
            # pinned after the check above: still ours only if an anchor still vouches for the id
            if in_group and h.alive() and self._anchor() is not None:
                self.members.append(h)
            else:
                h.close()
        self._drop_exited()

    def _drop_exited(self) -> None:
        keep = []
        for h in self.members:
            if h.alive() or id(h) in self._borrowed:
                keep.append(h)
            else:
                h.close()
        self.members = keep

    def send(self, sig: int) -> bool:
        """Deliver ``sig`` once to every process: the group with one `killpg` (while
        pinned), then only the pinned members that are not in it (they left it: setsid).
        A member in the group is never signalled a second time: a rank whose handler
        exits (``sys.exit`` in a SIGTERM handler, after an emergency checkpoint) would be
        re-entered, or killed by the default action once the interpreter has restored it.
        False if no process was reached."""
        grouped = self.pgid is not None and self._anchor() is not None and signal_group(self.pgid, sig)
        reached = grouped
        for h in self.members:
            if grouped and self._in_group(h):
                continue
            reached = h.send(sig) or reached
        return reached

    def _in_group(self, h: ProcessHandle) -> bool:
        """Whether ``h`` is (still) in the group: it had the group's signal. One that is
        gone counts as in it: there is nothing left to signal."""
        try:
            return os.getpgid(h.pid) == self.pgid
        except ProcessLookupError:
            return True

    def any_left(self) -> bool:
        return self._anchor() is not None or any(h.alive() for h in self.members)

    def add(self, h: ProcessHandle) -> None:
        """Pin one more process (a descendant, inside the group or not)."""
        self.members.append(h)

    def close(self) -> None:
        for h in self.members:
            if id(h) not in self._borrowed:
                h.close()
        self.members = []

    def __str__(self) -> str:
        pids = [h.pid for h in self.members]
        if self.pgid is not None:
            others = [p for p in pids if p != self.pgid]
            return f"process group {self.pgid}" + (f" and pinned processes {others}" if others else "")
        return f"pid {pids[0]}" + (f" and its descendants {pids[1:]}" if len(pids) > 1 else "") if pids else "nothing"


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False if no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _all_stats() -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            fields = _stat_or_none(int(entry))
            if fields and len(fields) > 2:
                out[int(entry)] = fields
    return out


def group_members(pgid: int) -> list[int]:
    """Every live process whose process group is ``pgid``, from /proc (best effort)."""
    return [pid for pid, f in _all_stats().items() if f[2] == str(pgid) and f[0] != "Z"]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), from /proc (best effort)."""
    children: dict[int, list[int]] = {}
    for child, fields in _all_stats().items():
        children.setdefault(int(fields[1]), []).append(child)
    out: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(children.get(child, []))
    return out


def descends_from(pid: int, ancestor: int | Collection[int], max_depth: int = 16) -> bool:
    """``pid`` is ``ancestor`` (or one of several) or one of its descendants (parent links
    in /proc, best effort)."""
    ancestors = {ancestor} if isinstance(ancestor, int) else ancestor
    for _ in range(max_depth):
        if pid in ancestors:
            return True
        parent = parent_pid(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def catches_signal(pid: int, sig: int) -> bool | None:
    """Whether ``pid`` has a handler installed for ``sig`` (SigCgt in /proc/PID/status), or
    None if that cannot be read. A process without one would take the signal's default
    action: for SIGUSR1/SIGUSR2, to terminate."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None
