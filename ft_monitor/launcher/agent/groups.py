"""The workers' process groups, pinned so that a recycled pid is never signalled.

torch starts every worker in its own session, so each worker leads a process
group holding its data-loader children. After torch stops the workers, whatever
is left in those groups is killed. A saved group id alone is not enough: once a
group is empty its id can be handed to an unrelated process that starts its own
session (on a busy node, during a long exit barrier), and `killpg` would kill it.
So each worker is pinned with a pidfd at start (it is our child and not yet
reaped, so its pid is surely the worker), its group's members are pinned while
the worker provably leads it, and a group is signalled only while one of those
pinned processes is still in it (`procinfo.PinnedGroup`). Once every pinned
process is gone, nothing is signalled.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

from ft_monitor.processes.procinfo import PinnedGroup, ProcessHandle


class WorkerGroups:
    def __init__(self) -> None:
        self._groups: list[PinnedGroup] = []

    def track(self, pids: Iterable[int]) -> None:
        """Pin new workers (call right after they are started, before any reaping)."""
        for pid in pids:
            leader = ProcessHandle.open(pid)
            if leader is None:
                continue
            group = PinnedGroup.of_leader(leader)
            if group is None:
                leader.close()
            else:
                self._groups.append(group)

    def pin_members(self) -> None:
        """Pin the processes now in the workers' groups (their children), while provably theirs."""
        for g in self._groups:
            g.pin_members()

    def kill(self) -> None:
        """SIGKILL what is left of every group, only where that is provably still the workers'."""
        for g in self._groups:
            g.send(signal.SIGKILL)

    def close(self) -> None:
        for g in self._groups:
            g.close()
        self._groups = []

    def __len__(self) -> int:
        return len(self._groups)
