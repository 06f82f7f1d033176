"""A rank's stack dump file, as the daemon keeps it: a header before each dump, no
header without a dump, no file without one.

The rank (its client, or before that the start-up hook) opens the file and registers
faulthandler on it, which writes from the signal handler, so nothing in the rank can
write a line before a dump. The daemon, which sends the dump signal, writes the header
just before it (`announce`), takes it back if nothing followed within the wait
(`take_back`), and removes a file that holds no dump once the rank is gone
(`remove_if_empty`). Best effort: a file that cannot be written or removed is logged,
never fatal.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
from pathlib import Path

from ft_client.safefiles import open_append

log = logging.getLogger("ft_monitor.executor")


def header(pid: int, sig: int, why: str) -> str:
    """The line before one dump, e.g. "# ft-monitor stack dump of pid 7 (signal SIGUSR2): hang"."""
    return f"# ft-monitor stack dump of pid {pid} (signal {signal.Signals(sig).name}): {why}\n"


def announce(path: Path, line: str) -> tuple[int, int] | None:
    """Append ``line`` to ``path``; the file's size before and after it, or None when it
    cannot be written (a symlink, another user's file, no space: the dump may still come)."""
    try:
        fd = open_append(path)
    except OSError as e:
        log.warning("cannot write the stack dump header to %s: %s", path, e)
        return None
    try:
        before = os.fstat(fd).st_size
        os.write(fd, line.encode())
        return before, os.fstat(fd).st_size
    except OSError as e:
        log.warning("cannot write the stack dump header to %s: %s", path, e)
        return None
    finally:
        os.close(fd)


def take_back(path: Path, span: tuple[int, int]) -> None:
    """Remove the header written at ``span`` when nothing followed it (the file still ends
    there); a dump that began meanwhile keeps it."""
    before, after = span
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        if os.fstat(fd).st_size == after:
            os.ftruncate(fd, before)
    except OSError as e:
        log.warning("cannot take back the stack dump header in %s: %s", path, e)
    finally:
        os.close(fd)


def remove_if_empty(path: Path) -> None:
    """Remove ``path`` if it is an empty regular file of ours (a rank that was never dumped)."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_uid == os.geteuid():
            os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as e:
        log.warning("cannot remove the empty stack dump file %s: %s", path, e)
