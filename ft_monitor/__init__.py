"""ft_monitor: the per-rank monitor daemon (`ft-monitor serve`) and ft-launcher
(`ft_monitor.launcher`: torchrun with a monitor beside every rank).

The daemon never imports torch: it must start fast and stay small beside every rank.

The subpackages are rooms, each with one kind of job, and imports go one way, downwards
(docs/architecture.md draws them; tests/test_architecture.py checks them):

* `views`: what an operator reads (``ft-monitor report``, ``status --all``);
* `launcher`: ft-launcher, in the launcher's process;
* `daemon`: ``ft-monitor serve``, in each rank's monitor process;
* `forensics` and `processes`: the evidence of a hang, and processes seen, waited for and
  stopped, for the daemon and the launcher alike;
* `core`: the pure decisions and the typed messages, no I/O.

The modules at this level are the entry points and the public façade (`cli`, `config`,
`config_text`, `rank_monitor_server`, `testing`).

At package level, the names nvidia-resiliency-ext's ``fault_tolerance`` package exports
(see docs/migration.md), so ``import ft_monitor as fault_tolerance`` stands in for
``from nvidia_resiliency_ext import fault_tolerance``: `FaultToleranceConfig`,
`RankMonitorServer`, `RankMonitorClient`, `RankMonitorClientError`, `WorkloadAction`,
`WorkloadControlRequest`. They are loaded on first use: importing this package (as the
daemon does) loads neither pydantic nor the client.
"""

from typing import TYPE_CHECKING, Any

from ft_client.errors import FtError, RankMonitorClientError

if TYPE_CHECKING:
    from ft_client.client import RankMonitorClient as RankMonitorClient
    from ft_client.workload import WorkloadAction as WorkloadAction
    from ft_client.workload import WorkloadControlRequest as WorkloadControlRequest
    from ft_monitor.config import FaultToleranceConfig as FaultToleranceConfig
    from ft_monitor.rank_monitor_server import RankMonitorServer as RankMonitorServer

__all__ = [
    "FtError",
    "FaultToleranceConfig",
    "RankMonitorClient",
    "RankMonitorClientError",
    "RankMonitorServer",
    "WorkloadAction",
    "WorkloadControlRequest",
]

_LAZY = {
    "FaultToleranceConfig": "ft_monitor.config",
    "RankMonitorServer": "ft_monitor.rank_monitor_server",
    "RankMonitorClient": "ft_client.client",
    "WorkloadAction": "ft_client.workload",
    "WorkloadControlRequest": "ft_client.workload",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_monitor' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
