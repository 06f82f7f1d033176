"""nvidia-resiliency-ext's rules for when its Lightning callbacks (``ptl_resiliency``) learn
timeouts, which our classes under their names follow (pure: counters in, decisions out).

Why these rules and not ours (`FtCallback` learns after every checkpoint): a job moving over
with an import change must see its timeouts learned when the reference learned them, and
its own tests count the updates. What each rule guards against is said where it is.

- heartbeats (`FaultToleranceCallback`): `may_update_hb_timeouts`, with `HeartbeatCount`;
- sections (`FaultToleranceSectionsCallback`): `update_due_after_save`, `plan_section_update`
  and `config_problem`.

Imports nothing but the section names; must stay free of I/O, Lightning and the client.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ft_client.integrations.sections import CHECKPOINTING, SETUP, STEP

MIN_ITERATIONS_FOR_HB_UPDATE = 2
"""Training iterations a run needs before its heartbeat timeouts are learned."""
MIN_ITERATIONS_FOR_STEP_UPDATE = 16
"""The ``step`` timeout is learned only after more than this many training iterations (the first
ones are slow: allocation, warm-up, compilation)."""
REFERENCE_SECTIONS = frozenset({SETUP, STEP, CHECKPOINTING})
"""What the sections callback times; the monitor's config must list exactly these."""


def is_clean_exit(exception: BaseException | None) -> bool:
    """No exception, or ``sys.exit(0)`` (a scheduler's preemption handler stopping the run on
    purpose): what was observed is a normal run's, so it may be learned from."""
    return exception is None or (isinstance(exception, SystemExit) and not exception.code)


# -- heartbeats ------------------------------------------------------------------------------
@dataclass
class HeartbeatCount:
    """The heartbeats of one fit, and whether a checkpoint save fell between two of them: a save
    makes the longest gap, and a heartbeat timeout learned without one would trip on the next."""

    sent: int = 0
    at_last_save: int | None = None
    save_between: bool = False

    def beat(self) -> None:
        self.sent += 1
        if self.at_last_save is not None and self.at_last_save > 0 and self.sent > self.at_last_save:
            self.save_between = True  # latched: once seen, the run has it

    def save(self) -> None:
        self.at_last_save = self.sent


def may_update_hb_timeouts(*, updated: bool, iterations: int, failed: bool, loaded_checkpoint: bool,
                           save_between_heartbeats: bool) -> bool:
    """Whether the heartbeat timeouts may be learned now (at the end of a run, or at a clean
    exit): at most once a run; after ``MIN_ITERATIONS_FOR_HB_UPDATE`` training iterations; never
    after a failure (its gaps are the fault's); and only in a run that loaded a checkpoint and
    saved one between heartbeats, the two longest gaps a run has. A fresh run learns nothing."""
    return (not updated and iterations >= MIN_ITERATIONS_FOR_HB_UPDATE and not failed
            and loaded_checkpoint and save_between_heartbeats)


# -- sections --------------------------------------------------------------------------------
def update_due_after_save(last_update_step: int, last_save_step: int) -> bool:
    """A save at a later step than the last update: learn at the next training batch's end (the
    save's section has closed by then, and every rank saved at the same step)."""
    return last_update_step < last_save_step


@dataclass(frozen=True)
class SectionUpdate:
    """What to learn now: ``sections`` (in order) and the out-of-section timeout or not, and
    ``notes``, the reference's lines saying what was left out and why."""

    sections: tuple[str, ...] = ()
    out_of_section: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def is_empty(self) -> bool:
        return not self.sections and not self.out_of_section


def plan_section_update(*, failed: bool, loaded_checkpoint: bool, iterations: int, last_save_step: int,
                        async_checkpointing: bool, final: bool) -> SectionUpdate:
    """The sections the sections callback may learn now, and whether the out-of-section timeout.

    ``setup`` only in a run that loaded a checkpoint (a fresh start's setup is shorter than a
    resume's); ``step`` only after more than ``MIN_ITERATIONS_FOR_STEP_UPDATE`` iterations;
    ``checkpointing`` only once a save was made at a step > 0 and not with asynchronous
    checkpointing (its sections vary too much between runs); the out-of-section timeout only at
    the ``final`` update of a run that learns ``setup`` and ``step`` and saved (it must have seen
    every section). Nothing after a failure."""
    if failed:
        return SectionUpdate(notes=("Rank exits due to a failure, won't update the FT timeouts",))
    sections: list[str] = []
    notes: list[str] = []
    if loaded_checkpoint:
        sections.append(SETUP)
    else:
        notes.append("Can't update the setup section timeout until persistent checkpoint is loaded")
    if iterations > MIN_ITERATIONS_FOR_STEP_UPDATE:
        sections.append(STEP)
    else:
        notes.append("Need to see more training iterations to update the step section timeout")
    saved = last_save_step > 0
    if not saved:
        notes.append("Checkpointing section is not updated until a checkpoint was saved")
    elif async_checkpointing:
        notes.append("Can't update the checkpointing section timeout with async checkpointing")
    else:
        sections.append(CHECKPOINTING)
    out_of_section = final and SETUP in sections and STEP in sections and saved
    if final and not out_of_section:
        notes.append("The out-of-section timeout won't be updated until all FT sections were seen")
    return SectionUpdate(tuple(sections), out_of_section, tuple(notes))


def config_problem(listed: Iterable[str]) -> str | None:
    """Why a monitor's ``rank_section_timeouts`` does not suit the sections callback (None: it
    does): it must list exactly ``REFERENCE_SECTIONS``, the sections it opens and learns."""
    names = sorted(set(listed))
    if set(names) == REFERENCE_SECTIONS:
        return None
    expected = ", ".join(sorted(REFERENCE_SECTIONS))
    return (f"rank_section_timeouts lists {', '.join(names) or 'no section'}; FaultToleranceSectionsCallback "
            f"needs exactly {expected} (as nvidia-resiliency-ext's)")
