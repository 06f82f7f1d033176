"""ft_monitor: the per-rank monitor daemon (`ft-monitor serve`) and ft-launcher
(`ft_monitor.launcher`: torchrun with a monitor beside every rank).

The daemon never imports torch: it must start fast and stay small beside every rank.
docs/architecture.md says which module does what.
"""

from ft_client.errors import FtError

__all__ = ["FtError"]
