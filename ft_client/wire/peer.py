"""Who is at the other end of a Unix-socket connection, from the kernel (SO_PEERCRED).

The pid and uid come from the kernel, not from anything the peer says. Used by the
daemon (who is this rank?), the launcher (is this one of my monitors or workers?)
and the client (is this monitor mine, or another user's impostor?). Stdlib only.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    """0 when the peer's process is in a pid namespace this process cannot see."""
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def same_user(cred: PeerCred) -> bool:
    return cred.uid == os.geteuid()


SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
"""Linux >= 6.5: a pidfd on the very process that connected, taken at connect time."""


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd on the process that connected (even if it has exited since, or its pid was
    reused: the pidfd then reports it gone); None where the kernel does not offer it."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4)
    except OSError:
        return None
    fd = int(struct.unpack("i", raw)[0])
    return fd if fd >= 0 else None
