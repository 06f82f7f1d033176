"""What every framework callback does with its sections: open each once, close it once,
heartbeats, and learning their timeouts, through the client it connected (None before the
framework's start and after its end, when every call here does nothing)."""

from __future__ import annotations

from collections.abc import Container

from ft_client.client import RankMonitorClient

SETUP, STEP, VALIDATION, CHECKPOINTING = "setup", "step", "validation", "checkpointing"
"""The sections the callbacks open (the monitor times those its config lists)."""


def sections_to_learn(listed: Container[str], resumed: bool) -> list[str]:
    """The callbacks' sections that the monitor's config lists, in their order; ``setup`` only
    in a run that resumed (a fresh start's is shorter than a resume's, the reference's rule too)."""
    return [s for s in (SETUP, STEP, VALIDATION, CHECKPOINTING) if s in listed and (s != SETUP or resumed)]


class OpenSections:
    """A callback's sections, kept so that a hook called twice (a nested save, a hook the
    framework calls again) opens or closes nothing twice."""

    client: RankMonitorClient | None
    sections: bool
    _open: set[str]
    _resumed: bool

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

    def _learn(self, final: bool) -> None:
        """The timeouts of what this run did so far (a collective: every rank calls it at the
        same step, at a checkpoint or at the end); ``final``: the out-of-section timeout too.
        A section that has not run yet (no evaluation, no save so far) leaves the others to be
        learned on their own."""
        client = self.client
        if client is None:
            return
        done = sections_to_learn(client.timeouts.rank_section_timeouts, self._resumed)
        if not self.sections or not done:
            client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
            return
        if client.calculate_and_set_section_timeouts(selected_sections=done, calc_out_of_section=final,
                                                     skip_if_not_ready=True):
            return
        observed = (client.state_dict().get("observations") or {}).get("sections") or {}
        ran = [s for s in done if observed.get(s) is not None]  # agreed by every rank: the same list
        if ran and ran != done:
            client.calculate_and_set_section_timeouts(selected_sections=ran, calc_out_of_section=final,
                                                      skip_if_not_ready=True)
