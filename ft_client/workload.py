"""Workload control requests: a rank asks the launcher to continue, drop this node, or stop.

Names follow nvidia-resiliency-ext (`WorkloadAction`, `WorkloadControlRequest`) so
code written for it keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ft_client.errors import RankMonitorClientError


class WorkloadActionError(RankMonitorClientError, ValueError):
    """A name that is not a workload action."""


class WorkloadAction(Enum):
    Continue = "Continue"
    """Nothing to do (acknowledged and logged)."""
    ExcludeThisNode = "ExcludeThisNode"
    """Stop this node's workers and leave the job; other nodes go on if the rendezvous allows."""
    ShutdownWorkload = "ShutdownWorkload"
    """Stop every node, with no further restarts."""

    @classmethod
    def parse(cls, value: WorkloadAction | str) -> WorkloadAction:
        if isinstance(value, WorkloadAction):
            return value
        for action in cls:
            if str(value).lower() == action.value.lower():
                return action
        raise WorkloadActionError(f"unknown workload action {value!r}: use one of {', '.join(a.value for a in cls)}")


@dataclass(frozen=True)
class WorkloadControlRequest:
    action: WorkloadAction
    description: str = ""


CONFIGURATION_ERROR = "ConfigurationError"
"""The launcher-only request a rank's own code sends (never a `WorkloadAction`: the reference has
none such) when it finds the job's configuration cannot work, before it raises: a configuration
error is not a fault, so ft-launcher stops the job at once with its configuration exit code (2)
instead of spending every restart on the same refusal."""
