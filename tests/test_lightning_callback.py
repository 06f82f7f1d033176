"""ft_client.integrations.lightning's callbacks without a run: their arguments, their checks and
the rules they decide with (the real run: tests/test_lightning_e2e.py)."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from ft_client import FtError
from ft_client.integrations import lightning as ftl


def test_the_reference_classes_take_the_references_arguments() -> None:
    assert list(inspect.signature(ftl.FaultToleranceCallback).parameters) == [
        "autoresume", "calculate_timeouts", "simulated_fault_params", "exp_dir", "logger_name"]
    assert list(inspect.signature(ftl.FaultToleranceSectionsCallback).parameters) == [
        "autoresume", "calculate_timeouts", "simulated_fault_params", "exp_dir", "logger_name", "exc_handling_policy"]
    assert not ftl.FaultToleranceCallback(autoresume=False, calculate_timeouts=True).sections
    assert ftl.FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=False).sections


def test_autoresume_needs_the_finished_flag_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ftl.FINISHED_FLAG_ENV, raising=False)
    with pytest.raises(ftl.LightningIntegrationError, match=ftl.FINISHED_FLAG_ENV) as e:
        ftl.FtCallback(autoresume=True)
    assert isinstance(e.value, FtError)
    monkeypatch.setenv(ftl.FINISHED_FLAG_ENV, "/tmp/finished")
    assert ftl.FtCallback(autoresume=True).autoresume


@pytest.mark.parametrize("bad", [{"fault_type": "explode", "base_delay": 1}, {"base_delay": 1}, {"nope": 1}])
def test_a_simulated_fault_that_is_not_one_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ftl.LightningIntegrationError):
        ftl.FtCallback(simulated_fault_params=bad)
    params = ftl.FtCallback(simulated_fault_params={"fault_type": "rank_hung", "base_delay": 2}).simulated_fault_params
    assert params == ftl.SimulatedFaultParams("rank_hung", 2)


def test_before_fit_the_state_is_empty_and_a_checkpoints_state_waits_for_the_client() -> None:
    cb = ftl.FtCallback()
    assert cb.state_dict() == {} and not cb.is_initialized and cb.fault_tol_client is None
    cb.load_state_dict({"ft_client": {"format_version": 1}})
    assert cb._pending_state == {"ft_client": {"format_version": 1}}  # put in force by setup
    cb.load_state_dict({"something": "else"})  # not ours: ignored
    assert cb._pending_state == {"ft_client": {"format_version": 1}}


@pytest.mark.parametrize(("max_steps", "max_epochs", "step", "epoch", "done"), [
    (30, None, 30, 0, True), (30, None, 29, 0, False), (-1, 3, 100, 3, True), (-1, 3, 100, 2, False),
    (-1, None, 10**6, 10, False),
])
def test_training_is_complete_at_max_steps_or_max_epochs(max_steps: int, max_epochs: int | None, step: int,
                                                        epoch: int, done: bool) -> None:
    trainer = SimpleNamespace(max_steps=max_steps, max_epochs=max_epochs, global_step=step, current_epoch=epoch)
    assert ftl._completed(trainer) is done


class FakeClient:
    """What the callback calls on its client, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_section(self, name: str) -> None:
        self.calls.append(f"start {name}")

    def end_section(self, name: str) -> None:
        self.calls.append(f"end {name}")

    def end_all_sections(self) -> None:
        self.calls.append("end all")

    def send_heartbeat(self) -> None:
        self.calls.append("beat")

    def shutdown_workload_monitoring(self) -> None:
        self.calls.append("shutdown")


def _with_client(cb: ftl.FtCallback) -> FakeClient:
    fake = FakeClient()
    cb.client = fake  # type: ignore[assignment]  # the part of RankMonitorClient the hooks use
    return fake


def test_a_step_cut_short_by_an_exception_is_not_counted_and_the_client_shuts_down() -> None:
    cb = ftl.FtCallback(calculate_timeouts=False)
    fake = _with_client(cb)
    trainer = SimpleNamespace(global_step=3, global_rank=0)
    cb.on_train_batch_start(trainer, None, None, 0)
    cb.on_exception(trainer, None, RuntimeError("boom"))
    assert fake.calls == ["start step", "end all", "shutdown"] and cb.client is None


@pytest.mark.parametrize(("batches", "step", "done"), [(0, 7, True), (1, 7, True), (2, 7, False), (2, 10, True)])
def test_the_finished_flag_after_max_steps_or_a_run_that_had_nothing_left(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, batches: int, step: int, done: bool) -> None:
    flag = tmp_path / "finished"
    monkeypatch.setenv(ftl.FINISHED_FLAG_ENV, str(flag))
    cb = ftl.FtCallback(autoresume=True, calculate_timeouts=False)
    _with_client(cb)
    cb.batches = batches
    trainer = SimpleNamespace(global_rank=0, max_steps=10, max_epochs=None, global_step=step, current_epoch=0)
    cb.teardown(trainer, None, "fit")
    assert flag.exists() is done and cb.client is None


