"""The client's timeouts: those in force (sent to the monitor, and which sections it must be
told about), learning them from what the run observed (a collective across ranks), and
keeping them in the checkpoint (`state_dict`, `load_state_dict`).

The timeouts in force stay a part of the client (a mixin, see `ft_client.client.state`): putting
new ones in force re-routes the open sections, which are the hot path's. Learning them is a
collaborator's job, `ft_client.learning.learner.Learner` (the agreed observations, the
monitor's factor and floor, a checkpoint's timeouts, the rules): this part takes the lock, does
the cross-rank reduction and talks to the monitor, and asks the learner for the rest."""

from __future__ import annotations

import time
from typing import Any

from ft_client import wire
from ft_client.client.state import SOCKET as _SOCKET
from ft_client.client.state import UNSENT as _UNSENT
from ft_client.client.state import ClientState, ConnState
from ft_client.errors import MonitorBrokenError, RankMonitorClientError
from ft_client.learning.calc import NotEnoughDataError
from ft_client.learning.sync import max_across_ranks
from ft_client.timeouts import (
    HeartbeatTimeouts,
    SectionTimeouts,
    Timeouts,
    TimeoutsError,
    section_needs_ipc,
)
from ft_client.wire.transport import TransportError

_now_ns = time.monotonic_ns


class ClientLearning(ClientState):
    """`RankMonitorClient`'s timeouts, learned timeouts and state dict."""

    # -- timeouts --------------------------------------------------------------
    @property
    def hb_timeouts(self) -> HeartbeatTimeouts:
        return self._timeouts.hb

    @property
    def section_timeouts(self) -> SectionTimeouts:
        return self._timeouts.sections

    @property
    def loaded_hb_timeouts(self) -> HeartbeatTimeouts | None:
        """The heartbeat timeouts the last `load_state_dict()` read (None before one); in
        force once there is a monitor (`hb_timeouts`)."""
        loaded = self._learner.loaded
        return None if loaded is None else loaded.hb

    @property
    def loaded_section_timeouts(self) -> SectionTimeouts | None:
        """As `loaded_hb_timeouts`, for the section timeouts."""
        loaded = self._learner.loaded
        return None if loaded is None else loaded.sections

    @property
    def timeouts(self) -> Timeouts:
        """Every timeout in force, with which were learned."""
        return self._timeouts

    def set_timeouts(self, timeouts: Timeouts) -> Timeouts:
        """Put ``timeouts`` in force in the monitor (request/reply); returns what the monitor holds."""
        with self._lock:
            t = self._transport
            if t is None:
                raise self._not_connected_error()
            try:
                reply = t.request(wire.UpdateConfig(timeouts.to_wire()))
            except TransportError as e:
                self._lost(e, raising=False)
                raise MonitorBrokenError(f"cannot update timeouts: {e}") from e
            if isinstance(reply, wire.Error):
                raise RankMonitorClientError(f"monitor rejected the timeouts ({reply.code}): {reply.message}")
            if not isinstance(reply, wire.ConfigOk):
                raise RankMonitorClientError(f"monitor answered UPDATE_CONFIG with {type(reply).__name__}")
            try:
                self._set_timeouts(Timeouts.from_wire(reply.timeouts))
            except TimeoutsError as e:
                raise RankMonitorClientError(f"monitor sent invalid timeouts: {e}") from e
            return self._timeouts

    def _set_timeouts(self, timeouts: Timeouts) -> None:
        """Adopt new timeouts; tell the monitor about open sections it now needs to know
        (opened now, as far as it can tell)."""
        self._timeouts = timeouts
        self._ipc = frozenset(n for n in timeouts.rank_section_timeouts if section_needs_ipc(n, timeouts))
        for name, route in list(self._open.items()):
            t = self._transport
            if route != _UNSENT or name not in self._ipc or t is None:
                continue
            rec = self._record
            slot = self._slots.get(name) if rec is not None else None
            if rec is not None and slot is None:
                slot = self._register_slot(name)
            if rec is not None and slot is not None and self._record is rec:
                self._open[name] = slot
                rec.open_word(slot, _now_ns())
            else:
                self._open[name] = _SOCKET
                self._event(t, wire.section_open_frame(name))

    # -- learned timeouts ------------------------------------------------------
    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Learn the heartbeat timeouts from what this run observed and put them in force.

        A collective when torch.distributed is initialized: every rank must call
        it, and all end with the same timeouts (element-wise MAX over ranks).
        Returns False when there is not enough data and ``skip_if_not_ready``;
        otherwise raises NotEnoughDataError saying what is missing.
        """
        self._reduce_observations()
        with self._lock:
            learned = self._learner.hb_timeouts(self._timeouts)
        return self._apply_learned(learned, skip_if_not_ready)

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: list[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Learn section timeouts (all listed ones, or ``selected_sections``) and, with
        ``calc_out_of_section``, the out-of-section timeout. Collective, like
        calculate_and_set_hb_timeouts."""
        self._reduce_observations()
        with self._lock:
            try:
                learned = self._learner.section_timeouts(self._timeouts, selected_sections, calc_out_of_section)
            except ValueError as e:
                raise RankMonitorClientError(str(e)) from e
        return self._apply_learned(learned, skip_if_not_ready)

    def _reduce_observations(self) -> None:
        if not self.is_initialized:
            raise self._not_connected_error()
        with self._lock:
            recorder = self._calc
            vector = recorder.export_vector(self._clock())
        reduced = max_across_ranks(vector)  # outside the lock: other threads keep reporting
        with self._lock:
            self._learner.agree(recorder, reduced)

    def _apply_learned(self, learned: Timeouts | str, skip_if_not_ready: bool) -> bool:
        if isinstance(learned, str):  # not enough data: why
            if skip_if_not_ready:
                return False
            raise NotEnoughDataError(learned)
        if self._transport is None:  # monitor lost (and on_monitor_lost=warn): keep them locally
            with self._lock:
                self._set_timeouts(learned)
        else:
            self.set_timeouts(learned)
        return True

    def state_dict(self) -> dict[str, Any]:
        """Learned timeouts and the observations behind them: plain JSON data, the same
        on every rank after a calculate_and_set_* call. Put it in the checkpoint."""
        with self._lock:
            return self._learner.state_dict(self._timeouts, self._iteration)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put learned timeouts from a checkpoint in force (before or after
        init_workload_monitoring()). Accepts this client's format and the
        ``{"current_timeouts": ...}`` dict of nvidia-resiliency-ext."""
        from ft_client.learning.state_dict import overlay_learned  # checkpoints only: loaded when used

        with self._lock:
            try:
                loaded, self._iteration = self._learner.load(state)
            except ValueError as e:
                raise RankMonitorClientError(f"cannot load the ft state_dict: {e}") from e
            if self._transport is None:
                if self._state is ConnState.LOST:
                    self._set_timeouts(overlay_learned(self._timeouts, loaded))
                else:
                    self._learner.pending = loaded
                return
            self.set_timeouts(overlay_learned(self._timeouts, loaded))
