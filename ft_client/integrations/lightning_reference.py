"""What makes `FaultToleranceCallback` and `FaultToleranceSectionsCallback`
(`ft_client.integrations.lightning`) behave as nvidia-resiliency-ext's ``ptl_resiliency``
classes of those names: when they learn timeouts (`reference_rules`), what they log (the
reference's lines, which its tests count), and the file they keep in ``exp_dir`` (its name,
and our state dict with the reference's ``current_timeouts`` entry beside it, so a job moving
over keeps its file and either client reads it).

Mixins over `FtCallback`'s hooks (``_connected``, ``_after_batch``, ``_saved``, ``_learn``,
``_beat``): put before `FtCallback` in a class's bases. This module does not import
`ft_client.integrations.lightning` (it imports this one), nor Lightning.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, ClassVar

from ft_client.integrations import reference_rules as rules
from ft_client.integrations.sections import OpenSections
from ft_client.integrations.state_file import StateFile
from ft_client.learning.state_dict import with_nvrx_state

LOG_PREFIX = "[FaultToleranceCallback@rank0] "
"""The reference's prefix of its log lines (both of its classes use it)."""


class ReferenceCallback(OpenSections):
    """What both reference classes share: learning on a clean exit too, INFO lines on rank 0,
    and the ``exp_dir`` file as the one store of the learned timeouts."""

    TIMEOUTS_FILENAME: ClassVar[str]
    learn_on_clean_exit: ClassVar[bool] = True  # the reference learns on sys.exit(0); FtCallback does not
    exp_dir: pathlib.Path | None
    _state_file: StateFile | None
    logger: logging.Logger
    calculate_timeouts: bool
    batches: int
    _failed: bool
    _saved_at: int | None
    _rank0: bool = False

    def _connected(self, trainer: Any) -> None:
        self._rank0 = trainer.global_rank == 0  # the reference asks torch.distributed: the same rank

    def _checkpoint_keeps_timeouts(self) -> bool:
        """With ``exp_dir``, its file is the one store (read at setup, as the reference's): a
        Lightning checkpoint holds the timeouts as of its save, older than the file written at
        the end of the run, and restored after the file it would put them back."""
        return self.exp_dir is None

    def _log(self, message: str) -> None:
        if self._rank0:
            self.logger.info(LOG_PREFIX + message)

    def _write_file(self) -> None:
        """Our state dict and the reference's entry, on rank 0 (every rank holds the same)."""
        client = self.client
        if client is not None and self._state_file is not None and self._rank0:
            self._state_file.write(with_nvrx_state(client.state_dict(), client.timeouts))


class HeartbeatReference(ReferenceCallback):
    """`FaultToleranceCallback`: heartbeats where the reference sends them (train start, batch
    end and end; validation start, batch end and end; each save; the end), and the heartbeat
    timeouts learned at most once a run, at its end or clean exit (`rules.may_update_hb_timeouts`)."""

    TIMEOUTS_FILENAME: ClassVar[str] = "_ft_state.json"
    _heartbeats: rules.HeartbeatCount | None = None
    _hb_updated: bool = False

    def _connected(self, trainer: Any) -> None:
        super()._connected(trainer)
        self._heartbeats, self._hb_updated = rules.HeartbeatCount(), False  # the rules count one fit

    def _count(self) -> rules.HeartbeatCount:
        if self._heartbeats is None:
            self._heartbeats = rules.HeartbeatCount()
        return self._heartbeats

    def _beat(self) -> None:
        if self.client is not None:
            self.client.send_heartbeat()
            self._count().beat()

    def _saved(self, trainer: Any) -> None:
        self._count().save()  # before the save's own heartbeat, which is the one after it

    def _after_batch(self, trainer: Any) -> None:
        """Nothing is learned during the run: only at its end."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._beat()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._beat()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._beat()

    def _learn(self, final: bool) -> None:
        """At the end of a run (``teardown``) or a clean exit (``on_exception``): a last
        heartbeat, then the heartbeat timeouts where the reference's rule allows."""
        self._saved_at = None
        client = self.client
        if not final or client is None:
            return
        self._beat()
        if not rules.may_update_hb_timeouts(
                updated=self._hb_updated, iterations=self.batches, failed=self._failed,
                loaded_checkpoint=self._resumed, save_between_heartbeats=self._count().save_between):
            return
        self._hb_updated = True
        self._log("Updating FT timeouts...")
        if client.calculate_and_set_hb_timeouts(skip_if_not_ready=True):
            self._log(f"Updated FT timeouts. New values: {client.hb_timeouts}")
            self._write_file()
        else:
            self._log("Not enough data to update the FT timeouts")


class SectionsReference(ReferenceCallback):
    """`FaultToleranceSectionsCallback`: the section timeouts learned at the first training
    batch end after each save and at the end or a clean exit, the sections the reference's
    rule allows (`rules.plan_section_update`)."""

    TIMEOUTS_FILENAME: ClassVar[str] = "_ft_state_.json"
    async_checkpointing: bool = False  # set where the strategy's checkpoint_io finalizes saves later
    _last_save_step: int = 0
    _last_update_step: int = 0

    def _connected(self, trainer: Any) -> None:
        super()._connected(trainer)
        self._last_save_step = self._last_update_step = 0  # the rules count one fit

    def _saved(self, trainer: Any) -> None:
        self._last_save_step = trainer.global_step

    def _after_batch(self, trainer: Any) -> None:
        if self.calculate_timeouts and rules.update_due_after_save(self._last_update_step, self._last_save_step):
            self._learn(final=False)
            self._last_update_step = trainer.global_step

    def _learn(self, final: bool) -> None:
        self._saved_at = None
        client = self.client
        if client is None or not self.calculate_timeouts:
            return
        plan = rules.plan_section_update(
            failed=self._failed, loaded_checkpoint=self._resumed, iterations=self.batches,
            last_save_step=self._last_save_step, async_checkpointing=self.async_checkpointing, final=final)
        for note in plan.notes:
            self._log(note)
        if plan.is_empty:
            return
        self._log(f"Updating FT timeouts for: {list(plan.sections)} update out-of-section: {plan.out_of_section}")
        applied = client.calculate_and_set_section_timeouts(
            selected_sections=list(plan.sections), calc_out_of_section=plan.out_of_section, skip_if_not_ready=True)
        if not applied:  # a section allowed but not run (a save cut short): the others on their own
            observed = (client.state_dict().get("observations") or {}).get("sections") or {}
            ran = [s for s in plan.sections if observed.get(s) is not None]
            applied = bool(ran) and ran != list(plan.sections) and client.calculate_and_set_section_timeouts(
                selected_sections=ran, calc_out_of_section=plan.out_of_section, skip_if_not_ready=True)
        if applied:
            self._log(f"Updated FT timeouts. New values: {client.section_timeouts}")
            self._write_file()
        else:
            self._log("Not enough data to update the FT timeouts")
