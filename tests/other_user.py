"""Running a program as another local user (uid 65534) from any checkout, a private one too.

The tests that play an attacker run a worker program (tests/workers/) as uid 65534 through
`setpriv`, with this checkout's interpreter and virtual environment. From a clone in a folder
others cannot enter (mode 0700: `mktemp -d`, a home folder, /root), that user could reach
neither the program nor the environment, and those tests failed (issue 50). `command` wraps
the program so that, in a mount namespace of its own (`unshare -m`, as root), every folder on
the way to the checkout and to the interpreter that others cannot pass through is covered by
a fresh folder others may pass through (a tmpfs, mode 0755) holding the same entries, each
bound back from the original: the same paths lead to the same files, whose own modes still
apply, and nothing changes outside that namespace. Where nothing is in the way, the program
runs through `setpriv` alone, as before.
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

NOBODY = 65534
"""The other local user (nobody)."""

ROOT = Path(__file__).resolve().parents[1]


def blocked_folders(paths: list[Path]) -> list[Path]:
    """The folders on the way to ``paths`` (themselves included) that others cannot pass
    through (no execute bit for others), outermost first, each once."""
    out: list[Path] = []
    for p in paths:
        for folder in [*reversed(p.parents), p]:
            try:
                mode = folder.stat().st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH and folder not in out:
                out.append(folder)
    return sorted(out, key=lambda f: len(f.parts))


def _cover(folder: Path) -> list[str]:
    """Shell lines that cover ``folder`` with a tmpfs others may pass through, holding its
    entries bound back from the original (symbolic links made again)."""
    q = shlex.quote(str(folder))
    lines = ['h=$(mktemp -d /tmp/.ft-other-user.XXXXXX)', f"mount --bind {q} \"$h\"",
             f"mount -t tmpfs -o mode=0755 ft-other-user {q}"]
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        target = shlex.quote(str(folder / entry.name))
        held = f"\"$h\"/{shlex.quote(entry.name)}"
        if entry.is_symlink():
            lines.append(f"ln -s {shlex.quote(os.readlink(entry.path))} {target}")
        elif entry.is_dir(follow_symlinks=False):
            lines += [f"mkdir {target}", f"mount --bind {held} {target}"]
        elif entry.is_file(follow_symlinks=False):
            lines += [f": > {target}", f"mount --bind {held} {target}"]
    lines += ['umount -l "$h"', 'rmdir "$h"']
    return lines


def command(argv: list[str]) -> list[str]:
    """``argv`` (a program of this checkout, run with this interpreter) as uid 65534: through
    `setpriv`, and where a folder on the way to the checkout or the interpreter is closed to
    others, inside a mount namespace that opens the way (module docstring). Only as root."""
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    needed = [ROOT, Path(sys.prefix), Path(sys.executable).parent, Path(os.path.realpath(sys.executable)).parent]
    blocked = blocked_folders(needed)
    if not blocked:
        return as_nobody
    script = ["set -e"]
    for folder in blocked:
        script += _cover(folder)
    script.append("exec " + shlex.join(as_nobody))
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(script)]