def test_the_finished_flag_is_not_touched_through_a_planted_symlink(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Security round 4: ``Path.touch`` followed a link at the flag's path (creating its target)."""
    flag, target = tmp_path / "finished", tmp_path / "elsewhere"
    flag.symlink_to(target)
    monkeypatch.setenv(ftl.FINISHED_FLAG_ENV, str(flag))
    cb = ftl.FtCallback(autoresume=True, calculate_timeouts=False)
    _with_client(cb)
    cb.teardown(SimpleNamespace(global_rank=0, max_steps=10, max_epochs=None, global_step=10, current_epoch=0),
                None, "fit")
    assert not target.exists() and flag.is_symlink()
    assert f"cannot touch {flag} (the finished flag): {flag} is a symbolic link" in caplog.text


def test_validate_and_test_stages_are_left_alone() -> None:
    """The reference's test_eval_with_callback: `trainer.validate` / `trainer.test` neither
    connect nor report (setup only acts in `fit`)."""
    cb = ftl.FtCallback()
    trainer = SimpleNamespace(global_rank=0, global_step=0)
    for stage in ("validate", "test", "predict"):
        cb.setup(trainer, None, stage)
        cb.on_validation_batch_start(trainer, None, None, 0)
        cb.on_validation_batch_end(trainer, None, None, None, 0)
        cb.teardown(trainer, None, stage)
    assert cb.client is None and cb.batches == 0


@pytest.mark.parametrize("bad", [-1, 2.5, "16", True])
def test_snapshot_every_is_a_whole_number_of_steps(bad: object) -> None:
    with pytest.raises(ftl.LightningIntegrationError, match="snapshot_every"):
        ftl.FtCallback(snapshot_every=bad)  # type: ignore[arg-type]


class FakeConnector:
    """Lightning's checkpoint connector, as far as the snapshot's seam goes: ``resume_start``
    loads the file checkpoint (global step ``file_step``, None: no file) and ``dump_checkpoint``
    gives what a save would write."""

    def __init__(self, file_step: int | None) -> None:
        self.file_step = file_step
        self._loaded_checkpoint: dict[str, object] | None = None
        self.callbacks: list[ftl.FtCallback] = []  # their on_save_checkpoint, called as Lightning's dump calls it

    def resume_start(self, checkpoint_path: str | None = None, weights_only: bool | None = None) -> None:
        if self.file_step is not None:
            self._loaded_checkpoint = {"global_step": self.file_step, "from": "file"}

    def dump_checkpoint(self, weights_only: bool = False) -> dict[str, object]:
        checkpoint = {"global_step": 16, "state_dict": {}, "hyper_parameters": {"odd": object()},
                      "hparams_name": "kwargs"}
        for cb in self.callbacks:
            cb.on_save_checkpoint(SimpleNamespace(global_step=16), None, checkpoint)
        return checkpoint


@pytest.mark.parametrize(("file_step", "taken"), [(None, "snapshot"), (10, "snapshot"), (16, "file"), (20, "file")])
def test_the_newer_of_the_snapshot_and_the_file_checkpoint_is_resumed(
        monkeypatch: pytest.MonkeyPatch, file_step: int | None, taken: str) -> None:
    monkeypatch.setattr(ftl.snapshot, "restore", lambda: (16, {"global_step": 16, "from": "snapshot"}))
    trainer = SimpleNamespace(_checkpoint_connector=FakeConnector(file_step))
    cb = ftl.FtCallback(snapshot_every=8)
    cb._offer_snapshot(trainer)
    connector = trainer._checkpoint_connector
    connector.resume_start("last.ckpt")
    assert connector._loaded_checkpoint is not None and connector._loaded_checkpoint["from"] == taken
    assert connector.resume_start == FakeConnector.resume_start.__get__(connector)  # unwrapped after one load


def test_no_snapshot_leaves_lightnings_loading_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ftl.snapshot, "restore", lambda: None)
    trainer = SimpleNamespace(_checkpoint_connector=FakeConnector(10))
    ftl.FtCallback(snapshot_every=8)._offer_snapshot(trainer)
    assert "resume_start" not in vars(trainer._checkpoint_connector)


