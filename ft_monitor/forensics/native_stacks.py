"""Native stacks of a rank with py-spy (``py-spy dump --native``), when installed and allowed.

A rank stuck in C with the GIL held shows only its Python frames in faulthandler's
dump; py-spy reads the native frames too. It is optional: not a dependency of
ft-monitor (``pip install py-spy``, or the ``native`` extra), used only with
``native_stacks: true``, and never required: when it is not on PATH, is not allowed
to attach (ptrace: ``kernel.yama.ptrace_scope`` >= 1 lets only an ancestor or a
process with CAP_SYS_PTRACE attach, and the monitor is not the rank's ancestor under
ft-launcher), or does not finish in time, the roll call notes why and goes on.
py-spy stops the rank while it reads it (ptrace), for up to the time left of the roll call.

`PySpy` is the real one; the monitor takes any `NativeStacks` (tests pass a fake).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from typing import Protocol

MAX_OUTPUT = 256 * 1024


class NativeStacks(Protocol):
    async def dump(self, pid: int, timeout: float) -> tuple[str | None, str | None]:
        """(the stacks as text, None), or (None, why there are none)."""
        ...


class PySpy:
    def __init__(self, executable: str | None = None) -> None:
        self.executable = executable

    def find(self) -> str | None:
        """The one given, else py-spy on PATH, else beside this interpreter (a virtualenv's bin)."""
        return self.executable or shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))

    async def dump(self, pid: int, timeout: float) -> tuple[str | None, str | None]:
        exe = self.find()
        if exe is None:
            return None, "py-spy is not installed (pip install py-spy)"
        if timeout <= 0:
            return None, "no time left in the roll call for py-spy"
        try:
            proc = await asyncio.create_subprocess_exec(exe, "dump", "--native", "--pid", str(pid),
                                                        stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            return None, f"cannot run {exe}: {e.strerror or e}"
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return None, f"py-spy did not finish within {timeout:.1f}s"
        if proc.returncode != 0:
            why = err.decode(errors="replace").strip().splitlines()
            return None, f"py-spy failed ({proc.returncode}): {why[-1][:300] if why else 'no message'}"
        return out[:MAX_OUTPUT].decode(errors="replace"), None
