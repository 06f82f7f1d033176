"""ft_client.integrations.transformers without a monitor or another process: the callback's
arguments, the helpers it decides with, the calls it makes in the order the Trainer calls its
hooks (gradient accumulation, a save, an evaluation), and a real one-process Trainer that
writes and resumes checkpoints with a stand-in client (the real run under ft-launcher:
tests/test_transformers_e2e.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ft_client import FtError
from ft_client.integrations import transformers as fth
from ft_client.integrations.sections import sections_to_learn


class FakeClient:
    """Stands for RankMonitorClient: records the calls the callback makes."""

    instances: list[FakeClient] = []

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.loaded: list[dict[str, Any]] = []
        self.iteration = 0
        self.timeouts = type("T", (), {"rank_section_timeouts": {"setup": 180.0, "step": 60.0,
                                                                  "checkpointing": 120.0}})()
        FakeClient.instances.append(self)

    def init_workload_monitoring(self) -> None:
        self.calls.append(("init",))

    def start_section(self, name: str) -> None:
        self.calls.append(("start", name))

    def end_section(self, name: str) -> None:
        self.calls.append(("end", name))
        self.iteration += name == "step"

    def end_all_sections(self) -> None:
        self.calls.append(("end_all",))

    def send_heartbeat(self) -> None:
        self.calls.append(("beat",))

    def calculate_and_set_section_timeouts(self, selected_sections: list[str], calc_out_of_section: bool,
                                           skip_if_not_ready: bool) -> bool:
        self.calls.append(("learn", tuple(selected_sections), calc_out_of_section))
        return True

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool) -> bool:
        self.calls.append(("learn_hb",))
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"format_version": 1, "iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append(("load", state["iteration"]))
        self.loaded.append(state)

    def shutdown_workload_monitoring(self) -> None:
        self.calls.append(("shutdown",))


ARGS: Any = None
"""The TrainingArguments the hooks get: the callback never reads them."""


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeClient]]:
    FakeClient.instances = []
    monkeypatch.setattr(fth, "RankMonitorClient", FakeClient)
    yield FakeClient


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"sections": 1}, "sections"), ({"calculate_timeouts": "yes"}, "calculate_timeouts"),
    ({"logger_name": 3}, "logger_name"),
])
def test_arguments_that_are_not_what_they_must_be_are_refused(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(fth.TransformersIntegrationError, match=name) as e:
        fth.FtTrainerCallback(**kwargs)
    assert isinstance(e.value, FtError) and isinstance(e.value, ValueError)
    assert issubclass(fth.TransformersMissingError, FtError) and issubclass(fth.TransformersMissingError, ImportError)


def test_the_state_holds_the_arguments_the_trainer_rebuilds_the_callback_from() -> None:
    cb = fth.FtTrainerCallback(sections=False, calculate_timeouts=False, logger_name=None)
    state = cb.state()
    assert state == {"args": {"sections": False, "calculate_timeouts": False, "snapshot_every": 0, "logger_name": None},
                     "attributes": {}}
    again = fth.FtTrainerCallback(**state["args"])  # what Trainer._load_callback_state does
    assert (again.sections, again.calculate_timeouts, again.logger_name) == (False, False, None)
    assert cb.client is None and fth.STATE_KEY not in state  # nothing learned before train()


def test_the_saved_state_is_found_under_the_callbacks_name_in_one_entry_or_a_list() -> None:
    ft = {"format_version": 1, "iteration": 10}
    assert fth.saved_state({"FtTrainerCallback": {"args": {}, fth.STATE_KEY: ft}}, "FtTrainerCallback") == ft
    assert fth.saved_state({"FtTrainerCallback": [{"args": {}}, {fth.STATE_KEY: ft}]}, "FtTrainerCallback") == ft
    nothing: object
    for nothing in ({}, {"TrainerControl": {"args": {}}}, {"FtTrainerCallback": {"args": {}}},
                    {"FtTrainerCallback": {fth.STATE_KEY: "not a dict"}}, None, []):
        assert fth.saved_state(nothing, "FtTrainerCallback") is None


def test_transformers_older_than_4_45_is_refused_by_its_release_number() -> None:
    assert fth.release("4.44.2") < fth.MIN_TRANSFORMERS <= fth.release("4.45.0.dev0") <= fth.release("5.24.0")


def test_the_sections_learned_are_the_listed_ones_and_setup_only_after_a_resume() -> None:
    listed = {"checkpointing": 1.0, "step": 1.0, "setup": 1.0, "other": 1.0}
    assert sections_to_learn(listed, resumed=False) == ["step", "checkpointing"]
    assert sections_to_learn(listed, resumed=True) == ["setup", "step", "checkpointing"]
    assert sections_to_learn({"validation": 1.0}, resumed=False) == ["validation"]
    assert sections_to_learn({}, resumed=True) == []


def _steps(cb: fth.FtTrainerCallback, args: Any, state: TrainerState, control: TrainerControl, steps: int,
           accumulation: int, save_every: int) -> None:
    """The Trainer's hooks for ``steps`` optimizer steps, in its order (Trainer._run_epoch)."""
    for _ in range(steps):
        control.should_save = False  # CallbackHandler.on_step_begin resets it
        cb.on_step_begin(args, state, control)
        for _ in range(accumulation - 1):
            cb.on_substep_end(args, state, control)
        state.global_step += 1
        control.should_save = state.global_step % save_every == 0  # DefaultFlowCallback.on_step_end
        cb.on_step_end(args, state, control)
        if control.should_save:
            cb.on_save(args, state, control)


