"""Tell ft-launcher which top-level modules this worker has loaded (``--ft-preload auto``).

With ``--ft-warm-restart --ft-preload auto`` the launcher names a file in each worker's
environment (``FT_WORKER_MODULES_FILE``); `report` writes there, once, when the worker
starts monitoring, the top-level names of ``sys.modules`` (``torch``, ``numpy``, the
script's own packages...). The launcher's worker template imports them before it forks the
next attempt's workers. Without the variable this does nothing.
"""

from __future__ import annotations

import json
import os
import sys

MODULES_FILE_ENV = "FT_WORKER_MODULES_FILE"


def top_level_modules() -> list[str]:
    """The loaded top-level modules, private and ``__main__`` left out, sorted."""
    names = {name.partition(".")[0] for name in list(sys.modules)}
    return sorted(n for n in names if n.isidentifier() and not n.startswith("_"))


def report() -> None:
    """Write `top_level_modules` to ``$FT_WORKER_MODULES_FILE`` (atomically); errors are ignored:
    the launcher then preloads what it was told to."""
    path = os.environ.get(MODULES_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(top_level_modules(), f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
