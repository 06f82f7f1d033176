"""Tell ft-launcher which modules this worker has loaded (``--ft-preload auto``).

With ``--ft-warm-restart --ft-preload auto`` the launcher names a file in each worker's
environment (``FT_WORKER_MODULES_FILE``); `report` writes there, once, when the worker
starts monitoring, the names of ``sys.modules``: every module, submodules included
(``torch._dynamo``, which DDP imports lazily and which costs 2-3 s, is not imported by
``import torch``). The launcher's worker template imports them before it forks the
next attempt's workers. Without the variable this does nothing.
"""

from __future__ import annotations

import os
import sys

from ft_client.safefiles import write_json_atomic

MODULES_FILE_ENV = "FT_WORKER_MODULES_FILE"


def loaded_modules() -> list[str]:
    """Every loaded module's name but the script's own (``__main__``), sorted."""
    return sorted(n for n in list(sys.modules)
                  if n not in ("__main__", "__mp_main__") and all(p.isidentifier() for p in n.split(".")))


def report() -> None:
    """Write `loaded_modules` to ``$FT_WORKER_MODULES_FILE`` (atomically); errors are ignored:
    the launcher then preloads what it was told to."""
    path = os.environ.get(MODULES_FILE_ENV)
    if not path:
        return
    try:  # a fresh file renamed into place: nothing planted at a name beside it is opened
        write_json_atomic(path, loaded_modules(), indent=None)
    except OSError:
        pass
