"""ft-monitor in a PyTorch Lightning run: a `Callback` that reports the run's progress to the
rank's monitor, learns its timeouts, and keeps them in Lightning's own checkpoint.

    from ft_client.integrations.lightning import FtCallback

    trainer = L.Trainer(..., callbacks=[FtCallback(), ModelCheckpoint(save_last=True, ...)])
    trainer.fit(model, ckpt_path="last")        # under ft-launcher

What it does, in the ``fit`` stage (other stages are left alone):

- ``setup`` connects the client (`RankMonitorClient.init_workload_monitoring`) and opens the
  ``setup`` section, which the first batch closes: start-up, checkpoint loading, the first
  data-loader fetch;
- each training batch is the ``step`` section (from ``on_train_batch_start`` to
  ``on_train_batch_end``: its forward, backward and optimizer step), so the monitor counts the
  framework's steps; each validation batch is the ``validation`` section where the monitor's
  config lists one (else it is timed by the heartbeats and the out-of-section timeout);
- the strategy's ``save_checkpoint`` and ``remove_checkpoint`` run in the ``checkpointing``
  section (the write itself, which no Lightning hook brackets);
- every batch also sends a heartbeat (a store into the progress record), so a config with
  heartbeat timeouts works with sections too;
- with ``calculate_timeouts``, the section timeouts are learned after each checkpoint the run
  saves (every rank at the same step: it is a collective) and at the end, the out-of-section
  timeout with them; they go into the checkpoint (`state_dict`, under the callback's state key)
  and are put in force again when Lightning restores it;
- with ``snapshot_every=K``, every K optimizer steps each rank puts the checkpoint Lightning
  would write (``dump_checkpoint``: model, optimizers, schedulers, loops, callbacks; the
  hyperparameters left out) into an `ft_client.snapshot`, in its monitor's memory; at ``setup``
  the ranks restore the newest snapshot they all hold, and Lightning resumes from it instead of
  its file checkpoint where the snapshot is the newer (the file is still read first, to compare);
- with ``autoresume``, rank 0 touches ``$FAULT_TOL_FINISHED_FLAG_FILE`` when the run has
  reached ``max_steps`` or ``max_epochs``, or ran at most one batch without failing (nothing
  was left: a ``max_time`` reached by the run before), for an autoresume loop that
  resubmits the job until the file appears.

A section the monitor's config does not list costs no IPC (ft_client's rule), so the callback
works with any config; the monitor acts on those it lists. nvidia-resiliency-ext's
``ptl_resiliency`` names, `FaultToleranceCallback` (heartbeats only) and
`FaultToleranceSectionsCallback` (sections ``setup``, ``step`` and ``checkpointing``), take
their constructor arguments and follow their rules for learning, their log lines and their
``exp_dir`` files (`lightning_reference`); the config and its socket's folder change as
docs/migration.md says. Where ours differs from theirs, docs/integrations.md says so.
"""

from __future__ import annotations

import logging
import os
import pathlib
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_info
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
        from pytorch_lightning.utilities import rank_zero_info
    except ImportError as e:
        raise ImportError("ft_client.integrations.lightning needs Lightning: pip install 'ft-monitor[lightning]' "
                          "(or pytorch_lightning)") from e

from ft_client import safefiles, snapshot
from ft_client.client import RankMonitorClient
from ft_client.errors import FtError, MemorySnapshotError, RankMonitorClientError
from ft_client.integrations.lightning_reference import HeartbeatReference, SectionsReference
from ft_client.integrations.reference_rules import config_problem
from ft_client.integrations.sections import CHECKPOINTING, SETUP, STEP, VALIDATION, OpenSections
from ft_client.integrations.state_file import StateFile
from ft_client.workload import WorkloadAction, WorkloadControlRequest

FINISHED_FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"
"""Where ``autoresume`` says the training is finished (nvidia-resiliency-ext's variable)."""
TIMEOUTS_FILENAME = "_ft_state_.json"
"""The learned timeouts' file in ``exp_dir``, where one is given (the reference's name)."""
HPARAMS_KEYS = ("hyper_parameters", "hparams_name", "hparams_type",
                "datamodule_hyper_parameters", "datamodule_hparams_name", "datamodule_hparams_type")
