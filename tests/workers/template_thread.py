"""A module that starts a thread when imported: preloaded, it makes the worker template
refuse to fork (tests/test_template.py). The thread names itself (PR_SET_NAME), as native
libraries' threads often do, so that the refusal can show its name."""

import ctypes
import threading

_stop = threading.Event()


def _run() -> None:
    ctypes.CDLL(None).prctl(15, b"preload-thread")  # PR_SET_NAME: /proc/self/task/N/comm
    _named.set()
    _stop.wait()


_named = threading.Event()
threading.Thread(target=_run, name="preload-thread", daemon=True).start()
_named.wait(10)
