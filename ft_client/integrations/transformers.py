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
- with ``snapshot_every=K``, every K optimizer steps (``on_step_end``, where the Trainer's own
  save would come next) each rank puts what a Trainer checkpoint holds (model, optimizer and
  scheduler state, ``trainer_state.json``, the random generators) into an `ft_client.snapshot`,
  in its monitor's memory. The Trainer resumes only from a folder: ``checkpoint_to_resume``,
  called before ``train``, restores the newest snapshot every rank holds and, where it is
  newer than the last ``checkpoint-N`` in ``output_dir``, writes it there as one (with the
  Trainer's own writer for the model) and returns that folder;
- ``on_train_end`` closes what is open, learns, and shuts the client down.

A section the monitor's config does not list costs no IPC (ft_client's rule), so the callback
works with any config; the monitor acts on those it lists. docs/integrations.md says what is
not supported and why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
from typing import Any

from ft_client import safefiles, snapshot
from ft_client.client import RankMonitorClient
from ft_client.errors import FtError, MemorySnapshotError, RankMonitorClientError
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


def _rng_state() -> dict[str, Any]:
    """The random generators' state as the Trainer saves it (``_save_rng_state``), numpy's array
    as a list (a snapshot holds plain values and tensors)."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {"python": random.getstate(), "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, cached],
            "cpu": torch.random.get_rng_state()}


def _last_checkpoint(output_dir: str, logger: logging.Logger) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir`` that is this user's and that others
    cannot write (`safefiles.shared_dir_problem`), as ``get_last_checkpoint`` names them; the
    others are passed over with one warning, and an ``output_dir`` that fails the rule itself
    gives None (another user could swap any folder in it)."""
    if not os.path.isdir(output_dir):
        return None
    problem = safefiles.shared_dir_problem(output_dir)
    if problem is not None:
        logger.warning("ft_client: not resuming from a checkpoint in %s: %s", output_dir, problem)
        return None
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    steps = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                    if (m := re.fullmatch(PREFIX_CHECKPOINT_DIR + r"-(\d+)", name))), reverse=True)
    skipped = []
    for _, name in steps:
        folder = os.path.join(output_dir, name)
        if not os.path.isdir(folder):
            continue
        problem = safefiles.shared_dir_problem(folder)
        if problem is None:
            break
        skipped.append(problem)
    else:
        folder = None
    if skipped:
        logger.warning("ft_client: passing over checkpoint folders that are not this user's own: %s",
                       "; ".join(skipped))
    return folder


def _checkpoint_step(folder: str | None) -> int | None:
    """N of a ``checkpoint-N`` folder."""
    match = re.search(r"checkpoint-(\d+)$", folder or "")
    return int(match.group(1)) if match else None


def _write_checkpoint(trainer: Any, folder: str, image: dict[str, Any]) -> None:
    """A snapshot's image as the Trainer's checkpoint folder (made private by `_fresh_folder`
    before: nothing in it is another user's): rank 0 writes the model (the Trainer's own
    ``_save``), optimizer, scheduler and ``trainer_state.json``, every rank its random
    generators' file."""
    import numpy as np
    import torch
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME

    args = trainer.args
    if args.should_save:
        trainer._save(folder, state_dict=image["model"])
        if image["optimizer"] is not None:
            torch.save(image["optimizer"], os.path.join(folder, OPTIMIZER_NAME))
        if image["scheduler"] is not None:
            torch.save(image["scheduler"], os.path.join(folder, SCHEDULER_NAME))
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
            f.write(image["trainer_state"])
    rng = dict(image["rng"])
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    rng["numpy"] = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    rng["python"] = (rng["python"][0], tuple(rng["python"][1]), rng["python"][2])
    name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    torch.save(rng, os.path.join(folder, name))