"""What a snapshot leaves out of Lightning's checkpoint: a resume does not read them (they are for
``load_from_checkpoint``), and they may hold any Python object, which a snapshot refuses."""


class LightningIntegrationError(FtError, ValueError):
    """The callback cannot work as configured (its message says why)."""


@dataclass
class SimulatedFaultParams:
    """A fault to simulate (testing and debugging, as nvidia-resiliency-ext's): ``fault_type``
    ``rank_killed`` (SIGKILL), ``rank_hung`` (SIGSTOP) or ``random``, after ``base_delay`` +
    up to ``rand_delay`` seconds from ``setup``, on ``rank_to_fail`` (None: a rank drawn the
    same way on every rank, from the run id)."""

    fault_type: str
    base_delay: float
    rand_delay: float = 0.0
    rank_to_fail: int | None = None


def _fault_params(value: SimulatedFaultParams | dict[str, Any] | None) -> SimulatedFaultParams | None:
    if value is None or isinstance(value, SimulatedFaultParams):
        return value
    try:
        params = SimulatedFaultParams(**dict(value))
    except TypeError as e:
        raise LightningIntegrationError(f"simulated_fault_params = {value!r:.200}: {e}") from e
    if params.fault_type not in ("rank_killed", "rank_hung", "random"):
        raise LightningIntegrationError(f"simulated_fault_params.fault_type = {params.fault_type!r}: must be "
                                        "'rank_killed', 'rank_hung' or 'random'")
    return params


