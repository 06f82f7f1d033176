"""ft-monitor in a Hugging Face ``Trainer`` run: a ``TrainerCallback`` that reports the run's
progress to the rank's monitor, learns its timeouts, and keeps them in the Trainer's own
checkpoint folders.

    from ft_client.integrations.transformers import FtTrainerCallback

    trainer = Trainer(model, args, train_dataset=data, callbacks=[FtTrainerCallback()])
    trainer.train(resume_from_checkpoint=True)   # under ft-launcher; True once a checkpoint exists

What it does, in ``train`` (an ``evaluate`` or ``predict`` outside it is left alone):

- ``on_train_begin`` connects the client (`RankMonitorClient.init_workload_monitoring`), puts
  in force the learned timeouts of the checkpoint being resumed, and opens the ``setup``
  section, which the first step closes (the data loader's start and its first batches: the
  Trainer loads the checkpoint before ``on_train_begin``);
- each optimizer step is the ``step`` section, from ``on_step_begin`` to ``on_step_end``: with
  gradient accumulation, all its micro-batches' forwards and backwards and the optimizer step,
  so the monitor counts the Trainer's ``global_step``; each micro-batch but the last sends a
  heartbeat (``on_substep_end``), as does every step;
- a checkpoint write is the ``checkpointing`` section: opened when the step that will save ends
  (``control.should_save``, set by the Trainer's flow at ``on_step_end`` or ``on_epoch_end``,
  or after an evaluation), closed in ``on_save`` after the ranks have met (the Trainer writes
  the model and optimizer on rank 0 only and has no barrier after it: without one the other
  ranks would wait for rank 0's write inside their next ``step``); an evaluation's batches are
  the ``validation`` section where the monitor's config lists one, each with a heartbeat;
- with ``calculate_timeouts``, the section timeouts are learned when a step that will save ends,
  just before the write (every rank at the same step: it is a collective), so that each
  checkpoint holds what was learned up to its step (a write is learned from at the next one);
  a save no hook announced (``save_strategy="best"``) is learned from after it; and at the end,
  the out-of-section timeout with them;
- the learned timeouts and their observations go into each checkpoint's ``trainer_state.json``
  (``stateful_callbacks``, the ``ExportableState`` protocol: ``state()``), and are read back
  from it at ``on_train_begin`` when the Trainer resumes, whatever
  ``restore_callback_states_from_checkpoint`` says;
- ``on_train_end`` closes what is open, learns, and shuts the client down.

A section the monitor's config does not list costs no IPC (ft_client's rule), so the callback
works with any config; the monitor acts on those it lists. docs/integrations.md says what is
not supported and why.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ft_client.client import RankMonitorClient
from ft_client.errors import FtError, RankMonitorClientError
from ft_client.integrations.sections import CHECKPOINTING, SETUP, STEP, VALIDATION, OpenSections
from ft_client.learning.sync import max_across_ranks

MIN_TRANSFORMERS = (4, 45)
"""The first transformers whose checkpoints hold each save's ``state()`` of the callbacks (before,
the one taken when training began)."""



def release(version: str) -> tuple[int, ...]:
    """A version string's major and minor numbers: ``"4.45.0.dev0"`` is (4, 45)."""
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers import __version__ as _version
    from transformers.trainer_callback import ExportableState
except ImportError as e:
    _CAUSE: ImportError | None = e
    _MISSING: str | None = f"{e}"
else:
    _CAUSE = None
    _MISSING = None if release(_version) >= MIN_TRANSFORMERS else f"transformers {_version} is installed"


class TransformersIntegrationError(FtError, ValueError):
    """The callback cannot work as configured (its message says why)."""


class TransformersMissingError(FtError, ImportError):
    """transformers is not installed, or is older than the callback needs."""


if _MISSING is not None:
    raise TransformersMissingError(
        "ft_client.integrations.transformers needs transformers 4.45 or later (its checkpoints keep the callback's "
        f"learned timeouts): pip install 'transformers>=4.45' ({_MISSING})") from _CAUSE

STATE_KEY = "ft_client"
"""Where the client's state_dict sits in the callback's entry of ``stateful_callbacks``."""


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TransformersIntegrationError(f"{name} = {value!r:.60}: must be True or False")
    return value


def saved_state(stateful_callbacks: object, name: str) -> dict[str, Any] | None:
    """The client's state_dict in a checkpoint's ``stateful_callbacks`` under the callback's
    class name ``name`` (one entry, or a list of them where a Trainer had several): the first
    that holds one, else None."""
    if not isinstance(stateful_callbacks, dict):
        return None
    entry = stateful_callbacks.get(name)
    for item in entry if isinstance(entry, list) else [entry]:
        if isinstance(item, dict) and isinstance(item.get(STATE_KEY), dict):
            state: dict[str, Any] = item[STATE_KEY]
            return state
    return None



