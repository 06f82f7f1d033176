"""The client's timeouts: those in force (sent to the monitor, and which sections it must be
told about), learning them from what the run observed (a collective across ranks), and
keeping them in the checkpoint (`state_dict`, `load_state_dict`)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from ft_client import wire
from ft_client.client_state import SOCKET as _SOCKET
from ft_client.client_state import UNSENT as _UNSENT
from ft_client.client_state import ClientState, ConnState
from ft_client.errors import MonitorBrokenError, RankMonitorClientError
from ft_client.sync import max_across_ranks
from ft_client.timeouts import (
    WARMUP_SECTION,
    HeartbeatTimeouts,
    SectionTimeouts,
    Timeouts,
    TimeoutsError,
    section_needs_ipc,
)
from ft_client.timeouts_calc import (
    NotEnoughDataError,
    Observations,
    hb_not_ready,
    learn_hb_timeouts,
    learn_section_timeouts,
    sections_not_ready,
)
from ft_client.transport import TransportError

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
        return None if self._loaded is None else self._loaded.hb

    @property
    def loaded_section_timeouts(self) -> SectionTimeouts | None:
        """As `loaded_hb_timeouts`, for the section timeouts."""
        return None if self._loaded is None else self._loaded.sections

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
        obs = self._reduce_observations()
        reason = hb_not_ready(obs)
        if reason is not None:
            if skip_if_not_ready:
                return False
            raise NotEnoughDataError(reason)
        self._apply_learned(learn_hb_timeouts(self._timeouts, obs, self._safety_factor, self._min_learned))
        return True

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: list[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Learn section timeouts (all listed ones, or ``selected_sections``) and, with
        ``calc_out_of_section``, the out-of-section timeout. Collective, like
        calculate_and_set_hb_timeouts."""
        obs = self._reduce_observations()
        try:
            reason = sections_not_ready(self._timeouts, obs, selected_sections, calc_out_of_section)
        except ValueError as e:
            raise RankMonitorClientError(str(e)) from e
        if reason is not None:
            if skip_if_not_ready:
                return False
            raise NotEnoughDataError(reason)
        self._apply_learned(
            learn_section_timeouts(self._timeouts, obs, self._safety_factor, selected_sections, calc_out_of_section,
                                   self._min_learned)
        )
        return True

    def _reduce_observations(self) -> Observations:
        if not self.is_initialized:
            raise self._not_connected_error()
        with self._lock:
            vector = self._calc.export_vector(self._clock())
        reduced = max_across_ranks(vector)  # outside the lock: other threads keep reporting
        with self._lock:
            self._observed = self._calc.import_vector(reduced)
            return self._observed

    def _apply_learned(self, timeouts: Timeouts) -> None:
        if self._transport is None:  # monitor lost (and on_monitor_lost=warn): keep them locally
            self._set_timeouts(timeouts)
            return
        self.set_timeouts(timeouts)

    def state_dict(self) -> dict[str, Any]:
        """Learned timeouts and the observations behind them: plain JSON data, the same
        on every rank after a calculate_and_set_* call. Put it in the checkpoint."""
        from ft_client.state_dict import to_state_dict

        with self._lock:
            # every listed section appears (null until observed), so the layout is known
            # from the config alone: torch.distributed.checkpoint loads into this layout
            listed = {n: None for n in self._timeouts.rank_section_timeouts if n != WARMUP_SECTION}
            observed = replace(self._observed, sections={**listed, **self._observed.sections})
            return to_state_dict(self._timeouts, observed, self._safety_factor, self._iteration)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put learned timeouts from a checkpoint in force (before or after
        init_workload_monitoring()). Accepts this client's format and the
        ``{"current_timeouts": ...}`` dict of nvidia-resiliency-ext."""
        from ft_client.state_dict import from_state_dict, overlay_learned  # checkpoints only: loaded when used

        try:
            loaded = from_state_dict(state)
        except ValueError as e:
            raise RankMonitorClientError(f"cannot load the ft state_dict: {e}") from e
        with self._lock:
            self._loaded = loaded.timeouts
            self._observed = loaded.observations
            self._iteration = loaded.iteration
            if self._transport is None:
                if self._state is ConnState.LOST:
                    self._set_timeouts(overlay_learned(self._timeouts, loaded.timeouts))
                else:
                    self._to_load = loaded.timeouts
                return
            self.set_timeouts(overlay_learned(self._timeouts, loaded.timeouts))