def _simulate_fault(params: SimulatedFaultParams, rank: int, world: int) -> None:
    rng = random.Random(os.environ.get("TORCHELASTIC_RUN_ID", "ft"))  # the same draw on every rank
    target = params.rank_to_fail if params.rank_to_fail is not None else rng.randrange(max(world, 1))
    if rank != target:
        return
    kind = params.fault_type if params.fault_type != "random" else rng.choice(["rank_killed", "rank_hung"])
    delay = params.base_delay + params.rand_delay * rng.random()

    def fault() -> None:
        time.sleep(delay)
        print(f"ft_client: simulating a fault on rank {rank}: {kind}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if kind == "rank_hung" else signal.SIGKILL)

    threading.Thread(target=fault, name="ft-simulated-fault", daemon=True).start()


class FtCallback(OpenSections, Callback):
    """Progress, learned timeouts and the finished flag of a Lightning ``fit`` (the module's
    docstring says what each hook does).

    ``sections``: time batches and checkpoint writes as sections (False: heartbeats only);
    ``calculate_timeouts``: learn the section timeouts after each checkpoint and at the end;
    ``autoresume``: touch ``$FAULT_TOL_FINISHED_FLAG_FILE`` (which must be set) when training
    is done; ``exp_dir``: also keep the learned timeouts in ``exp_dir/_ft_state_.json``, as the
    reference does, read back at ``setup`` (under `state_file`'s rule: a file or folder that is
    not the job user's own is ignored with one warning); ``exc_handling_policy``: called with an exception
    that ends ``fit`` on this rank, returns the `WorkloadControlRequest` to send to ft-launcher
    (for instance, to exclude this node); ``simulated_fault_params``: see
    `SimulatedFaultParams`; ``snapshot_every``: save an `ft_client.snapshot` of the checkpoint
    every that many optimizer steps and resume from it (0: never).

    The hooks the classes under the reference's names override (`lightning_reference`):
    ``_connected``, ``_after_batch``, ``_saved``, ``_learn``, ``_checkpoint_keeps_timeouts``.
    """

    TIMEOUTS_FILENAME: ClassVar[str] = TIMEOUTS_FILENAME
    learn_on_clean_exit: ClassVar[bool] = False  # why not: docs/integrations.md, "an exception out of fit"

    def __init__(self, *, sections: bool = True, calculate_timeouts: bool = True, autoresume: bool = False,
                 exp_dir: str | pathlib.Path | None = None,
                 exc_handling_policy: Callable[[BaseException], WorkloadControlRequest] | None = None,
                 simulated_fault_params: SimulatedFaultParams | dict[str, Any] | None = None,
                 snapshot_every: int = 0, logger_name: str | None = "ft_client.lightning") -> None:
        if type(snapshot_every) is not int or snapshot_every < 0:
            raise LightningIntegrationError(f"snapshot_every = {snapshot_every!r:.60}: must be a whole number of "
                                            "steps >= 0 (0: no snapshots)")
        if autoresume and not os.environ.get(FINISHED_FLAG_ENV):
            raise LightningIntegrationError(f"autoresume=True needs {FINISHED_FLAG_ENV}: the file an autoresume "
                                            "loop watches (set it in the job script)")
        self.sections = sections
        self.calculate_timeouts = calculate_timeouts
        self.autoresume = autoresume
        self.logger = logging.getLogger(logger_name)
        self.exp_dir = pathlib.Path(exp_dir) if exp_dir is not None else None
        self._state_file = (StateFile(self.exp_dir, self.TIMEOUTS_FILENAME, self.logger)
                            if self.exp_dir is not None else None)
        self.exc_handling_policy = exc_handling_policy
        self.simulated_fault_params = _fault_params(simulated_fault_params)
        self.snapshot_every = snapshot_every
        self._snapshot_step: int | None = None  # the global step of the last snapshot saved or restored
        self._snapshotting = False  # dump_checkpoint runs for a snapshot: its hooks are not a save
        self.client: RankMonitorClient | None = None
        self._open: set[str] = set()
        self._saved_at: int | None = None  # global step of the last checkpoint written, not yet learned from
        self._failed = False
        self._pending_state: dict[str, Any] | None = None
        self._resumed = False  # this run loaded a checkpoint
        self.batches = 0

    # -- the reference's attribute names ------------------------------------------------------
    @property
    def fault_tol_client(self) -> RankMonitorClient | None:
        return self.client

    @property
    def is_initialized(self) -> bool:
        return self.client is not None

    # -- the strategy's checkpoint writes, in a section ----------------------------------------
    def _wrap(self, owner: Any, method: str) -> None:
        original = getattr(owner, method, None)
        if original is None or getattr(original, "_ft_wrapped", False):
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            nested = CHECKPOINTING in self._open  # a removal inside a save: one section
            if self.sections and not nested:
                self._start(CHECKPOINTING)
            try:
                return original(*args, **kwargs)
            finally:
                if self.sections and not nested:
                    self._end(CHECKPOINTING)
                self._beat()

        timed._ft_wrapped = True  # type: ignore[attr-defined]
        setattr(owner, method, timed)

    # -- Lightning's hooks ----------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.client is not None:
            return
        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()
        self._connected(trainer)
        if self.calculate_timeouts and self._state_file is not None:
            self._state_file.load(self.client.load_state_dict)  # a file that may not be read: one warning
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
        for method in ("save_checkpoint", "remove_checkpoint"):
            self._wrap(trainer.strategy, method)
        if self.snapshot_every:
            self._offer_snapshot(trainer)
        if self.sections:
            self._start(SETUP)
        if self.simulated_fault_params is not None:
            _simulate_fault(self.simulated_fault_params, trainer.global_rank, trainer.world_size)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._beat()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.sections:
            self._end(SETUP)
            self._start(STEP)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.sections:
            self._end(STEP)
        self.batches += 1
        self._beat()
        self._after_batch(trainer)
        step = trainer.global_step
        if self.snapshot_every and step % self.snapshot_every == 0 and step != self._snapshot_step:
            self._save_snapshot(trainer, step)

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if self.sections and self.client is not None:
            self._end(SETUP)
            self._start(VALIDATION)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self.sections:
            self._end(VALIDATION)
        self._beat()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.client is not None and not self._snapshotting:
            self._saved_at = trainer.global_step
            self._saved(trainer)
            self._beat()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._resumed = True

    def state_dict(self) -> dict[str, Any]:
        """What goes into Lightning's checkpoint: the learned timeouts and their observations."""
        if self.client is None or not self._checkpoint_keeps_timeouts():
            return {}
        return {"ft_client": self.client.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """From Lightning's checkpoint: the learned timeouts are put in force (kept until
        ``setup`` connects, where Lightning restores before it)."""
        state = state_dict.get("ft_client") if isinstance(state_dict, dict) else None
        if not isinstance(state, dict) or not self._checkpoint_keeps_timeouts():
            return
        if self.client is None:
            self._pending_state = state_dict
            return
        self._pending_state = None
        try:
            self.client.load_state_dict(state)
        except RankMonitorClientError as e:
            self.logger.warning("ft_client: the checkpoint's learned timeouts were not loaded: %s", e)
        else:
            self.logger.info("ft_client: timeouts from the checkpoint: %s", self.client.timeouts)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.client is None:
            return
        self._failed = not (isinstance(exception, SystemExit) and not exception.code)
        self._abandon()  # a step cut short is not a step the framework ran
        if self.learn_on_clean_exit and self.calculate_timeouts:
            self._learn(final=True)  # the reference classes: their rules decide, a failure learns nothing
        if self.exc_handling_policy is not None:
            request = self.exc_handling_policy(exception)
            if not isinstance(request, WorkloadControlRequest):
                raise LightningIntegrationError(f"exc_handling_policy returned {request!r:.100}, "
                                                "not a WorkloadControlRequest")
            self.client.send_workload_control_request(request)
            if request.action is WorkloadAction.ShutdownWorkload and self.autoresume:
                self._finished_flag()
        self._shutdown()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.client is None:
            return
        for name in list(self._open):
            self._end(name)
        if self.autoresume and trainer.global_rank == 0 and (_completed(trainer) or self._empty_run()):
            self._finished_flag()
        if self.calculate_timeouts and not self._failed:
            self._learn(final=True)
        if self.snapshot_every:
            snapshot.wait()  # its partner copy, before the process group goes
        self._shutdown()

    # -- snapshots ---------------------------------------------------------------------------------
    def _save_snapshot(self, trainer: Any, step: int) -> None:
        """The checkpoint Lightning would write now, into the monitor's memory; one that cannot be
        held (an object a snapshot refuses, named by its path) stops the snapshots, with a warning."""
        self._snapshot_step = step
        self._snapshotting = True
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._snapshotting = False
        for key in HPARAMS_KEYS:
            checkpoint.pop(key, None)
        try:
            snapshot.save(step, checkpoint)
        except MemorySnapshotError as e:
            self.snapshot_every = 0
            self.logger.warning("ft_client: no more snapshots in this run: the checkpoint at step %d cannot be "
                                "held in one: %s", step, e)

    def _offer_snapshot(self, trainer: Any) -> None:
        """Every rank restores the newest snapshot all of them hold (a collective; None after one
        line saying why), and Lightning's checkpoint loading takes it where it is newer than the
        file it loads (or where there is no file)."""
        got = snapshot.restore()
        if got is None:
            return
        step, state = got
        connector = trainer._checkpoint_connector
        load_file = connector.resume_start

        def resume_start(*args: Any, **kwargs: Any) -> None:
            connector.resume_start = load_file  # once, for this fit
            load_file(*args, **kwargs)
            loaded = connector._loaded_checkpoint
            file_step = loaded.get("global_step") if isinstance(loaded, dict) else None
            if isinstance(file_step, int) and file_step >= step:
                rank_zero_info(f"ft_client: the file checkpoint (step {file_step}) is not older than the snapshot "
                               f"(step {step}): resuming from the file")
                return
            connector._loaded_checkpoint = state
            self._snapshot_step = step
            rank_zero_info(f"ft_client: resuming from the in-memory snapshot of step {step}"  # as Lightning's own
                           + ("" if file_step is None else f" (the file checkpoint is at step {file_step})"))

        connector.resume_start = resume_start

    # -- learning, the flag, the end -------------------------------------------------------------
    def _connected(self, trainer: Any) -> None:
        """Right after the client connected, in ``setup``: nothing here."""

    def _after_batch(self, trainer: Any) -> None:
        """After each training batch: learn where a checkpoint was written since the last time."""
        if self._saved_at is not None and self.calculate_timeouts:
            self._learn(final=False)

    def _saved(self, trainer: Any) -> None:
        """A checkpoint is being saved (``on_save_checkpoint``): ``_saved_at`` is all ours needs."""

    def _checkpoint_keeps_timeouts(self) -> bool:
        """Whether Lightning's checkpoint holds the learned timeouts (ours: always)."""
        return True

    def _learn(self, final: bool) -> None:
        """`OpenSections._learn`, and the learned timeouts into ``exp_dir``'s file where one is
        given (the reference's)."""
        self._saved_at = None
        super()._learn(final)
        client = self.client
        if client is not None and self._state_file is not None and client.rank == 0:
            self._state_file.write(client.state_dict())

    def _empty_run(self) -> bool:
        """A fit that ran at most one batch and did not fail: nothing was left to train (a
        ``max_time`` reached, data that ran out), so an autoresume loop must stop (the
        reference's rule: its flag appears after such a run)."""
        return self.batches <= 1 and not self._failed

    def _finished_flag(self) -> None:
        path = os.environ.get(FINISHED_FLAG_ENV)
        if path:
            try:  # created 0600 where missing; a symlink, FIFO or another user's file is not touched
                os.close(safefiles.open_append(path))
                os.utime(path, follow_symlinks=False)
            except OSError as e:
                self.logger.warning("ft_client: cannot touch %s (the finished flag): %s", path, e)
                return
            self.logger.info("ft_client: training finished; touched %s", path)

    def _shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None
            self._open.clear()


def _completed(trainer: Any) -> bool:
    max_steps, max_epochs = getattr(trainer, "max_steps", -1), getattr(trainer, "max_epochs", None)
    if isinstance(max_steps, int) and max_steps > 0 and trainer.global_step >= max_steps:
        return True
    return isinstance(max_epochs, int) and max_epochs > 0 and trainer.current_epoch >= max_epochs


class FaultToleranceCallback(HeartbeatReference, FtCallback):
    """nvidia-resiliency-ext's ``ptl_resiliency.FaultToleranceCallback``, under its name and
    arguments, and with its rules: heartbeats only, the heartbeat timeouts learned at most once
    a run, at its end (`lightning_reference.HeartbeatReference`), kept in
    ``exp_dir/_ft_state.json``."""

    def __init__(self, autoresume: bool, calculate_timeouts: bool,
                 simulated_fault_params: SimulatedFaultParams | dict[str, Any] | None = None,
                 exp_dir: str | pathlib.Path | None = None,
                 logger_name: str | None = "nemo_logger.FaultToleranceCallback") -> None:
        super().__init__(sections=False, calculate_timeouts=calculate_timeouts, autoresume=autoresume,
                         exp_dir=exp_dir, simulated_fault_params=simulated_fault_params, logger_name=logger_name)


class FaultToleranceSectionsCallback(SectionsReference, FtCallback):
    """nvidia-resiliency-ext's ``ptl_resiliency.FaultToleranceSectionsCallback``, under its name
    and arguments, and with its rules: sections ``setup``, ``step`` and ``checkpointing``, which
    the monitor's config must list exactly, learned after each save and at the end
    (`lightning_reference.SectionsReference`), kept in ``exp_dir/_ft_state_.json``."""

    def __init__(self, autoresume: bool, calculate_timeouts: bool,
                 simulated_fault_params: SimulatedFaultParams | dict[str, Any] | None = None,
                 exp_dir: str | pathlib.Path | None = None,
                 logger_name: str | None = "nemo_logger.FaultToleranceCallback",
                 exc_handling_policy: Callable[[BaseException], WorkloadControlRequest] | None = None) -> None:
        super().__init__(sections=True, calculate_timeouts=calculate_timeouts, autoresume=autoresume,
                         exp_dir=exp_dir, exc_handling_policy=exc_handling_policy,
                         simulated_fault_params=simulated_fault_params, logger_name=logger_name)

    def _connected(self, trainer: Any) -> None:
        """The reference's check of the monitor's config (a ValueError, in ``setup``), and its
        asynchronous checkpoint finalization timed as ``checkpointing`` too."""
        super()._connected(trainer)
        client = self.client
        problem = None if client is None else config_problem(client.timeouts.rank_section_timeouts)
        if problem is not None:
            from ft_client.client.monitor import configuration_error

            configuration_error(getattr(client, "rank", 0), problem)  # ft-launcher stops: no restart spent on it
            self._shutdown()
            raise LightningIntegrationError(problem)
        checkpoint_io = getattr(trainer.strategy, "checkpoint_io", None)
        if hasattr(checkpoint_io, "maybe_finalize_save_checkpoint"):
            self.async_checkpointing = True
            self._wrap(checkpoint_io, "maybe_finalize_save_checkpoint")
