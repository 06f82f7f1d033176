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

Names follow nvidia-resiliency-ext's fault_tolerance package: `TimeoutsCalc`,
`TimeoutsCalcError` and `SectionAction` are its calculator API (over our own
recorder), and `ft_monitor` holds its config and server. docs/migration.md maps
every name.
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
    "TimeoutsCalcError",
    "TimeoutsCalcNotReadyError",
    "SectionAction",
    "WorkloadAction",
    "WorkloadActionError",
    "WorkloadControlRequest",
    "HeartbeatTimeouts",
    "SectionTimeouts",
    "Timeouts",
    "process_group_timeout",
]


def __getattr__(name: str) -> Any:  # the client and the calculator are loaded on first use
    if name == "RankMonitorClient":
        from ft_client.client import RankMonitorClient

        return RankMonitorClient
    if name == "process_group_timeout":
        from ft_client.process_group import process_group_timeout

        return process_group_timeout
    if name == "NotEnoughDataError":
        from ft_client.learning.calc import NotEnoughDataError

        return NotEnoughDataError
    if name in ("TimeoutsCalc", "TimeoutsCalcError", "TimeoutsCalcNotReadyError", "SectionAction"):
        from ft_client.learning import compat as timeouts_calc_compat
        return getattr(timeouts_calc_compat, name)
    raise AttributeError(f"module 'ft_client' has no attribute {name!r}")
