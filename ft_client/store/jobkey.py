"""Where the keys that sign ft's store values come from (docs/protocol.md, "Keys").

* The job secret (``$FT_JOB_SECRET_FILE``, a 0600 file of this user's, or
  ``$FT_JOB_SECRET``): the same on every node, read by ft-launcher, which signs its own
  messages with it and removes it from the workers' environment. Workers get keys
  derived from it per purpose and run (`signed.derive_key`), never the secret.
* ``$FT_INPROCESS_KEY`` (64 hex digits): the in-process Wrapper's key, set by
  ft-launcher for its workers: derived from the job secret, or, without one on a
  single node, from a random key the launcher made at start, or, on several nodes
  under the static and c10d rendezvous, from the key the launchers agreed on through
  the rendezvous store (ft_monitor/launcher/store/agreed_key.py).
* Under plain torchrun (with or without ``ft-monitor serve``) or with no launcher: the
  Wrapper derives its key from the job secret in its environment, if any; else, on a
  single node, it uses a per-job random key in a 0600 file of a 0700 directory of this
  user's, made (exclusively) by the first local process of the job and read by the
  others; else (several nodes, no secret) it warns once, naming the fix, and signs with
  a key anyone can derive (values are still typed and bound, not authenticated).
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ft_client import logs
from ft_client.errors import FtError
from ft_client.safefiles import UnsafeFileError, read_bounded
from ft_client.store.signed import derive_key

log = logs.logger("ft_client.store.jobkey")

SECRET_ENV = "FT_JOB_SECRET"
SECRET_FILE_ENV = "FT_JOB_SECRET_FILE"
INPROCESS_KEY_ENV = "FT_INPROCESS_KEY"
KEY_DIR_ENV = "FT_KEY_DIR"
"""Where the per-job key files of single-node jobs go (default $XDG_RUNTIME_DIR/ft-keys, else /tmp/ft-keys-UID)."""
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
INPROCESS = "inprocess"
"""The purpose the in-process Wrapper's key is derived for."""
PUBLIC_SECRET = b"ft-monitor: no job secret configured"
"""What a multi-node job without a secret derives from: known to everyone (warned)."""


class SecretError(FtError, ValueError):
    """The job secret cannot be used (unreadable, too short, readable by others)."""


