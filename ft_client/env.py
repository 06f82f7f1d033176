"""The environment-variable contract between launcher, daemon and client.

Every variable the three parts exchange is named here, once. Nothing else in the
project spells these names.
"""

from __future__ import annotations

import os

RANK_MONITOR_SOCKET = "FT_RANK_MONITOR_IPC_SOCKET"
"""Path of the rank's monitor daemon socket (set for each worker)."""
LAUNCHER_SOCKET = "FT_LAUNCHER_IPC_SOCKET"
"""Path of the launcher's socket, where daemons report hangs (set by ft-launcher)."""
LAUNCHER_PID = "FT_LAUNCHER_PID"
"""The launcher's pid: a worker started by it dies with it (parent-death signal)."""
INPROCESS_STORE = "FT_INPROCESS_STORE"
"""``host:port`` of the store the in-process Wrapper coordinates through: ft-launcher's
rendezvous store, which is already listening (a port derived from MASTER_PORT may not be free)."""
FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR = RANK_MONITOR_SOCKET
FT_LAUNCHER_IPC_SOCKET_ENV_VAR = LAUNCHER_SOCKET
"""The same two names as nvidia-resiliency-ext spells them (its ``fault_tolerance.data``)."""
CONFIG_ENV_PREFIX = "FT_"
"""`FT_<FIELD>` overrides a FaultToleranceConfig field (see ft_monitor.config)."""
# torchrun's own variables, read by the client to label its session.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torchelastic wants this worker's error.json; its directory is the attempt's per-rank directory."""


MAX_RANK = 2**31 - 1


def rank_from_env(default: int = 0) -> int:
    """The global rank torchrun gave this process, or ``default`` outside torchrun."""
    value = os.environ.get(RANK)
    if value is None:
        return default
    try:
        rank = int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {RANK}={value[:40]!r} is not an integer") from e
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"environment variable {RANK}={value[:40]!r} is out of range: a rank is 0..{MAX_RANK}")
    return rank
