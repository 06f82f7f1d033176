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