def load_job_secret(secret_file: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The job's secret: from ``secret_file`` (or $FT_JOB_SECRET_FILE), else $FT_JOB_SECRET;
    None when neither is set."""
    path = secret_file or environ.get(SECRET_FILE_ENV)
    if path:
        return secret_from(read_secret_file(path), f"job secret file {path}")
    if environ.get(SECRET_ENV):
        return secret_from(bytearray(environ[SECRET_ENV].encode()), f"${SECRET_ENV}")
    return None


def read_secret_file(path: str) -> bytearray:
    """The content of the job secret file ``path``: a regular file of this user's (not reached
    through a symlink) with no group or other permission bits. Read into a bytearray, so that
    the caller can overwrite it (`secret_from` does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SecretError(f"job secret file {path} is a symbolic link; refusing to follow it") from e
        raise SecretError(f"cannot read job secret file {path}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"job secret file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretError(f"job secret file {path} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()})")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"job secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users "
                              "could read it; chmod 600 it")
        if st.st_size > 2 * MAX_SECRET_BYTES:
            raise SecretError(f"job secret file {path} holds {st.st_size} bytes: a job secret must have "
                              f"{MIN_SECRET_BYTES} to {MAX_SECRET_BYTES}")
        buf = bytearray(st.st_size + 1)
        n = os.readv(fd, [buf])
    except OSError as e:
        raise SecretError(f"cannot read job secret file {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    del buf[n:]
    return buf


def secret_from(raw: bytearray, where: str) -> bytes:
    """The secret in ``raw`` (blanks stripped), checked for its length; ``raw`` is overwritten
    with zeros either way, so that the returned bytes are the one copy left."""
    try:
        start, end = 0, len(raw)
        while start < end and raw[start] in b" \t\r\n\v\f":
            start += 1
        while end > start and raw[end - 1] in b" \t\r\n\v\f":
            end -= 1
        if not MIN_SECRET_BYTES <= end - start <= MAX_SECRET_BYTES:
            raise SecretError(f"{where} holds {end - start} bytes: a job secret must have {MIN_SECRET_BYTES} to "
                              f"{MAX_SECRET_BYTES} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
        with memoryview(raw) as view:
            return bytes(view[start:end])
    finally:
        wipe(raw)


def wipe(buf: bytearray) -> None:
    """Overwrite ``buf`` with zeros, in place."""
    buf[:] = bytes(len(buf))


@dataclass(frozen=True)
class JobKey:
    """A key and where it came from (for the log and docs/protocol.md's table)."""

    key: bytes
    origin: str
    authenticated: bool = True
    """False: anyone can derive it (a multi-node job without a job secret)."""


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def single_node(environ: Mapping[str, str]) -> bool:
    """Whether every rank of the job runs on this host: torchrun's LOCAL_WORLD_SIZE covers
    WORLD_SIZE, or (without torchrun) the job meets at a loopback MASTER_ADDR."""
    world = _int(environ, "WORLD_SIZE", 1)
    if world <= 1:
        return True
    if "LOCAL_WORLD_SIZE" in environ:
        return _int(environ, "LOCAL_WORLD_SIZE", 0) >= world
    return _loopback(environ.get("MASTER_ADDR", "127.0.0.1"))


def job_identity(environ: Mapping[str, str]) -> str:
    """What tells this job from another of the same user on this host: the run id and
    where its ranks meet (two live jobs cannot share MASTER_ADDR:MASTER_PORT)."""
    return "|".join((environ.get("TORCHELASTIC_RUN_ID") or "local", environ.get("MASTER_ADDR") or "127.0.0.1",
                     environ.get("MASTER_PORT") or "29500"))


def key_dir(environ: Mapping[str, str]) -> Path:
    """A directory of this user's, mode 0700 (made if missing; refused if anyone else could
    read or write it, or if it is not a real directory of ours)."""
    configured = environ.get(KEY_DIR_ENV)
    if configured:
        path = Path(configured)
    elif environ.get("XDG_RUNTIME_DIR"):
        path = Path(environ["XDG_RUNTIME_DIR"]) / "ft-keys"
    else:
        path = Path(tempfile.gettempdir()) / f"ft-keys-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SecretError(f"cannot make the key directory {path}: {e.strerror or e}") from e
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SecretError(f"the key directory {path} must be a directory of this user's (uid {os.geteuid()}) with "
                          f"mode 0700 (found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
                          f"{', not a directory' if not stat.S_ISDIR(st.st_mode) else ''}); remove it or set "
                          f"${KEY_DIR_ENV}")
    return path


def local_job_key(directory: Path, identity: str) -> tuple[bytes, Path]:
    """The job's random key in ``directory``: made by the first local process that asks
    (written to a temporary file, then linked at its name: the link is exclusive and the file
    complete when it appears), read by the others."""
    path = directory / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.key"
    fd, tmp = tempfile.mkstemp(prefix=".new-", dir=directory)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process of the job made it first: use theirs
    finally:
        os.unlink(tmp)
    try:
        st = os.lstat(path)
        if st.st_mode & 0o077:
            raise SecretError(f"the job key file {path} has mode {stat.S_IMODE(st.st_mode):04o}; remove it")
        text = read_bounded(path, 65)
    except UnsafeFileError as e:
        raise SecretError(f"the job key file: {e}") from e
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise SecretError(f"the job key file {path} was removed while it was read") from e
        raise SecretError(f"cannot read the job key file {path}: {e.strerror or e}") from e
    key = _key_from_hex(text)
    if key is None:
        raise SecretError(f"the job key file {path} does not hold 64 hex digits; remove it")
    return key, path


def _key_from_hex(text: str) -> bytes | None:
    """The 32-byte key that ``text`` spells in 64 hex digits, or None."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        return None
    return key if len(key) == 32 else None


_warned: set[str] = set()


def inprocess_key(environ: Mapping[str, str], run_id: str) -> JobKey:
    """The key that signs the in-process Wrapper's store records of run ``run_id`` (the
    choice is described in the module's docstring)."""
    given = environ.get(INPROCESS_KEY_ENV)
    if given:
        key = _key_from_hex(given)
        if key is None:
            raise SecretError(f"${INPROCESS_KEY_ENV} must be 64 hex digits (ft-launcher sets it)")
        return JobKey(key, f"${INPROCESS_KEY_ENV} (set by ft-launcher)")
    secret = load_job_secret(None, environ)
    if secret is not None:
        return JobKey(derive_key(secret, INPROCESS, run_id), "derived from the job secret")
    if single_node(environ):
        key, path = local_job_key(key_dir(environ), job_identity(environ))
        return JobKey(derive_key(key, INPROCESS, run_id), f"the per-job key file {path}")
    if run_id not in _warned:
        _warned.add(run_id)
        log.warning("ft: a multi-node job without a job secret: the in-process restart's store records are signed "
                    "with a key anyone can derive, so anyone who reaches the store can forge a fault or a "
                    "completion; give every node the same secret with %s=/path/to/a/0600/file (or %s)",
                    SECRET_FILE_ENV, SECRET_ENV)
    return JobKey(derive_key(PUBLIC_SECRET, INPROCESS, run_id), "public (no job secret on a multi-node job)",
                  authenticated=False)


def launcher_inprocess_key(secret: bytes | None, local_key: bytes | None, run_id: str) -> str | None:
    """What ft-launcher puts in its workers' $FT_INPROCESS_KEY for run ``run_id``: derived
    from the job secret, else from the launcher's own random key (``local_key``, single
    node only), else None (the workers choose, and warn)."""
    base = secret if secret is not None else local_key
    return None if base is None else derive_key(base, INPROCESS, run_id).hex()
