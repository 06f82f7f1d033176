"""The process-group timeout, known in one place: for ``init_process_group(timeout=...)``.

torch times every collective (and ``init_process_group``'s rendezvous) with the timeout
given to ``init_process_group``. ft-monitor's launch check (ft_monitor/core/timeout_order.py)
must know it to tell whether a hung rank is caught before its peers time out, but the
call is inside the training script. So the value is a setting, ``process_group_timeout``
(YAML, ``FT_PROCESS_GROUP_TIMEOUT`` or ``--ft-process-group-timeout``): ft-launcher and
``ft-monitor serve -- CMD`` check it at launch and hand it to every worker in
``FT_PROCESS_GROUP_TIMEOUT``, and the script passes it on::

    import ft_client
    dist.init_process_group("nccl", timeout=ft_client.process_group_timeout())

Without the setting this returns ``default`` (None: torch's default for the backend, which
is what the launch check assumed). Stdlib only; torch is not imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from datetime import timedelta

from ft_client.errors import RankMonitorClientError

PROCESS_GROUP_TIMEOUT_ENV = "FT_PROCESS_GROUP_TIMEOUT"
"""Seconds; set for each worker by ft-launcher and `serve -- CMD` from process_group_timeout."""


def process_group_timeout(default: timedelta | None = None,
                          environ: Mapping[str, str] | None = None) -> timedelta | None:
    """The configured process-group timeout as a timedelta, or ``default`` when none is set.
    Raises RankMonitorClientError (a ValueError too) naming the variable when its value is
    not a number of seconds > 0."""
    text = (os.environ if environ is None else environ).get(PROCESS_GROUP_TIMEOUT_ENV)
    if text is None or not text.strip() or text.strip().lower() in ("none", "null", "off"):
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ProcessGroupTimeoutError(f"{PROCESS_GROUP_TIMEOUT_ENV}={text[:40]!r}: must be a number of seconds > 0")
    return timedelta(seconds=seconds)


class ProcessGroupTimeoutError(RankMonitorClientError, ValueError):
    """FT_PROCESS_GROUP_TIMEOUT holds something that is not a timeout."""