def test_a_snapshot_holds_the_checkpoint_without_its_hyperparameters_and_is_no_save(
        monkeypatch: pytest.MonkeyPatch) -> None:
    saved: list[tuple[int, dict[str, object]]] = []
    monkeypatch.setattr(ftl.snapshot, "save", lambda step, state: saved.append((step, state)) or True)
    cb = ftl.FtCallback(snapshot_every=8)
    cb.client = FakeClient()  # type: ignore[assignment]
    trainer = SimpleNamespace(_checkpoint_connector=FakeConnector(None), global_step=16)
    trainer._checkpoint_connector.callbacks.append(cb)
    cb.on_train_batch_end(trainer, None, None, None, 0)
    cb.on_train_batch_end(trainer, None, None, None, 1)  # the same step (gradient accumulation): saved once
    assert [(step, sorted(state)) for step, state in saved] == [(16, ["global_step", "state_dict"])]
    assert cb._saved_at is None  # dump_checkpoint's on_save_checkpoint hooks: not a checkpoint written


def test_a_state_a_snapshot_cannot_hold_stops_the_snapshots_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(step: int, state: object) -> bool:
        raise ftl.MemorySnapshotError("state['loops'] holds a set")
    monkeypatch.setattr(ftl.snapshot, "save", refuse)
    cb = ftl.FtCallback(snapshot_every=8)
    trainer = SimpleNamespace(_checkpoint_connector=FakeConnector(None), global_step=8)
    cb._save_snapshot(trainer, 8)
    assert cb.snapshot_every == 0
    assert "no more snapshots in this run" in caplog.text and "holds a set" in caplog.text


# -- the classes under the reference's names: its rules, lines and files ----------------------
class LearningClient(FakeClient):
    """FakeClient that also learns: each calculate_and_set_* call recorded, its timeouts those
    the reference's tests read (setup, step and checkpointing listed)."""

    rank = 0

    def __init__(self, sections: dict[str, float] | None = None) -> None:
        super().__init__()
        from ft_client.timeouts import Timeouts
        self.timeouts = Timeouts(initial_rank_heartbeat_timeout=4.0, rank_heartbeat_timeout=2.0,
                                 rank_section_timeouts=sections if sections is not None else
                                 {"setup": 20.0, "step": 5.0, "checkpointing": 15.0})

    @property
    def hb_timeouts(self) -> object:
        return self.timeouts.hb

    @property
    def section_timeouts(self) -> object:
        return self.timeouts.sections

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        from ft_client.timeouts import LEARNED_HB, LEARNED_INITIAL_HB
        self.calls.append("learn hb")
        self.timeouts = self.timeouts.with_updates(learned=frozenset({LEARNED_HB, LEARNED_INITIAL_HB}))
        return True

    def calculate_and_set_section_timeouts(self, selected_sections: list[str] | None = None,
                                           calc_out_of_section: bool = True, skip_if_not_ready: bool = False) -> bool:
        from ft_client.timeouts import LEARNED_OUT_OF_SECTION, learned_section_key
        self.calls.append(f"learn {selected_sections} oos={calc_out_of_section}")
        learned = set(self.timeouts.learned) | {learned_section_key(s) for s in selected_sections or ()}
        if calc_out_of_section:
            learned.add(LEARNED_OUT_OF_SECTION)
        self.timeouts = self.timeouts.with_updates(rank_out_of_section_timeout=5.0, learned=frozenset(learned))
        return True

    def state_dict(self) -> dict[str, object]:
        return {"format_version": 1, "timeouts": self.timeouts.to_wire()}


def _trainer(step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_rank=0, global_step=step, max_steps=-1, max_epochs=None, current_epoch=0,
                           strategy=SimpleNamespace())


def _run(cb: ftl.FtCallback, batches: int, *, resumed: bool, save_at: tuple[int, ...] = (),
         client: LearningClient | None = None) -> LearningClient:
    """``batches`` training batches through the hooks, a save after each step in ``save_at``."""
    fake = client or LearningClient()
    cb.client = fake  # type: ignore[assignment]
    cb._connected(_trainer())
    if resumed:
        cb.on_load_checkpoint(_trainer(), None, {})
    cb.on_train_start(_trainer(), None)
    for step in range(1, batches + 1):
        cb.on_train_batch_start(_trainer(step), None, None, step)
        cb.on_train_batch_end(_trainer(step), None, None, None, step)
        if step in save_at:
            cb.on_save_checkpoint(_trainer(step), None, {})
    return fake


def test_the_reference_classes_keep_the_references_file_names_and_ours_keeps_its_own() -> None:
    assert ftl.FaultToleranceCallback.TIMEOUTS_FILENAME == "_ft_state.json"
    assert ftl.FaultToleranceSectionsCallback.TIMEOUTS_FILENAME == "_ft_state_.json"
    assert ftl.FtCallback.TIMEOUTS_FILENAME == ftl.TIMEOUTS_FILENAME == "_ft_state_.json"
    from ft_client import RankMonitorClient
    assert RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY == "current_timeouts"


