"""What every framework callback does with its sections: open each once, close it once, and
heartbeats, through the client it connected (None before the framework's start and after
its end, when every call here does nothing)."""

from __future__ import annotations

from ft_client.client import RankMonitorClient


class OpenSections:
    """A callback's sections, kept so that a hook called twice (a nested save, a hook the
    framework calls again) opens or closes nothing twice."""

    client: RankMonitorClient | None
    _open: set[str]

    def _start(self, name: str) -> None:
        if self.client is not None and name not in self._open:
            self._open.add(name)
            self.client.start_section(name)

    def _end(self, name: str) -> None:
        if self.client is not None and name in self._open:
            self._open.discard(name)
            self.client.end_section(name)

    def _abandon(self) -> None:
        """Close every open section without counting them as completed (a step cut short)."""
        if self.client is not None and self._open:
            self._open.clear()
            self.client.end_all_sections()

    def _beat(self) -> None:
        if self.client is not None:
            self.client.send_heartbeat()
