"""Whose socket is at the other end of a ``/metrics`` connection: the peer's uid, asked of the
kernel for that one socket through NETLINK_SOCK_DIAG (`PeerUids`; the request and the reply
made and read by pure functions, `diag_request` and `diag_uid`). `eviction_victim` uses it:
another user's connection gives way before the launcher's own user's.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

# -- whose socket is the peer's (sock_diag netlink) ------------------------------------------------
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")
"""nlmsghdr: length, type, flags, sequence, port id."""
_DIAG_REQ = struct.Struct("=BBBxI")
"""inet_diag_req_v2 before its socket id: family, protocol, extensions, pad, states."""
_DIAG_MSG = struct.Struct("=BBBB")
"""inet_diag_msg before its socket id: family, state, timer, retransmits."""
_SOCKID_PORTS = struct.Struct(">HH")
_SOCKID_TAIL = struct.Struct("=III")
"""inet_diag_sockid after the addresses: interface, cookie (INET_DIAG_NOCOOKIE: any)."""
_DIAG_UID_INODE = struct.Struct("=II")
_DIAG_UID_OFFSET = _DIAG_MSG.size + 48 + 12
"""inet_diag_msg: header, socket id (48 bytes), expires, rqueue, wqueue, then uid and inode."""
_TCP_LISTEN = 10


def diag_request(family: int, peer: tuple[Any, ...], local: tuple[Any, ...], seq: int) -> bytes:
    """A sock_diag request for the one TCP socket whose own address is ``peer`` and whose peer is
    ``local`` (the other end of a connection we accepted: getpeername, getsockname); ValueError
    or OSError for an address it cannot be made for (pure)."""
    src = socket.inet_pton(family, peer[0]).ljust(16, b"\0")
    dst = socket.inet_pton(family, local[0]).ljust(16, b"\0")
    body = (_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + _SOCKID_PORTS.pack(peer[1], local[1])
            + src + dst + _SOCKID_TAIL.pack(0, 0xFFFFFFFF, 0xFFFFFFFF))
    return _NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0) + body


def diag_uid(reply: bytes, seq: int, peer_port: int, local_port: int) -> int | None:
    """The socket owner's uid in the kernel's ``reply`` to request ``seq``; None for anything
    else: an error (no such socket: the peer is on another host or in another network
    namespace), a reply to another request, a socket with other ports, a listener, or a socket
    no process holds (a timewait or request minisock, whose uid the kernel reports as 0) (pure)."""
    off = 0
    while off + _NLMSG.size <= len(reply):
        length, kind, _, rseq, _ = _NLMSG.unpack_from(reply, off)
        if length < _NLMSG.size or off + length > len(reply):
            return None
        if rseq == seq:
            msg = off + _NLMSG.size
            if kind != _SOCK_DIAG_BY_FAMILY or length < _NLMSG.size + _DIAG_UID_OFFSET + _DIAG_UID_INODE.size:
                return None
            _, state, _, _ = _DIAG_MSG.unpack_from(reply, msg)
            sport, dport = _SOCKID_PORTS.unpack_from(reply, msg + _DIAG_MSG.size)
            uid, inode = _DIAG_UID_INODE.unpack_from(reply, msg + _DIAG_UID_OFFSET)
            if sport != peer_port or dport != local_port or state == _TCP_LISTEN or inode == 0:
                return None
            return int(uid)
        off += (length + 3) & ~3
    return None


class PeerUids:
    """The uid owning the other end of an accepted TCP connection whose peer is on this host, asked
    of the kernel for that one socket (NETLINK_SOCK_DIAG, as ``ss`` does; no scan of
    /proc/net/tcp, whose size another user could inflate). None where it cannot say: a peer on
    another host, no netlink (not Linux, a sandbox), any error. One descriptor, opened here."""

    def __init__(self) -> None:
        self._seq = 0
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
            self._sock.setblocking(False)
        except (OSError, AttributeError):
            if self._sock is not None:
                self._sock.close()
            self._sock = None

    def uid(self, conn: socket.socket) -> int | None:
        if self._sock is None or conn.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        try:
            peer, local = conn.getpeername(), conn.getsockname()
            request = diag_request(conn.family, peer, local, self._seq)
            while True:  # a reply left behind by an earlier error
                try:
                    self._sock.recv(65536)
                except BlockingIOError:
                    break
            self._sock.send(request)
            for _ in range(4):  # the kernel answers within the send
                found = diag_uid(self._sock.recv(65536), self._seq, int(peer[1]), int(local[1]))
                if found is not None:
                    return found
        except (OSError, ValueError):
            pass
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
