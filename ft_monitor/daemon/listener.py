"""Creating the daemon's listening Unix socket, safely.

Owns the checks made once at start: the path fits AF_UNIX, the directory is
private (mode 0700, ours; created so if missing, never directly under the root: a path
written as ``$XDG_RUNTIME_DIR/ft/...`` with the variable unset) and writable, nothing live
already serves the path, a stale socket file is replaced, and a symlink or a
non-socket file at the path is refused rather than followed or clobbered. The
socket file is made mode 0600. Each failure is a `ListenerError` whose message
says what is wrong and what to do.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from ft_client.errors import FtError

AF_UNIX_PATH_MAX = 107
"""sun_path is 108 bytes on Linux, one of them the terminating NUL."""
PRIVATE_DIR_HINT = ("use a private directory: $XDG_RUNTIME_DIR/ft/rank0.sock where $XDG_RUNTIME_DIR is set "
                    "(it is the user's own, mode 0700), else a directory of your own such as ~/.ft/rank0.sock")


class ListenerError(FtError, RuntimeError):
    pass


def _first_missing(directory: Path) -> Path:
    """The outermost directory of ``directory``'s that does not exist (the first mkdir would make)."""
    missing = directory
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    return missing


def _check_dir(directory: Path) -> None:
    if not directory.exists():
        top = _first_missing(directory)
        if top.parent == Path(top.anchor):
            raise ListenerError(
                f"socket directory {directory} does not exist and would be created at the file-system root "
                f"({top}); refusing: was it written as $XDG_RUNTIME_DIR{directory}/... with XDG_RUNTIME_DIR "
                "unset? Set XDG_RUNTIME_DIR (systemd-logind sets it to /run/user/$UID, private to you), or use "
                "a directory of your own such as ~/.ft/rank0.sock"
            )
        try:
            directory.mkdir(mode=0o700, parents=True)
        except OSError as e:
            raise ListenerError(f"cannot create socket directory {directory}: {e.strerror}") from e
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
        return
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ListenerError(f"socket directory {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise ListenerError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
            + PRIVATE_DIR_HINT
        )
    if st.st_mode & 0o077:
        raise ListenerError(
            f"socket directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 so that "
            "no other user can reach the socket (or chmod 700 it); " + PRIVATE_DIR_HINT
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ListenerError(f"socket directory {directory} is not writable by this user")


def _clear_stale(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ListenerError(f"{path} is a symbolic link; refusing to follow it. Remove it or choose another path")
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenerError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nothing listens
        return
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            os.unlink(path)
            return
        raise ListenerError(f"cannot tell whether {path} is in use: {e}") from e
    finally:
        probe.close()
    raise ListenerError(f"another daemon is already serving {path}; stop it or choose another path")


def check_socket_path(path: str | os.PathLike[str]) -> Path:
    """Every check `bind_unix_listener` makes before binding (a stale socket file is
    removed); returns the absolute path. Lets a program that starts a daemon refuse a bad
    path with the reason, before the daemon process exists."""
    p = Path(path).absolute()
    size = len(os.fsencode(str(p)))
    if size > AF_UNIX_PATH_MAX:
        raise ListenerError(
            f"socket path {p} is {size} bytes; Unix sockets allow at most {AF_UNIX_PATH_MAX}. "
            "Use a shorter directory, e.g. $XDG_RUNTIME_DIR/ft/"
        )
    _check_dir(p.parent)
    _clear_stale(p)
    return p


def bind_unix_listener(path: str | os.PathLike[str], backlog: int = socket.SOMAXCONN) -> tuple[socket.socket, int]:
    """Bind and listen on ``path``; return the socket and the socket file's inode."""
    p = check_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(p))
        finally:
            os.umask(old_umask)
        os.chmod(p, 0o600)
        sock.listen(backlog)
        sock.setblocking(False)
        return sock, os.lstat(p).st_ino
    except OSError as e:
        sock.close()
        raise ListenerError(f"cannot listen on {p}: {e.strerror or e}") from e


def remove_socket_file(path: str | os.PathLike[str], inode: int) -> bool:
    """Remove the socket file if it is still the one we bound (not a replacement)."""
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
            return True
    except FileNotFoundError:
        pass
    return False
