"""Opening the files ft-monitor writes and reads, so that nothing planted at a path harms us.

Where reports, stack dumps and logs go, another user (or a stale file) may have
put a symlink, a FIFO or a device. Every file here is opened without following a
symlink (O_NOFOLLOW), without blocking on a FIFO (O_NONBLOCK), and then checked
with fstat to be a regular file owned by this user; anything else is refused
with an `UnsafeFileError` naming the path and what was found. Directories that
hold such files must be private (`check_private_dir`). Shared by the client (its
stack dump file), the daemon and the launcher; stdlib only.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from ft_client.errors import FtError

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFileError(FtError, OSError):
    """A path where a regular file of ours was expected holds something else."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _check_fd(fd: int, path: str | os.PathLike[str]) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path} is {_kind(st.st_mode)}, not a regular file; refusing to use it")
    if st.st_uid != os.geteuid():
        raise UnsafeFileError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
                              "refusing to use it")


def _open(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a symlink
            raise UnsafeFileError(f"{path} is a symbolic link; refusing to follow it") from e
        if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise UnsafeFileError(f"{path} is a FIFO, not a regular file; refusing to use it") from e
        raise
    try:
        _check_fd(fd, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | os.PathLike[str]) -> int:
    """A descriptor for appending to ``path`` (created 0600 if missing); refuses anything
    but a regular file of ours."""
    return _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def open_new(path: str | os.PathLike[str]) -> int:
    """A descriptor on a file created now (O_EXCL: nothing may be there already)."""
    return _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def read_bounded(path: str | os.PathLike[str], limit: int) -> str:
    """The last ``limit`` bytes of a regular file of ours, as text (bad bytes replaced)."""
    fd = _open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            os.lseek(fd, size - limit, os.SEEK_SET)
        return _read_text(fd, limit)
    finally:
        os.close(fd)


def read_span(path: str | os.PathLike[str], start: int, end: int, limit: int) -> str:
    """Bytes [start, end) of a regular file of ours, as text; at most the last ``limit`` of them."""
    fd = _open(path, os.O_RDONLY)
    try:
        start = max(start, end - limit, 0)
        os.lseek(fd, start, os.SEEK_SET)
        return _read_text(fd, max(0, end - start))
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same directory
    and a rename: a reader sees the old file or the new one, never half of one, and a
    symlink planted at ``path`` is replaced, not followed. No temporary file is left
    behind on failure."""
    import json  # here, not at the top: the training process imports this module for its stack dump

    write_bytes_atomic(path, (json.dumps(data, indent=indent) + "\n").encode())


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename: a reader
    sees the old file or the whole new one, never a part."""
    import tempfile

    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_text(fd: int, n: int) -> str:
    """Up to ``n`` bytes from ``fd``'s offset, as text (undecodable bytes replaced)."""
    chunks = []
    left = n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def private_dir_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why ``directory`` may not hold our sockets, reports or dumps, or None if it may:
    it must be a real directory (not reached through a symlink at its last component),
    owned by this user, and writable by no one else."""
    try:
        st = os.lstat(directory)
    except OSError as e:
        return f"cannot inspect {directory}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(directory)
        except OSError as e:
            return f"{directory} is a symbolic link that cannot be followed: {e.strerror or e}"
        if os.lstat(directory).st_uid not in (0, os.geteuid()):
            return f"{directory} is a symbolic link owned by uid {os.lstat(directory).st_uid}, another user"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{directory} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return (f"{directory} has mode {stat.S_IMODE(st.st_mode):04o}: other users can write there "
                "and plant files where reports and dumps go")
    return None


def check_private_dir(directory: str | os.PathLike[str], what: str) -> None:
    """Raise UnsafeFileError unless ``directory`` is private to this user (see private_dir_problem)."""
    problem = private_dir_problem(directory)
    if problem is not None:
        raise UnsafeFileError(f"{what}: {problem}; use a directory of your own with mode 0700")