def test_a_step_is_an_optimizer_step_and_a_write_is_bracketed_and_learned_before(fake_client: type[FakeClient]) -> None:
    cb, args = fth.FtTrainerCallback(), ARGS
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control)
    _steps(cb, args, state, control, steps=3, accumulation=2, save_every=2)
    cb.on_train_end(args, state, control)
    (client,) = fake_client.instances
    step = [("start", "step"), ("beat",), ("end", "step"), ("beat",)]  # one heartbeat a micro-batch
    save = [("learn", ("step", "checkpointing"), False), ("start", "checkpointing"), ("end", "checkpointing"),
            ("beat",)]
    assert client.calls == [("init",), ("start", "setup"), ("beat",), ("end", "setup"), *step, *step, *save, *step,
                            ("learn", ("step", "checkpointing"), True), ("shutdown",)]
    assert cb.client is None and cb.steps == 3 and client.iteration == 3
    # the Trainer's save would fail on a resumed state without the callback's entry: it has one
    saved: Any = state.stateful_callbacks  # a dict of entries (typed a list in transformers)
    assert saved["FtTrainerCallback"]["args"]["sections"] is True


def test_an_evaluation_before_a_save_is_timed_apart_from_the_write(fake_client: type[FakeClient]) -> None:
    cb, args = fth.FtTrainerCallback(), ARGS
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control)
    cb.on_step_begin(args, state, control)
    state.global_step = 1
    control.should_evaluate = control.should_save = True
    cb.on_step_end(args, state, control)
    for _ in range(2):
        cb.on_prediction_step(args, state, control)
    control.should_evaluate = False
    cb.on_evaluate(args, state, control)
    cb.on_save(args, state, control)
    (client,) = fake_client.instances
    assert client.calls[:7] == [("init",), ("start", "setup"), ("beat",), ("end", "setup"), ("start", "step"),
                                ("end", "step"), ("beat",)]
    assert client.calls[7:] == [
        ("start", "validation"), ("end", "validation"), ("beat",), ("start", "validation"), ("end", "validation"),
        ("beat",), ("start", "validation"), ("end", "validation"), ("beat",),
        ("learn", ("step", "checkpointing"), False), ("start", "checkpointing"), ("end", "checkpointing"), ("beat",)]


def test_a_save_no_hook_announced_is_learned_from_after_it(fake_client: type[FakeClient]) -> None:
    cb, args = fth.FtTrainerCallback(sections=False), ARGS
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control)
    cb.on_save(args, state, control)  # save_strategy="best": decided after the evaluation
    (client,) = fake_client.instances
    assert client.calls == [("init",), ("beat",), ("beat",), ("learn_hb",)]  # heartbeats only: no sections


class Samples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((4,), float(i) / 64), "labels": torch.ones(1)}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


