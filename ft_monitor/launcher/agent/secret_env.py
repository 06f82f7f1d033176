"""The job secret: ft-launcher's alone, for one life (docs/launcher.md, "The job secret").

torch builds each worker's environment from a copy of the launcher's (`os.environ`), and a
worker forked from a template (the launcher's own fork, or one started with the launcher's
environment) shows the launcher's initial environment block in ``/proc/self/environ``. At the
launcher's start, before anything is forked or started, `take`:

* marks the launcher non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``): a process of the same user
  (a worker, or any library it loads) can no longer read its memory (``/proc/PID/mem``,
  ptrace: py-spy), its environment block or its descriptors; only root can. A child the
  launcher *execs* (a cold worker, a monitor) is dumpable again; the worker template *forked*
  from the launcher makes itself dumpable again once it has dropped the secret (`forget`), so
  that every worker's stacks can still be taken (py-spy, by the monitors);
* removes ``$FT_JOB_SECRET``, ``$FT_JOB_SECRET_FILE`` and ``$FT_JOB_SECRET_FILE_ONCE`` from
  ``os.environ`` (so from every child's environment), from Python's own copy of the initial
  environment (``posix.environ``, whose bytes object it overwrites), and overwrites the
  secret's and the file name's bytes in the initial environment block;
* keeps the value of ``$FT_JOB_SECRET`` in one bytearray, and the file's name.

`job_secret` then (in `main`, after the template is forked: the template never holds the
secret read from a file) gives the launcher the one bytes copy it signs with for the whole
run: read from the file (removed at once when ``$FT_JOB_SECRET_FILE_ONCE=1`` says it was made
for this launch alone, as the Slurm recipe does), or from the bytearray, which is overwritten.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import MutableMapping

from ft_client.store.jobkey import SECRET_ENV, SECRET_FILE_ENV, load_job_secret, read_secret_file, secret_from, wipe

log = logging.getLogger("ft_monitor.launcher")

SECRET_FILE_ONCE_ENV = "FT_JOB_SECRET_FILE_ONCE"
"""``1``: the file ``$FT_JOB_SECRET_FILE`` names was made for this launcher alone: it is
removed as soon as it is read (the Slurm recipe's per-node files)."""
_PR_SET_DUMPABLE = 4

_value = bytearray()
"""``$FT_JOB_SECRET``'s value, until `job_secret` or `forget` overwrites it."""
_file: dict[str, str] = {}
"""The names taken: ``$FT_JOB_SECRET_FILE`` and ``$FT_JOB_SECRET_FILE_ONCE``, if given."""


def take(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Take the job secret, its file's name and the file's once-flag out of ``environ`` (this
    process's by default, which is then also made non-dumpable); the names taken."""
    own = environ is None
    if own:
        set_dumpable(False)
    env = os.environ if environ is None else environ
    names = []
    if SECRET_ENV in env:
        names.append(SECRET_ENV)
        value = _pop(env, SECRET_ENV, own)
        _value[:] = value
        if own:
            _overwrite(value)
        del value
    for name in (SECRET_FILE_ENV, SECRET_FILE_ONCE_ENV):
        if name in env:
            names.append(name)
            _file[name] = os.fsdecode(_pop(env, name, own))
    if own:
        for name in (SECRET_ENV, SECRET_FILE_ENV):
            _scrub(name)
    return names


def job_secret(secret_file: str | None, environ: MutableMapping[str, str]) -> bytes | None:
    """The secret the launcher signs with (the one copy it keeps): from ``secret_file`` (the
    flag), else the file ``$FT_JOB_SECRET_FILE`` named, else ``$FT_JOB_SECRET``'s value (as
    `take` took them; from ``environ`` where `take` did not run); None without any. A file
    made for this launch (``$FT_JOB_SECRET_FILE_ONCE=1``) is removed, read or not. Raises
    `SecretError` (an `FtError`)."""
    if not _file and not _value:
        take(environ)
    path = _file.get(SECRET_FILE_ENV)
    try:
        if secret_file:
            return load_job_secret(secret_file, {})
        if path:
            return secret_from(read_secret_file(path), f"job secret file {path}")
        if _value:
            return secret_from(_value, f"${SECRET_ENV}")
        return None
    finally:
        wipe(_value)
        if path and _file.get(SECRET_FILE_ONCE_ENV) == "1":
            _remove(path)


def forget() -> None:
    """In a process forked from the launcher that must not keep the secret (the worker
    template): overwrite the taken value, and be dumpable again (its workers' stacks are
    taken with py-spy)."""
    wipe(_value)
    set_dumpable(True)


def set_dumpable(on: bool) -> None:
    """``prctl(PR_SET_DUMPABLE)``; a debug line where the kernel refuses."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        failed = prctl(_PR_SET_DUMPABLE, int(on), 0, 0, 0) != 0
    except (OSError, AttributeError) as e:
        log.debug("ft-launcher: prctl(PR_SET_DUMPABLE) unavailable: %s", e)
        return
    if failed:
        log.debug("ft-launcher: prctl(PR_SET_DUMPABLE, %d) refused: %s", int(on), os.strerror(ctypes.get_errno()))


def _pop(env: MutableMapping[str, str], name: str, own: bool) -> bytes:
    """``name``'s value as bytes, out of ``env`` and (for this process's environment) out of
    ``posix.environ`` too, without decoding it to a str that would stay in memory."""
    if not own:
        return env.pop(name).encode()
    key = os.fsencode(name)
    data = getattr(os.environ, "_data", None)
    value = data.pop(key, None) if isinstance(data, dict) else None
    os.unsetenv(name)
    if value is None:  # not the layout this knows: the plain way
        value = os.environ.pop(name).encode()
    original = getattr(sys.modules.get("posix"), "environ", {}).pop(key, None)
    if isinstance(original, bytes) and original is not value:
        _overwrite(original)
    return bytes(value)


def _overwrite(value: bytes) -> None:
    """Overwrite the bytes object ``value``, which nothing else refers to, in place (CPython's
    layout: its characters follow the object's header): a freed object's memory is not
    cleared, and this one held the secret. Never a shared object: the empty and one-byte
    objects are singletons, and one referred to elsewhere is left as it is."""
    if sys.implementation.name != "cpython" or len(value) < 2 or sys.getrefcount(value) > 3:
        return
    header = sys.getsizeof(b"") - 1
    ctypes.memset(id(value) + header, 0, len(value))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("ft-launcher: could not remove the job secret file %s ($%s=1): %s", path,
                    SECRET_FILE_ONCE_ENV, e.strerror or e)


def _scrub(name: str) -> None:
    """Overwrite ``name``'s value in the initial environment block with ``x`` (best effort: a
    kernel or layout this does not know leaves it as it was, said in a debug line)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51 of stat)
        if not 0 < start < end or end - start > 1 << 20:
            return
        block = ctypes.string_at(start, end - start)
        key = name.encode() + b"="
        at = 0
        while True:
            i = block.find(key, at)
            if i < 0:
                return
            if i == 0 or block[i - 1] == 0:  # a variable's start, not the middle of another's value
                value = i + len(key)
                stop = block.find(b"\0", value)
                stop = len(block) if stop < 0 else stop
                ctypes.memset(start + value, ord("x"), stop - value)
            at = i + len(key)
    except (OSError, ValueError, IndexError) as e:
        log.debug("ft-launcher: could not overwrite the job secret in the environment block: %s", e)
