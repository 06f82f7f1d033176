"""A Hugging Face Trainer under ft-launcher, for real (issue 41): examples/train_hf.py, a plain
Trainer script whose only ft-monitor line is `FtTrainerCallback()`, 2 ranks of DDP on gloo.

One scenario, every fact checked. Rank 1 hangs inside its training step 12: every output (the
summary's hang, the verdict, the diagnosis, error.json) names rank 1, the step count is the
Trainer's ``global_step``, the step timeout that caught it is the one learned before the
Trainer's checkpoint-10 and kept in its ``trainer_state.json``, both ranks resume from that
checkpoint and finish; and a fresh launcher resuming from the same output_dir catches a hang
before its first save with the timeout the first job learned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.launchers import Launcher, final_losses, restarted_once_for_a_sigkill, run_to_success
from tests.procs import ROOT

pytestmark = pytest.mark.e2e

SCRIPT = str(ROOT / "examples" / "train_hf.py")
CONFIG = ("--ft-cfg-path", str(ROOT / "examples" / "ft_hf.yaml"))
CONFIGURED_STEP_TIMEOUT = 60.0  # examples/ft_hf.yaml, until learned


def _run(workdir: Path, name: str, *train_args: str) -> Launcher:
    return run_to_success(workdir, "--max-restarts", "1", *CONFIG, name=name, entry=(SCRIPT,), train_args=train_args,
                          preload=("transformers", "ft_client.integrations.transformers"))


def _ft_state(checkpoint: Path) -> dict[str, Any]:
    """The callback's learned timeouts in a Trainer checkpoint folder (trainer_state.json)."""
    trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
    state: dict[str, Any] = trainer_state["stateful_callbacks"]["FtTrainerCallback"]["ft_client"]
    assert trainer_state["global_step"] == state["iteration"]  # the monitor's count is the Trainer's
    return state


def _one_connection_per_rank(la: Launcher) -> None:
    """Each monitor saw one connection per attempt, its rank's: the callback connects once."""
    logs = sorted(la.log_dir.rglob("monitor.log"))
    assert len(logs) == 4  # 2 ranks, 2 attempts
    for log in logs:
        assert log.read_text().count(" connected (session") == 1, log.read_text()


@pytest.mark.compat
def test_a_trainer_job_whose_rank_hangs_is_named_resumed_from_its_checkpoint_and_keeps_learned_timeouts(
        workdir: Path) -> None:
    first = _run(workdir, "first", "--hang", "rank=1,step=12,attempt=0")
    out = first.output()
    for r in (0, 1):
        assert f"[rank {r}] attempt 1: resumed at step 10" in out, out[-4000:]  # checkpoint-10
        assert f"[rank {r}] attempt 1: finished 30 steps" in out
    (hang,) = first.summary()["hangs"]
    assert (hang["rank"], hang["attempt"], hang["section"]) == (1, 0, "step")
    assert hang["iteration"] == 12  # the optimizer steps the Trainer completed (global_step 12)
    assert hang["verdict"].startswith("rank 1 is not in a collective (train_hf.py:"), hang["verdict"]
    assert "in write_metrics_to_stuck_filesystem" in hang["verdict"] and "rank 0 waits in backward" in hang["verdict"]
    diagnosis = json.loads(Path(hang["diagnosis"]).read_text())
    assert (diagnosis["verdict"]["behind"], diagnosis["verdict"]["waiting"]) == ([1], [0])
    assert "write_metrics_to_stuck_filesystem" in Path(hang["stack_dump"]).read_text()
    error = json.loads(Path(hang["error_file"]).read_text())
    assert Path(hang["error_file"]).parent.name == "1" and "RankHang" in error["message"]["message"]
    assert "(rank 1," in error["message"]["message"]
    _one_connection_per_rank(first)

    # what caught it: the step timeout learned before checkpoint-10 was written, kept in it
    ckpt = workdir / "ckpt"
    at_10 = _ft_state(ckpt / "checkpoint-10")
    assert "section:step" in at_10["timeouts"]["learned"], at_10
    assert hang["timeout_s"] == pytest.approx(at_10["timeouts"]["rank_section_timeouts"]["step"])
    assert hang["timeout_s"] < CONFIGURED_STEP_TIMEOUT
    at_30 = _ft_state(ckpt / "checkpoint-30")
    assert {"section:step", "section:checkpointing"} <= set(at_30["timeouts"]["learned"]), at_30
    learned = at_30["timeouts"]["rank_section_timeouts"]["step"]

    # A fresh job from the same output_dir resumes from checkpoint-30; its hang at step 33 comes
    # before its first save (35), so the timeout that catches it is the one the first job learned
    second = _run(workdir, "second", "--steps", "40", "--hang", "rank=1,step=33,attempt=0")
    out = second.output()
    assert "[rank 1] attempt 0: resumed at step 30" in out, out[-4000:]
    (hang,) = second.summary()["hangs"]
    assert (hang["rank"], hang["attempt"], hang["section"], hang["iteration"]) == (1, 0, "step", 33)
    assert hang["timeout_s"] == pytest.approx(learned) and hang["timeout_s"] < CONFIGURED_STEP_TIMEOUT
    assert "[rank 0] attempt 1: resumed at step 30" in out and "[rank 0] attempt 1: finished 40 steps" in out


def test_a_rank_killed_with_sigkill_resumes_from_the_snapshot_with_the_loss_of_a_run_without_it(
        workdir: Path) -> None:
    """`FtTrainerCallback(snapshot_every=6)`: rank 1 SIGKILLs itself at step 19, after the
    Trainer's checkpoint-10 and the snapshot at 18; the restart resumes from the snapshot,
    written out as checkpoint-18 (the Trainer resumes from folders only), mid-epoch (an epoch is
    16 steps; the Trainer skips the batches already trained on), and ends with the loss of the
    run without the fault."""
    steps = ("--steps", "24", "--ckpt-every", "10")
    clean = _run(workdir, "clean", *steps, "--ckpt-dir", str(workdir / "ckpt-clean"))
    baseline = final_losses(clean.output())
    assert set(baseline) == {"0", "1"}, clean.output()[-3000:]
    out_dir = workdir / "ckpt-killed"
    killed = _run(workdir, "killed", *steps, "--snapshot-every", "6", "--die", "rank=1,step=19,attempt=0",
                  "--ckpt-dir", str(out_dir))
    out = killed.output()
    assert f"resuming from the in-memory snapshot of step 18, written out as {out_dir}/checkpoint-18 (the last " \
           f"checkpoint folder was {out_dir}/checkpoint-10)" in out, out[-4000:]
    for r in (0, 1):
        assert f"[rank {r}] attempt 1: resumed at step 18" in out
    assert final_losses(out) == baseline
    restarted_once_for_a_sigkill(killed, 1)
    _ft_state(out_dir / "checkpoint-18")  # the learned timeouts came with the snapshot
