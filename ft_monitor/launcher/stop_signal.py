"""The launcher's own stop (SIGTERM, SIGINT, SIGHUP, SIGQUIT) is never best effort's to swallow.

torch's launcher handler raises ``SignalException`` in the main thread wherever it happens
to be. The agent's best-effort steps (telemetry, the roll call, the cross-node exchanges)
catch ``Exception`` so that a store that went away never stops the job; a signal that
arrives inside one of them must still stop the launcher. Before, a SIGINT that came while
telemetry polled the monitors was logged as "telemetry failed" and the launcher ran on.
Torch-free: the modules that use it are imported by tools that never load torch.
"""

from __future__ import annotations

import sys

_TORCH_API = "torch.distributed.elastic.multiprocessing.api"


def is_stop(e: BaseException) -> bool:
    """Whether ``e`` is torch's SignalException (the launcher was told to stop)."""
    api = sys.modules.get(_TORCH_API)
    kind = getattr(api, "SignalException", None) if api is not None else None
    return isinstance(kind, type) and isinstance(e, kind)


def reraise_stop(e: BaseException) -> None:
    """Raise ``e`` again if it is the launcher's stop; in a best-effort ``except Exception``."""
    if is_stop(e):
        raise e
