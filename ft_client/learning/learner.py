"""What one client learns its timeouts from, apart from the connection: the collaborator of
`RankMonitorClient` for the cold path of learning.

The client feeds a `TimeoutsRecorder` on every progress call (its hot path holds the recorder
itself: one attribute away). Everything else about learning is here and is called only from
``calculate_and_set_*``, ``state_dict`` and ``load_state_dict`` and at the handshake: the
observations all ranks agreed on, the monitor's safety factor and floor, the timeouts a
checkpoint held, and the rules that turn observations into timeouts. No lock, no socket and
no torch: the client calls it under its own lock, does the cross-rank reduction
(`ft_client.learning.sync`) and puts the result in force over its connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ft_client.learning.calc import (
    DEFAULT_SAFETY_FACTOR,
    Observations,
    TimeoutsRecorder,
    hb_not_ready,
    learn_hb_timeouts,
    learn_section_timeouts,
    sections_not_ready,
)
from ft_client.timeouts import WARMUP_SECTION, Timeouts


class Learner:
    """The learning's state of one client, and its decisions (pure: ``now`` and the current
    timeouts come in as arguments)."""

    __slots__ = ("observed", "safety_factor", "min_learned", "warmup_steps", "pending", "loaded")

    def __init__(self) -> None:
        self.observed = Observations()
        """As agreed by the last cross-rank reduction, or as a checkpoint held them."""
        self.safety_factor = DEFAULT_SAFETY_FACTOR
        self.min_learned = 0.0
        self.warmup_steps = 0
        """The monitor's warm-up length for this rank (its `num_warmup_iterations`)."""
        self.pending: Timeouts | None = None
        """Learned timeouts a checkpoint held, loaded before there was a monitor: put in force
        at the handshake."""
        self.loaded: Timeouts | None = None
        """What the last checkpoint held (None before one)."""

    def adopt(self, safety_factor: float, min_learned: float, warmup_steps: int = 0) -> None:
        """The monitor's settings for learning, from its session."""
        self.safety_factor, self.min_learned, self.warmup_steps = safety_factor, min_learned, warmup_steps

    def recorder(self, configured: Timeouts, now: float) -> TimeoutsRecorder:
        """A new recorder for the sections the monitor's config lists (the handshake), from ``now``.
        Where the config has a `warmup` entry, the first `warmup_steps` steps after each start
        (the handshake, an in-process re-entry) are timed by it and not learned from: a
        compiled model's first steps (torch.compile) take many times a step, and learning the
        step timeout from them would make it as long."""
        sections = configured.rank_section_timeouts
        recorder = TimeoutsRecorder((n for n in sections if n != WARMUP_SECTION), self.safety_factor,
                                    self.warmup_steps if WARMUP_SECTION in sections else 0)
        recorder.start(now)
        return recorder

    def agree(self, recorder: TimeoutsRecorder, reduced: Sequence[float]) -> Observations:
        """Take the element-wise MAX of every rank's observations as what was observed."""
        self.observed = recorder.import_vector(reduced)
        return self.observed

    def hb_timeouts(self, current: Timeouts) -> Timeouts | str:
        """The heartbeat timeouts learned from the agreed observations, or why there is not
        enough data."""
        reason = hb_not_ready(self.observed)
        if reason is not None:
            return reason
        return learn_hb_timeouts(current, self.observed, self.safety_factor, self.min_learned)

    def section_timeouts(self, current: Timeouts, selected: list[str] | None,
                         out_of_section: bool) -> Timeouts | str:
        """The section timeouts (all listed, or ``selected``) and, with ``out_of_section``, the
        out-of-section one, or why there is not enough data. ValueError: a selected section is
        not listed."""
        reason = sections_not_ready(current, self.observed, selected, out_of_section)
        if reason is not None:
            return reason
        return learn_section_timeouts(current, self.observed, self.safety_factor, selected, out_of_section,
                                      self.min_learned)

    def take_pending(self) -> tuple[Timeouts | None, str | None]:
        """The timeouts a checkpoint loaded before there was a monitor, for the handshake to
        put in force (None where there are none), or None and why not where a learned value
        is below the monitor's floor (``min_learned_timeout``, unknown when they were read)."""
        from ft_client.learning.state_dict import StateDictError, check_bounds

        loaded, self.pending = self.pending, None
        if loaded is not None:
            try:
                check_bounds(loaded, self.min_learned)
            except StateDictError as e:
                return None, str(e)
        return loaded, None

    def state_dict(self, current: Timeouts, iteration: int) -> dict[str, Any]:
        """The checkpoint's entry: every listed section appears (null until observed), so its
        layout is known from the config alone (torch.distributed.checkpoint loads into it)."""
        from ft_client.learning.state_dict import to_state_dict  # checkpoints only: loaded when used

        listed = {n: None for n in current.rank_section_timeouts if n != WARMUP_SECTION}
        observed = replace(self.observed, sections={**listed, **self.observed.sections})
        return to_state_dict(current, observed, self.safety_factor, iteration)

    def load(self, state: dict[str, Any]) -> tuple[Timeouts, int]:
        """Read a checkpoint's entry (ours or the reference's): its timeouts become `loaded`,
        its observations `observed`; returns both timeouts and iteration. ValueError: not a
        valid entry, or one whose learned values lie outside the bounds (`from_state_dict`;
        the floor is the monitor's ``min_learned_timeout`` once known)."""
        from ft_client.learning.state_dict import from_state_dict

        loaded = from_state_dict(state, floor=self.min_learned)
        self.loaded = loaded.timeouts
        self.observed = loaded.observations
        return loaded.timeouts, loaded.iteration
