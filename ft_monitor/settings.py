"""The daemon's view of a validated config, without pydantic.

`ft-monitor serve` validates its config with pydantic (ft_monitor.config) in a
short-lived helper process and runs the daemon from the result, so the daemon
itself never imports pydantic or yaml (they would double its memory: DESIGN's
30 MB target). `Settings` carries exactly the fields of FaultToleranceConfig
(as `model_dump(mode="json")` wrote them) as attributes.
"""

from __future__ import annotations

import signal
from typing import Any

from ft_client.timeouts import Timeouts

_SIGNAL_FIELDS = ("rank_termination_signal", "stack_dump_signal")


class Settings:
    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__.update(data)
        for name in _SIGNAL_FIELDS:
            setattr(self, name, signal.Signals(data[name]))

    def __getattr__(self, name: str) -> Any:  # only reached for a name the config does not have
        raise AttributeError(f"no setting {name!r}")

    def timeouts(self) -> Timeouts:
        return Timeouts.from_config(self)
