"""Dying with one's parent (Linux PR_SET_PDEATHSIG), for processes started by ft-launcher.

Used by the launcher for its monitor daemons and by the client for workers: when
the launcher is killed outright, neither should outlive it.
"""

from __future__ import annotations

import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` when the parent exits; False where unsupported."""
    import ctypes  # here, not at import: the client's import stays light

    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) == 0)
    except (OSError, AttributeError):
        return False