def _fresh_folder(output_dir: str, folder: str) -> str | None:
    """Make ``folder`` in ``output_dir`` (mode 0700), or take the one there where it is this
    user's and private (another rank of the job made it a moment ago, or an attempt before
    this one); ``output_dir`` is made where missing, and must pass the shared-folder rule
    where it is there. None, or why it is refused (another user's, or others may write it)."""
    try:
        safefiles.make_dir(output_dir)
        safefiles.make_dir(folder, private=True)
    except OSError as e:  # UnsafeFileError is one
        return str(e)
    return None


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
    ``restore_callback_states_from_checkpoint`` is set). ``snapshot_every``: save an
    `ft_client.snapshot` every that many steps (0: never), which `checkpoint_to_resume` gives back.
    """

    def __init__(self, *, sections: bool = True, calculate_timeouts: bool = True, snapshot_every: int = 0,
                 logger_name: str | None = "ft_client.transformers") -> None:
        if type(snapshot_every) is not int or snapshot_every < 0:
            raise TransformersIntegrationError(f"snapshot_every = {snapshot_every!r:.60}: must be a whole number of "
                                               "steps >= 0 (0: no snapshots)")
        self.snapshot_every = snapshot_every
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
                     "snapshot_every": self.snapshot_every, "logger_name": self.logger_name},
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
        if self.snapshot_every and state.global_step % self.snapshot_every == 0:
            self._save_snapshot(state, **kwargs)
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
        if self.snapshot_every:
            snapshot.wait()  # its partner copy, before the process group goes
        self.client.shutdown_workload_monitoring()
        self.client = None

    # -- snapshots ----------------------------------------------------------------------------------
    def _save_snapshot(self, state: TrainerState, model: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        """What the Trainer's checkpoint would hold now, into the monitor's memory; one that cannot
        be held (named by its path) stops the snapshots, with a warning."""
        if isinstance(state.stateful_callbacks, dict):
            state.stateful_callbacks[type(self).__name__] = self.state()  # as the Trainer's save does
        image = {"step": state.global_step, "trainer_state": json.dumps(dataclasses.asdict(state)),
                 "model": model.state_dict() if model is not None else {},
                 "optimizer": optimizer.state_dict() if optimizer is not None else None,
                 "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                 "rng": _rng_state()}
        try:
            snapshot.save(state.global_step, image)
        except MemorySnapshotError as e:
            self.snapshot_every = 0
            self.logger.warning("ft_client: no more snapshots in this run: step %d's state cannot be held in "
                                "one: %s", state.global_step, e)

    def checkpoint_to_resume(self, trainer: Any) -> str | None:
        """The folder ``trainer.train(resume_from_checkpoint=...)`` should resume from: the last
        ``checkpoint-N`` in ``output_dir``, or the newest snapshot every rank holds where it is
        newer, written out as ``checkpoint-<step>`` first; None where there is neither. Every rank
        calls it, after the Trainer is made (its process group is then up) and before ``train``.

        Only folders of this user that others cannot write are resumed from, and the snapshot
        is written only into a folder made now (mode 0700) or a private one of this user's: a
        ``checkpoint-N`` another user made is passed over or refused, with one warning
        (docs/integrations.md, "Folders another user can write")."""
        last = _last_checkpoint(trainer.args.output_dir, self.logger)
        if not self.snapshot_every:
            return last
        got = snapshot.restore()  # a collective; None after one line saying why
        file_step = _checkpoint_step(last)
        newest_file = max_across_ranks([float(-1 if file_step is None else file_step)])[0]
        if got is None or got[0] <= newest_file:
            if got is not None:
                self.logger.warning("ft_client: the checkpoint folder %s (step %d) is not older than the snapshot "
                                    "(step %d): resuming from the folder", last, file_step, got[0])
            return last
        step, image = got
        folder = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
        problem = _fresh_folder(trainer.args.output_dir, folder)
        if max_across_ranks([0.0 if problem is None else 1.0])[0]:  # one rank refused: none writes
            self.logger.warning("ft_client: the in-memory snapshot of step %d is not written out: %s; resuming from "
                                "%s", step, problem or "another rank refused its folder", last)
            return last
        _write_checkpoint(trainer, folder, image)
        max_across_ranks([0.0])  # every rank's files are there before any rank reads them
        self.logger.warning("ft_client: resuming from the in-memory snapshot of step %d, written out as %s%s", step,
                            folder, "" if last is None else f" (the last checkpoint folder was {last})")
        return folder

    # -- learning ---------------------------------------------------------------------------------
