"""Opening the files ft-monitor writes and reads, so that nothing planted at a path harms us.

Where reports, stack dumps and logs go, another user (or a stale file) may have
put a symlink, a FIFO or a device. Every file here is opened without following a
symlink (O_NOFOLLOW), without blocking on a FIFO (O_NONBLOCK), and then checked
with fstat to be a regular file owned by this user; anything else is refused
with an `UnsafeFileError` naming the path and what was found. Directories that
hold such files must be private (`check_private_dir`). Shared by the client (its
stack dump file), the daemon and the launcher; stdlib only.

Files in folders the user names and others may write (a Lightning ``exp_dir``, a
Trainer's ``output_dir`` and its ``checkpoint-N`` folders) follow one rule
(docs/reliability.md, "Security round 4"):

- a folder is used only where `shared_dir_problem` finds nothing: a directory (a
  symlink to one only where the link is ours or root's), owned by this user, and
  not writable by others unless its sticky bit is set (group-writable is allowed:
  a umask of 002 makes every folder so, and the file rules below hold there); a
  folder we create is made by us, mode 0700 (`make_dir`);
- a file is read only where `read_owned` / `load_json` find it a regular file
  (reached without following a symlink), owned by this user, writable by no one
  else, with one link, and not larger than asked; else `UnsafeFileError` names
  the reason and the caller ignores the file with one warning;
- a file is written through a fresh name created exclusively beside it (O_EXCL,
  O_NOFOLLOW; mode 0600 unless asked, less the umask) and renamed into place
  (`write_bytes_atomic`): a symlink planted at the name is replaced, never
  written through.
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


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2,
                      mode: int = 0o600) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same directory
    and a rename: a reader sees the old file or the new one, never half of one, and a
    symlink planted at ``path`` is replaced, not followed. No temporary file is left
    behind on failure."""
    import json  # here, not at the top: the training process imports this module for its stack dump

    write_bytes_atomic(path, (json.dumps(data, indent=indent) + "\n").encode(), mode=mode)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` through a fresh file beside it and a rename: a reader sees
    the old file or the whole new one, never a part. The fresh file is created exclusively
    (O_EXCL, O_NOFOLLOW: nothing planted at its random name is opened) with ``mode`` less
    the umask (0600 unless a reader of another user needs more, as node-exporter does), and
    the rename replaces whatever is at ``path`` (a planted symlink included) without
    following it."""
    import secrets

    target = Path(path)
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except FileExistsError:
            continue
        break
    else:
        raise UnsafeFileError(f"cannot create a fresh file beside {target}: 100 random names were taken")
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


# -- files in folders others may write (the module's docstring: the rule) -------------------
def _dir_stat(directory: str | os.PathLike[str]) -> tuple[os.stat_result | None, str | None]:
    """The folder's stat, following a symlink at its last component only where the link is
    ours or root's; or why it cannot be used."""
    try:
        st = os.lstat(directory)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, os.geteuid()):
                return None, f"{directory} is a symbolic link owned by uid {st.st_uid}, another user"
            st = os.stat(directory)
    except OSError as e:
        return None, f"cannot inspect {directory}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return None, f"{directory} is not a directory"
    return st, None


def shared_dir_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why our files may not be read from or written into ``directory``, or None if they
    may: it must be a directory owned by this user that others cannot write, or can only
    under the sticky bit (they may add files there but not rename or remove ours)."""
    st, problem = _dir_stat(directory)
    if st is None:
        return problem
    if st.st_uid != os.geteuid():
        return f"{directory} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        return (f"{directory} has mode {stat.S_IMODE(st.st_mode):04o}: any user can write there and "
                "replace our files (no sticky bit)")
    return None


def make_dir(directory: str | os.PathLike[str], *, private: bool = False) -> None:
    """Create ``directory`` (mode 0700; missing parents as the umask makes them), or adopt
    the one there if it passes `shared_dir_problem` (``private``: `private_dir_problem`,
    writable by no one else). UnsafeFileError names why one that is there is refused."""
    try:
        os.mkdir(directory, 0o700)
        return
    except FileNotFoundError:
        os.makedirs(Path(directory).parent, exist_ok=True)
        try:
            os.mkdir(directory, 0o700)
            return
        except FileExistsError:
            pass
    except FileExistsError:
        pass
    problem = (private_dir_problem if private else shared_dir_problem)(directory)
    if problem is not None:
        raise UnsafeFileError(f"refusing to use the folder {directory}: {problem}")


def read_owned(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole of ``path``, where it is a regular file (no symlink followed), owned by
    this user, writable by no one else, with one link (not another of our files hard-linked
    here by someone else), and at most ``limit`` bytes. FileNotFoundError where nothing is
    there; UnsafeFileError naming the reason for anything else."""
    fd = _open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o022:
            raise UnsafeFileError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users can write it")
        if st.st_nlink != 1:
            raise UnsafeFileError(f"{path} has {st.st_nlink} hard links: it may be another file of ours")
        if st.st_size > limit:
            raise UnsafeFileError(f"{path} holds {st.st_size} bytes, more than the {limit} expected")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise UnsafeFileError(f"{path} holds more than the {limit} bytes expected")
        return data
    finally:
        os.close(fd)


def load_json(path: str | os.PathLike[str], limit: int = 1 << 20) -> Any:
    """`read_owned`'s bytes as JSON. FileNotFoundError where nothing is there;
    UnsafeFileError naming the reason for a file that may not be read or is not JSON."""
    import json

    data = read_owned(path, limit)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UnsafeFileError(f"{path} is not JSON: {str(e)[:200]}") from e
