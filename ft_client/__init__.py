"""ft_client: the SDK inside every training process.

Reports progress (heartbeats, named timed sections) to the rank's monitor daemon,
learns timeouts from what it observes, and keeps them in the checkpoint::

    from ft_client import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()           # connects to $FT_RANK_MONITOR_IPC_SOCKET
    client.load_state_dict(ckpt.get("ft", {}))  # learned timeouts from the last run
    for step in range(steps):
        with client.section("step"):
            train_step()
        client.send_heartbeat()
    client.calculate_and_set_section_timeouts()
    ckpt["ft"] = client.state_dict()

Importing this package is cheap: stdlib and msgpack only. torch is imported
lazily, for the cross-rank reduction of learned timeouts.
"""

from typing import Any

from ft_client.errors import FtError, MonitorBrokenError, MonitorClosedError, RankMonitorClientError
from ft_client.timeouts import HeartbeatTimeouts, SectionTimeouts, Timeouts, TimeoutsError
from ft_client.workload import WorkloadAction, WorkloadActionError, WorkloadControlRequest

__all__ = [
    "RankMonitorClient",
    "FtError",
    "RankMonitorClientError",
    "MonitorClosedError",
    "MonitorBrokenError",
    "NotEnoughDataError",
    "TimeoutsError",
    "TimeoutsCalc",
    "WorkloadAction",
    "WorkloadActionError",
    "WorkloadControlRequest",
    "HeartbeatTimeouts",
    "SectionTimeouts",
    "Timeouts",
]


def __getattr__(name: str) -> Any:  # the client and the calculator are loaded on first use
    if name == "RankMonitorClient":
        from ft_client.client import RankMonitorClient

        return RankMonitorClient
    if name in ("TimeoutsCalc", "NotEnoughDataError"):
        from ft_client import timeouts_calc

        return getattr(timeouts_calc, name)
    raise AttributeError(f"module 'ft_client' has no attribute {name!r}")