def test_the_heartbeat_class_learns_nothing_in_a_fresh_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    cb = ftl.FaultToleranceCallback(autoresume=False, calculate_timeouts=True, exp_dir=tmp_path)
    fake = _run(cb, 10, resumed=False, save_at=(5,))
    cb.teardown(_trainer(10), None, "fit")
    assert "learn hb" not in fake.calls and "Updat" not in caplog.text
    assert not (tmp_path / "_ft_state.json").exists()


def test_the_heartbeat_class_learns_once_at_the_end_of_a_resumed_run_that_saved(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import json
    caplog.set_level("INFO")
    cb = ftl.FaultToleranceCallback(autoresume=False, calculate_timeouts=True, exp_dir=tmp_path)
    fake = _run(cb, 10, resumed=True, save_at=(5, 8))
    assert "learn hb" not in fake.calls  # not after a save: only at the end
    assert fake.calls.count("beat") == 1 + 10 + 2  # train start, each batch, each save
    cb.on_train_end(_trainer(10), None)
    cb.teardown(_trainer(10), None, "fit")
    assert fake.calls[-3:] == ["beat", "learn hb", "shutdown"]  # the end's heartbeat, then learning
    assert "[FaultToleranceCallback@rank0] Updating FT timeouts..." in caplog.text
    assert "[FaultToleranceCallback@rank0] Updated FT timeouts. New values: " in caplog.text
    state = json.loads((tmp_path / "_ft_state.json").read_text())
    assert state["format_version"] == 1 and state["current_timeouts"]["heartbeat"]["were_calculated"]
    assert cb.state_dict() == {}  # with exp_dir, its file is the one store


@pytest.mark.parametrize(("exception", "learns"), [(SystemExit(0), True), (SystemExit(1), False),
                                                   (ValueError("x"), False)])
def test_the_reference_classes_learn_on_sys_exit_0_and_ours_does_not(exception: BaseException, learns: bool) -> None:
    cb = ftl.FaultToleranceCallback(autoresume=False, calculate_timeouts=True)
    fake = _run(cb, 10, resumed=True, save_at=(5,))
    cb.on_exception(_trainer(10), None, exception)
    assert ("learn hb" in fake.calls) is learns and cb.client is None
    sections = ftl.FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=True)
    fake = _run(sections, 20, resumed=True, save_at=(5,))
    fake.calls.clear()
    sections.on_exception(_trainer(20), None, exception)
    assert any(c.startswith("learn ['setup'") for c in fake.calls) is learns
    ours = ftl.FtCallback(sections=False)
    fake = _run(ours, 10, resumed=True)
    ours.on_exception(_trainer(10), None, exception)
    assert "learn hb" not in fake.calls


def test_the_sections_class_learns_after_each_save_and_at_the_end_as_the_reference(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import json
    caplog.set_level("INFO")
    cb = ftl.FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=True, exp_dir=tmp_path)
    fake = _run(cb, 30, resumed=False, save_at=(10, 20))
    cb.teardown(_trainer(30), None, "fit")
    learned = [c for c in fake.calls if c.startswith("learn")]
    # step 11 (after the save at 10: not yet 16 iterations), 21, and the end; no setup (fresh) nor oos
    assert learned == ["learn ['checkpointing'] oos=False", "learn ['step', 'checkpointing'] oos=False",
                       "learn ['step', 'checkpointing'] oos=False"]
    assert caplog.text.count("Updating FT timeouts") == 3
    state = json.loads((tmp_path / "_ft_state_.json").read_text())["current_timeouts"]["section"]
    assert state["calculated_sections"] == ["checkpointing", "step"] and not state["is_out_of_section_calculated"]
    resumed = ftl.FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=True, exp_dir=tmp_path)
    fake = _run(resumed, 30, resumed=True, save_at=(25,))
    resumed.teardown(_trainer(30), None, "fit")
    assert [c for c in fake.calls if c.startswith("learn")][-1] == "learn ['setup', 'step', 'checkpointing'] oos=True"


def test_the_sections_class_learns_nothing_after_a_failure() -> None:
    cb = ftl.FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=True)
    fake = _run(cb, 20, resumed=True)
    cb.on_exception(_trainer(20), None, RuntimeError("boom"))
    assert not [c for c in fake.calls if c.startswith("learn")] and cb.client is None


@pytest.mark.parametrize("listed", [{}, {"setup": 1.0, "step": 1.0, "checkpointing": 1.0, "unexpected_section": 2.0}])
def test_the_sections_class_refuses_a_config_without_exactly_its_sections(listed: dict[str, float]) -> None:
    cb = ftl.FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=True)
    fake = LearningClient(listed)
    cb.client = fake  # type: ignore[assignment]
    with pytest.raises(ValueError, match="needs exactly checkpointing, setup, step") as e:
        cb._connected(_trainer())
    assert isinstance(e.value, ftl.LightningIntegrationError) and isinstance(e.value, FtError)
    assert cb.client is None and fake.calls == ["shutdown"]