def _train(out: Path, steps: int, callbacks: list[Any], resume: bool, restore: bool = False) -> Trainer:
    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=2, per_device_train_batch_size=4,
                             use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1000,
                             restore_callback_states_from_checkpoint=restore)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Samples(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def test_a_real_trainer_keeps_the_state_in_its_checkpoint_and_resumes_with_it(
        fake_client: type[FakeClient], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a checkpoint written without the callback: resuming with it must not break the next save
    _train(tmp_path, 2, [], resume=False)
    cb = fth.FtTrainerCallback()
    _train(tmp_path, 4, [cb], resume=True)
    (first,) = fake_client.instances
    assert ("load", 0) not in first.calls and first.calls[-1] == ("shutdown",)
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").is_file()
    # the next run reads the state checkpoint-4 holds: the learned timeouts and the step count
    with caplog.at_level(logging.INFO, logger="ft_client.transformers"):
        _train(tmp_path, 6, [fth.FtTrainerCallback()], resume=True)
    second = fake_client.instances[1]
    assert second.loaded == [{"format_version": 1, "iteration": 2}]  # the steps this callback counted: 3 and 4
    assert "timeouts from the checkpoint at step 4" in caplog.text
    # restore_callback_states_from_checkpoint: the Trainer replaces the callback given by one
    # built from the arguments in the checkpoint (sections=True here), which reads the state too
    mine = fth.FtTrainerCallback(sections=False)
    trainer = _train(tmp_path, 8, [mine], resume=True, restore=True)
    third = fake_client.instances[2]
    assert third.loaded == [{"format_version": 1, "iteration": 2}] and third.calls[:2] == [("init",), ("load", 2)]
    rebuilt = [c for c in trainer.callback_handler.callbacks if isinstance(c, fth.FtTrainerCallback)]
    assert len(rebuilt) == 1 and rebuilt[0] is not mine and rebuilt[0].sections is True and rebuilt[0].steps == 2
    assert mine.client is None and mine.steps == 0  # the instance given never ran


class MemorySnapshots:
    """Stands for the monitor's memory: what `snapshot.save` is given goes through the real tree
    and layout (flatten, encode, decode, rebuild: what a snapshot can hold and gives back), and
    `restore` returns the newest."""

    def __init__(self) -> None:
        self.held: tuple[int, Any] | None = None

    def save(self, step: int, state: Any) -> bool:
        from ft_client.snapshot import format as fmt
        from ft_client.snapshot.tree import flatten, lay_out, rebuild

        tensors: list[torch.Tensor] = []
        tree = flatten(state, "state", tensors)
        specs, data_len = lay_out(tensors)
        decoded, _ = fmt.decode_layout(fmt.encode_layout(tree, specs), data_len)
        self.held = (step, rebuild(decoded, [t.clone() for t in tensors]))
        return True

    def restore(self) -> tuple[int, Any] | None:
        return self.held


def test_a_real_trainer_resumes_from_a_snapshot_written_out_as_its_checkpoint_folder(
        fake_client: type[FakeClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    memory = MemorySnapshots()
    monkeypatch.setattr(fth.snapshot, "save", memory.save)
    monkeypatch.setattr(fth.snapshot, "restore", memory.restore)
    monkeypatch.setattr(fth.snapshot, "wait", lambda: None)
    torch.manual_seed(0)  # every run's model made alike
    clean = _train(tmp_path / "clean", 6, [], resume=False)

    class Killed(Exception):
        pass

    class KillAt(TrainerCallback):  # the process dies before step 5 ends: no save at the end of training
        def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
            if state.global_step == 4:
                raise Killed

    def run(steps: int, *callbacks: Any) -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path / "snap"), max_steps=steps, save_steps=100,
                                 per_device_train_batch_size=4, use_cpu=True, report_to=[], disable_tqdm=True,
                                 logging_steps=1000)
        torch.manual_seed(0)
        trainer = Trainer(model=Tiny(), args=args, train_dataset=Samples(), callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint=callbacks[0].checkpoint_to_resume(trainer))
        return trainer

    assert fth.FtTrainerCallback(snapshot_every=2).checkpoint_to_resume(
        Trainer(model=Tiny(), args=TrainingArguments(output_dir=str(tmp_path / "none"), use_cpu=True,
                                                     report_to=[]))) is None  # nothing held, no folder
    with pytest.raises(Killed):
        run(6, fth.FtTrainerCallback(snapshot_every=2), KillAt())  # snapshots at steps 2 and 4, no folder
    assert memory.held is not None and memory.held[0] == 4
    assert not list((tmp_path / "snap").glob("checkpoint-*"))
    with caplog.at_level(logging.WARNING, logger="ft_client.transformers"):
        resumed = run(6, fth.FtTrainerCallback(snapshot_every=2))
    assert f"resuming from the in-memory snapshot of step 4, written out as {tmp_path / 'snap'}/checkpoint-4" \
        in caplog.text
    assert {p.name for p in (tmp_path / "snap" / "checkpoint-4").iterdir()} >= {
        "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"}
    for a, b in zip(clean.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)  # the 6 steps of a run never stopped
    # a folder newer than the snapshot is resumed from as it is
    memory.held = (2, memory.held[1])
    assert fth.FtTrainerCallback(snapshot_every=2).checkpoint_to_resume(resumed) == str(tmp_path / "snap" /
                                                                                        "checkpoint-6")


OTHER_UID = 65534  # another local user (nobody)


def _plant_foreign_checkpoint(folder: Path, victims: dict[str, Path]) -> None:
    """Another user's ``checkpoint-N``: mode 0777, owned by uid 65534, its ``trainer_state.json``
    and ``rng_state.pth`` symlinks to files of the job's user."""
    folder.mkdir()
    folder.chmod(0o777)
    for name, target in victims.items():
        (folder / name).symlink_to(target)
        os.lchown(folder / name, OTHER_UID, OTHER_UID)
    os.chown(folder, OTHER_UID, OTHER_UID)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's folder needs root (chown)")
def test_a_real_trainer_never_writes_into_or_resumes_from_another_users_checkpoint_folder(
        fake_client: type[FakeClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Security round 4: ``output_dir`` is a shared folder (mode 1777). Another user put a
    ``checkpoint-9`` there before the run, and a ``checkpoint-3`` (the snapshot's step) while the
    ranks restored the snapshot, each mode 0777 with ``trainer_state.json`` and ``rng_state.pth``
    symlinked to files of the job's user. Before, ``checkpoint-9`` was handed to the Trainer, and
    the snapshot was written into ``checkpoint-3`` through the links. Now both are passed over
    with one warning each, the link targets are untouched, and the Trainer resumes from the
    job's own ``checkpoint-2``."""
    memory = MemorySnapshots()
    monkeypatch.setattr(fth.snapshot, "save", memory.save)
    monkeypatch.setattr(fth.snapshot, "wait", lambda: None)
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(0o1777)
    victims = {name: tmp_path / f"private-{name}" for name in ("trainer_state.json", "rng_state.pth")}
    for target in victims.values():
        target.write_bytes(b"the job user's own file\n")
        target.chmod(0o600)

    class Killed(Exception):
        pass

    class KillAt(TrainerCallback):  # dies before step 3's save: checkpoint-2 on disk, the snapshot of step 3
        def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
            if state.global_step == 3:
                raise Killed

    def trainer(*callbacks: Any) -> Trainer:
        args = TrainingArguments(output_dir=str(out), max_steps=6, save_steps=2, per_device_train_batch_size=4,
                                 use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1000)
        return Trainer(model=Tiny(), args=args, train_dataset=Samples(), callbacks=list(callbacks))

    with pytest.raises(Killed):
        trainer(fth.FtTrainerCallback(snapshot_every=1), KillAt()).train()
    assert memory.held is not None and memory.held[0] == 3 and (out / "checkpoint-2").is_dir()
    _plant_foreign_checkpoint(out / "checkpoint-9", victims)

    def restore() -> tuple[int, Any] | None:  # the other user's folder appears as the ranks restore
        _plant_foreign_checkpoint(out / "checkpoint-3", victims)
        return memory.held

    monkeypatch.setattr(fth.snapshot, "restore", restore)
    cb = fth.FtTrainerCallback(snapshot_every=1)
    resumed = trainer(cb)
    with caplog.at_level(logging.WARNING, logger="ft_client.transformers"):
        folder = cb.checkpoint_to_resume(resumed)
    assert folder == str(out / "checkpoint-2")
    st = os.stat(folder)
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022  # the job's own, writable by no one else
    for target in victims.values():
        assert target.read_bytes() == b"the job user's own file\n"
    assert os.stat(out / "checkpoint-3").st_uid == OTHER_UID and not list((out / "checkpoint-3").glob("*.safetensors"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "passing over checkpoint folders that are not this user's own" in warnings[0]
    assert f"{out / 'checkpoint-9'} belongs to uid {OTHER_UID}" in warnings[0]
    assert "the in-memory snapshot of step 3 is not written out" in warnings[1]
    assert f"{out / 'checkpoint-3'}: {out / 'checkpoint-3'} belongs to uid {OTHER_UID}" in warnings[1]
    resumed.train(resume_from_checkpoint=folder)  # the Trainer takes the folder and finishes
    assert resumed.state.global_step == 6


def test_snapshot_every_is_a_whole_number_of_steps() -> None:
    for bad in (-1, 2.5, True):
        with pytest.raises(fth.TransformersIntegrationError, match="snapshot_every"):
            fth.FtTrainerCallback(snapshot_every=bad)  # type: ignore[arg-type]