class FtTrainerCallback(OpenSections, TrainerCallback, ExportableState):
    """Progress, learned timeouts and their checkpointing for a Hugging Face ``Trainer.train``
    (the module's docstring says what each hook does).

    ``sections``: time steps, evaluation batches and checkpoint writes as sections (False:
    heartbeats only, and the heartbeat timeouts are learned); ``calculate_timeouts``: learn the
    timeouts before each checkpoint and at the end. Both are kept in the checkpoint with the
    learned timeouts (the Trainer builds the callback again from them where
    ``restore_callback_states_from_checkpoint`` is set).
    """

    def __init__(self, *, sections: bool = True, calculate_timeouts: bool = True,
                 logger_name: str | None = "ft_client.transformers") -> None:
        self.sections = _flag("sections", sections)
        self.calculate_timeouts = _flag("calculate_timeouts", calculate_timeouts)
        if logger_name is not None and not isinstance(logger_name, str):
            raise TransformersIntegrationError(f"logger_name = {logger_name!r:.60}: must be a string or None")
        self.logger_name = logger_name
        self.logger = logging.getLogger(logger_name)
        self.client: RankMonitorClient | None = None
        self._open: set[str] = set()
        self._saving = False  # `checkpointing` opened (or learned) for a save that has not happened yet
        self._resumed = False  # this run resumed from a checkpoint
        self.steps = 0  # optimizer steps this callback saw end

    # -- the ExportableState protocol: what goes into trainer_state.json -----------------------
    def state(self) -> dict[str, Any]:
        """The callback's entry in a checkpoint's ``stateful_callbacks``: its arguments (from
        which the Trainer may build it again), and the learned timeouts with their
        observations (the client's state_dict, the same on every rank after learning)."""
        entry: dict[str, Any] = {
            "args": {"sections": self.sections, "calculate_timeouts": self.calculate_timeouts,
                     "logger_name": self.logger_name},
            "attributes": {},
        }
        if self.client is not None:
            entry[STATE_KEY] = self.client.state_dict()
        return entry

    # -- the Trainer's events ---------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.client is None:
            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
        else:  # train() again in this process (auto_find_batch_size's retry after an OOM)
            self._abandon()
        self._saving = False
        self._resumed = state.global_step > 0  # the Trainer loaded trainer_state.json
        name = type(self).__name__
        loaded = saved_state(state.stateful_callbacks, name) if self._resumed else None
        if isinstance(state.stateful_callbacks, dict):
            # a checkpoint written without this callback has no entry, and the Trainer's save
            # would fail on it (KeyError in _save_checkpoint)
            state.stateful_callbacks.setdefault(name, self.state())
        if loaded is not None:
            try:
                self.client.load_state_dict(loaded)
            except RankMonitorClientError as e:
                self.logger.warning("ft_client: the checkpoint's learned timeouts were not loaded: %s", e)
            else:
                self.logger.info("ft_client: timeouts from the checkpoint at step %d: %s", state.global_step,
                                 self.client.timeouts)
        if self.sections:
            self._start(SETUP)
        self._beat()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self._saving:  # a save announced by the last step did not happen
            self._saving = False
            self._end(CHECKPOINTING)
        if self.sections:
            self._end(SETUP)
            self._start(STEP)

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._beat()  # a micro-batch of gradient accumulation: the step goes on

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._end(STEP)
        self.steps += 1
        self._beat()
        self._after_step(control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if STEP in self._open:  # the loop left a step mid-accumulation (should_epoch_stop)
            self._abandon()
        self._beat()
        self._after_step(control)

    def _after_step(self, control: TrainerControl) -> None:
        """The Trainer evaluates, then saves, after the hook that set their flags."""
        if self.client is None:
            return
        if control.should_evaluate:
            if self.sections:
                self._start(VALIDATION)  # the first batch; on_evaluate announces the save
        elif control.should_save:
            self._before_save()

    def _before_save(self) -> None:
        if self._saving:
            return
        self._saving = True
        if self.calculate_timeouts:
            self._learn(final=False)
        if self.sections:
            self._start(CHECKPOINTING)

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                           **kwargs: Any) -> None:
        if self.client is None:
            return
        self._end(SETUP)  # eval_on_start
        self._end(VALIDATION)
        self._beat()
        if self.sections:
            self._start(VALIDATION)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.client is None:
            return
        self._end(VALIDATION)
        self._beat()
        if control.should_save:
            self._before_save()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if self.client is None:
            return
        announced, self._saving = self._saving, False
        max_across_ranks([0.0])  # the ranks meet: rank 0's write ends every rank's checkpointing
        self._end(CHECKPOINTING)
        self._beat()
        if not announced and self.calculate_timeouts:  # a save no hook announced: learn after it
            self._learn(final=False)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.client is None:
            return
        for name in list(self._open):
            self._end(name)
        self._saving = False
        if self.calculate_timeouts:
            self._learn(final=True)
        self.client.shutdown_workload_monitoring()
        self.client = None

    # -- learning ---------------------------------------------------------------------------------
