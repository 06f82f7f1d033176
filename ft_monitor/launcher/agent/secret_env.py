"""The job secret out of ft-launcher's environment before anything inherits it.

torch builds each worker's environment from a copy of the launcher's (`os.environ`), and a
worker forked from a template (the launcher's own fork, or one started with the launcher's
environment) shows the launcher's initial environment block in ``/proc/self/environ``: a
``$FT_JOB_SECRET`` given to ft-launcher reached every worker, where any library of the
training code could read it and forge the launchers' store messages. `take` removes the
secret (and the secret file's name) from ``os.environ`` and overwrites the value's bytes in
this process's initial environment block (what ``/proc/PID/environ`` shows, and what a fork
copies), once, at the start; the launcher keeps the values for itself (`taken`). Workers get
only the key derived for the in-process Wrapper (worker_env.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import MutableMapping

from ft_client.store.jobkey import SECRET_ENV, SECRET_FILE_ENV

log = logging.getLogger("ft_monitor.launcher")

_taken: dict[str, str] = {}


def take(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Remove the job secret and its file's name from ``environ`` (this process's by default);
    what was taken, kept for `taken`."""
    env = os.environ if environ is None else environ
    for name in (SECRET_ENV, SECRET_FILE_ENV):
        if name in env:
            _taken[name] = env.pop(name)
    if environ is None and SECRET_ENV in _taken:
        _scrub(SECRET_ENV)
    return dict(_taken)


def taken() -> dict[str, str]:
    return dict(_taken)


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
