"""faulthandler's stack dumps, read (pure): threads, frames, where a rank is.

A rank's dump file (``rank<R>-pid<P>-stack.txt``) holds every dump its faulthandler
wrote on the dump signal, one after another; the monitor says which bytes the
latest one is (rank_snapshot.py). faulthandler's format (CPython 3.11)::

    Thread 0x00007f...  (most recent call first):
      File "/x/train.py", line 43 in write_metrics
      File "/x/train.py", line 97 in <module>

    Current thread 0x00007f... (most recent call first):
      ...

`parse()` reads it into `Thread`s of `Frame`s (innermost first); `main_thread()` picks
the one whose outermost frame is a module's top level; `where()` names the innermost
frame of the user's own code ("train.py:43 in write_metrics"); `in_collective()` says
whether a stack is inside torch.distributed (or in autograd's backward, where DDP
all-reduces), which is how ranks are told apart when no Flight Recorder trace says more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ft_client.collectives import waits_for_peers

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)[^\n]*\(most recent call first\):\s*$")
_STACK = re.compile(r"^Stack \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')
LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")
"""Paths of frames that are not the user's own code (installed packages, the standard library)."""
MAX_THREADS = 256
MAX_FRAMES = 200


@dataclass(frozen=True)
class Frame:
    file: str
    line: int | None
    func: str

    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line if self.line is not None else '?'} in {self.func}"

    @property
    def library(self) -> bool:
        return any(p in self.file for p in LIBRARY_PARTS)


@dataclass(frozen=True)
class Thread:
    ident: str
    current: bool
    """The thread the signal interrupted (faulthandler's "Current thread")."""
    frames: tuple[Frame, ...]
    """Innermost first."""


def parse(text: str) -> list[Thread]:
    """Every thread of the dump(s) in ``text``, in the order written (nothing raised on junk)."""
    threads: list[Thread] = []
    ident: str | None = None
    current = False
    frames: list[Frame] = []

    def close() -> None:
        if ident is not None and len(threads) < MAX_THREADS:
            threads.append(Thread(ident, current, tuple(frames[:MAX_FRAMES])))

    for line in text.splitlines():
        m = _THREAD.match(line)
        if m or _STACK.match(line):
            close()
            ident, current = (m.group(2), m.group(1) == "Current thread") if m else ("0x0", True)
            frames = []
            continue
        f = _FRAME.match(line)
        if f and ident is not None:
            frames.append(Frame(f.group(1), int(f.group(2)) if f.group(2).isdigit() else None, f.group(3).strip()))
    close()
    return threads


def main_thread(threads: list[Thread]) -> Thread | None:
    """The thread running the program's top level (outermost frame ``<module>``), else the
    interrupted one, else the first."""
    for t in threads:
        if t.frames and t.frames[-1].func == "<module>":
            return t
    for t in threads:
        if t.current:
            return t
    return threads[0] if threads else None


ASYNC_SAVE = "/torch/distributed/checkpoint/"
"""Where torch.distributed.checkpoint's code runs: a thread in it, beside a main thread that
waits on a future, is an async save's background work (``dcp.async_save``)."""
FUTURE_WAIT = "/concurrent/futures/_base.py"


def _waits_on_future(thread: Thread) -> bool:
    """The thread's innermost frames, the standard library's only, end in ``Future.result``."""
    inner = _beyond_stdlib(thread)
    stdlib = thread.frames[:thread.frames.index(inner)] if inner is not None else thread.frames
    return any(FUTURE_WAIT in f.file for f in stdlib)


def async_save_thread(threads: list[Thread]) -> Thread | None:
    """The background thread of an async checkpoint save that the main thread waits for (its
    ``future.result()``), where that is where the rank is; else None. A save whose writes
    hang leaves its rank's main thread in that wait, like every other rank's: the background
    threads tell which rank is behind (one in the storage writer, the others in the save's
    gather of the results)."""
    main = main_thread(threads)
    if main is None or not _waits_on_future(main):
        return None
    return next((t for t in threads if t is not main and any(ASYNC_SAVE in f.file for f in t.frames)), None)


def working_thread(threads: list[Thread]) -> Thread | None:
    """The thread that says where the rank is: the main thread, or the async save it waits for."""
    return async_save_thread(threads) or main_thread(threads)


def where(thread: Thread | None) -> str | None:
    """The innermost frame of the user's own code, e.g. ``train.py:43 in write_metrics``
    (the innermost frame of all when every frame is a library's)."""
    if thread is None or not thread.frames:
        return None
    for f in thread.frames:
        if not f.library:
            return f.short()
    return thread.frames[0].short()


def _beyond_stdlib(thread: Thread | None) -> Frame | None:
    """The thread's innermost frame that is not the standard library's (an installed package's
    or the user's), where it waits on what the standard library waits for."""
    if thread is None:
        return None
    return next((f for f in thread.frames if not f.library or "/site-packages/" in f.file
                 or "/dist-packages/" in f.file), None)


DATA_LOADER = "/torch/utils/data/dataloader.py"
"""Where a rank waits for its data-loader workers (``_try_get_data``: a queue read with a timeout)."""


def waits_for_data(thread: Thread | None) -> str | None:
    """Where the thread waits for a data-loader worker process (``dataloader.py:1291 in
    _try_get_data``): its innermost frame outside the standard library is the DataLoader's
    (a worker that hangs leaves its rank there, out of every collective); else None."""
    f = _beyond_stdlib(thread)
    return f.short() if f is not None and DATA_LOADER in f.file else None


def innermost(thread: Thread | None) -> str | None:
    return thread.frames[0].short() if thread is not None and thread.frames else None


def in_collective(thread: Thread | None) -> bool:
    """Inside torch.distributed (or autograd's backward or DDP, where gradients are all-reduced),
    judged by the innermost frames (`waits_for_peers`: frames are innermost first here)."""
    return thread is not None and waits_for_peers(f.file for f in thread.frames)


def collective_call(thread: Thread | None) -> str | None:
    """The torch.distributed function the thread is in (``all_reduce``), if any."""
    if thread is None:
        return None
    for f in thread.frames:  # the collective itself, where the thread waits (an async save's gather)
        if f.file.endswith("/torch/distributed/distributed_c10d.py") and not f.func.startswith("_"):
            return f.func
    for f in reversed(thread.frames):  # outermost first: the user's call into torch.distributed
        if "/torch/distributed/" in f.file and f.func not in ("wrapper", "<module>") and not f.func.startswith("_"):
            return f.func
    return "backward" if in_collective(thread) else None
