"""PyTorch Lightning under ft-launcher, for real (issue 41): examples/train_lightning.py, a
plain Lightning script whose only ft-monitor line is `FtCallback()`, 2 ranks of DDP on gloo.

Two scenarios, every fact checked on each. A hang of rank 1 inside its training step (batches
loaded by 2 forked data-loader workers) is named rank 1 in every output (before, the verdict
named rank 0: Lightning runs ``training_step`` inside DDP's ``forward``), the job resumes from
Lightning's own ``last.ckpt``, the step count is the one Lightning ran, the learned timeouts
are in Lightning's checkpoint, and a fresh launcher put them in force from it before its
first save. A spawned data-loader worker of rank 1 that hangs is rank 1's hang, and the
verdict says it waits for a worker. In both, no worker ever spoke to the rank's monitor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ft_monitor.launcher import exit_codes
from tests.launchers import Launcher, final_losses, restarted_once_for_a_sigkill, run_to_success
from tests.procs import ROOT, launcher_summary

pytestmark = pytest.mark.e2e

SCRIPT = str(ROOT / "examples" / "train_lightning.py")
CONFIG = ("--ft-cfg-path", str(ROOT / "examples" / "ft_lightning.yaml"))
PRELOAD = ("lightning.pytorch", "ft_client.integrations.lightning")
"""Imported once by each launcher's worker template, not by every worker of every attempt."""


def _one_connection_per_rank(la: Launcher) -> None:
    """Each monitor saw one connection per attempt, its rank's: a data-loader worker (forked:
    its client detached; spawned: no client) never spoke for its rank."""
    logs = sorted(la.log_dir.rglob("monitor.log"))
    assert len(logs) >= 2
    for log in logs:
        assert log.read_text().count(" connected (session") == 1, log.read_text()


def _run(workdir: Path, name: str, *train_args: str, restarts: int = 1) -> Launcher:
    return run_to_success(workdir, "--max-restarts", str(restarts), *CONFIG, name=name, entry=(SCRIPT,),
                          train_args=train_args, preload=PRELOAD)


@pytest.mark.compat
def test_a_lightning_job_whose_rank_hangs_is_named_resumed_from_last_ckpt_and_keeps_learned_timeouts(
        workdir: Path) -> None:
    first = _run(workdir, "first", "--hang", "rank=1,step=12,attempt=0", "--workers", "2", "--worker-start", "fork")
    out = first.output()
    for r in (0, 1):
        assert f"[rank {r}] attempt 1: resumed at step 10" in out, out[-4000:]  # last.ckpt, saved at step 10
        assert f"[rank {r}] attempt 1: finished 30 steps" in out
    (hang,) = first.summary()["hangs"]
    assert (hang["rank"], hang["attempt"], hang["section"]) == (1, 0, "step")
    assert hang["iteration"] == 12  # the steps Lightning completed before the hang (global_step 12)
    assert hang["verdict"].startswith("rank 1 is not in a collective"), hang["verdict"]
    assert "rank 0 waits in backward" in hang["verdict"]
    assert "write_metrics_to_stuck_filesystem" in Path(hang["stack_dump"]).read_text()
    error = json.loads(Path(hang["error_file"]).read_text())
    assert Path(hang["error_file"]).parent.name == "1" and "RankHang" in error["message"]["message"]
    assert hang["timeout_s"] < 60  # learned after Lightning's checkpoints, not the 60 s of the config
    _one_connection_per_rank(first)

    ckpt = torch.load(workdir / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    state = ckpt["callbacks"]["FtCallback"]["ft_client"]
    assert "section:step" in state["timeouts"]["learned"], state
    learned = state["timeouts"]["rank_section_timeouts"]["step"]

    # A fresh job from the same checkpoint: its hang at step 33 comes before its first save (35),
    # so the timeout that catches it is the one Lightning's checkpoint brought back. Then rank 1
    # raises in attempt 1: Lightning runs its teardown (our callback's too) before the exception
    # ends the process, and the exception's story is in every output all the same
    second = _run(workdir, "second", "--steps", "40", "--hang", "rank=1,step=33,attempt=0",
                  "--raise", "rank=1,step=37,attempt=1", restarts=2)
    summary = second.summary()
    (hang,) = summary["hangs"]
    assert (hang["rank"], hang["iteration"]) == (1, 33)
    assert hang["timeout_s"] == pytest.approx(learned)
    out = second.output()
    assert "[rank 0] attempt 2: finished 40 steps" in out
    _check_the_exceptions_story(summary, out, rank=1, text="RuntimeError: rank 1 failed at step 37 (on purpose)",
                                frame="in training_step")


def _check_the_exceptions_story(summary: dict[str, object], out: str, rank: int, text: str, frame: str) -> None:
    """A rank that raised (a script without ``@record``) is named with its exception in the
    launcher's failure line, the summary's failure row and its printed lines, and its own
    error.json holds the exception's type, message and traceback, as ``@record`` writes it."""
    failures = [r for r in summary["restarts"] if r["cause"] == "failure"]  # type: ignore[attr-defined,index]
    (row,) = failures
    assert row["rank"] == rank and row["root_seen"] and text in row["how"], row
    assert f"ERROR ft-launcher: attempt {row['attempt']} failed: rank {rank} (pid " in out
    assert f"raised {text} and exited with code 1" in out
    error = json.loads(Path(row["error_file"]).read_text())
    assert Path(row["error_file"]).parent.name == str(rank)
    assert error["message"]["message"] == text
    callstack = error["message"]["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):") and frame in callstack, callstack
    lines = launcher_summary(out)
    assert ("error file", row["error_file"]) in lines, lines
    assert any(k == "failed" and v.startswith(f"rank {rank} (pid ") and text in v for k, v in lines), lines


def test_a_hung_spawned_data_loader_worker_is_its_ranks_hang_and_the_verdict_says_so(workdir: Path) -> None:
    la = _run(workdir, "workers", "--workers", "1", "--worker-start", "spawn",
              "--worker-hang", "rank=1,step=12,attempt=0")
    out = la.output()
    assert "[rank 1] data-loader worker pid" in out and "[rank 0] attempt 1: finished 30 steps" in out
    (hang,) = la.summary()["hangs"]
    assert (hang["rank"], hang["attempt"]) == (1, 0)
    verdict = hang["verdict"]
    assert verdict.startswith("rank 1 is not in a collective (waiting for a data-loader worker at dataloader.py:"), \
        verdict
    assert "rank 0 waits in backward" in verdict
    diagnosis = json.loads(Path(hang["diagnosis"]).read_text())
    assert diagnosis["verdict"]["behind"] == [1] and "data-loader worker" in diagnosis["verdict"]["where"]
    _one_connection_per_rank(la)


def test_a_compiled_models_first_steps_neither_trip_nor_inflate_the_learned_step_timeout(workdir: Path) -> None:
    """torch.compile (aot_eager: the same Dynamo and AOT autograd, no C++ build) makes each
    start's first step many times a step. The `warmup` entry times those steps, and the learning
    leaves them out: the step timeout learned is the compiled steps', shorter than the compile
    itself; after the restart the ranks compile again, under it, and nothing is read as a hang."""
    la = Launcher(workdir, "--max-restarts", "1", "--ft-cfg-path", str(ROOT / "examples" / "ft_lightning_compile.yaml"),
                  name="compiled", entry=(SCRIPT,), preload=PRELOAD,
                  train_args=("--compile", "aot_eager", "--hang", "rank=1,step=12,attempt=0"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()[-6000:]
    finally:
        la.kill()
    out = la.output()
    first = [float(m) for m in re.findall(r"first step took ([0-9.]+) s", out)]
    assert len(first) == 2, out[-3000:]  # attempt 1's ranks, which compiled again after the restart
    (hang,) = la.summary()["hangs"]  # the one made, not a compile
    assert (hang["rank"], hang["attempt"], hang["section"]) == (1, 0, "step")
    assert hang["timeout_s"] < min(first), (hang["timeout_s"], first)  # learned without the compile steps
    state = torch.load(workdir / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    observed = state["callbacks"]["FtCallback"]["ft_client"]["observations"]["sections"]["step"]
    assert observed < min(first)  # the longest step learned from is a compiled one, not the compile


def test_a_rank_killed_with_sigkill_resumes_from_the_snapshot_with_the_loss_of_a_run_without_it(
        workdir: Path) -> None:
    """`FtCallback(snapshot_every=16)`: rank 1 SIGKILLs itself at step 19, after ``last.ckpt``
    was written at step 10 and the snapshot at 16 (an epoch's end: the example's loader is not
    resumable mid-epoch, by the file or the snapshot); the restart takes the newer snapshot, and
    the run ends with the loss of the same run without the fault."""
    steps = ("--steps", "32", "--ckpt-every", "10")
    clean = _run(workdir, "clean", *steps, "--ckpt-dir", str(workdir / "ckpt-clean"))
    baseline = final_losses(clean.output())
    assert set(baseline) == {"0", "1"}, clean.output()[-3000:]
    killed = _run(workdir, "killed", *steps, "--snapshot-every", "16", "--die", "rank=1,step=19,attempt=0",
                  "--ckpt-dir", str(workdir / "ckpt-killed"))
    out = killed.output()
    assert "ft_client: resuming from the in-memory snapshot of step 16 (the file checkpoint is at step 10)" in out, \
        out[-4000:]
    for r in (0, 1):
        assert f"[rank {r}] attempt 1: resumed at step 16" in out
    assert final_losses(out) == baseline
    restarted_once_for_a_sigkill(killed, 1)


def test_a_forgotten_config_is_a_configuration_error_that_spends_no_restart(workdir: Path) -> None:
    """A new user's reference-style script without the config its callback needs spent all its restarts (about
    50 s) on the same deterministic refusal, then exited 1: a configuration error is not a fault,
    so the launcher stops at once with the configuration exit code, and says why in one line."""
    la = Launcher(workdir, "--max-restarts", "3", "--nproc-per-node", "1", name="noconfig",
                  entry=(str(ROOT / "tests" / "workers" / "lightning_sections.py"),), preload=PRELOAD[:1])
    try:
        assert la.wait() == exit_codes.LAUNCHER_ERROR, la.output()[-4000:]
    finally:
        la.kill()
    out = la.output()
    assert out.count("attempt 0: starting") == 1 and "attempt 1: starting" not in out, out[-4000:]
    said = [line for line in out.splitlines() if "ERROR ft-launcher: configuration error on rank 0: " in line]
    assert len(said) == 1 and "FaultToleranceSectionsCallback needs exactly" in said[0], out[-4000:]
    summary = la.summary()
    assert summary["restarts"] == [] and summary["exit_code"] == exit_codes.LAUNCHER_ERROR
    assert summary["outcome"].startswith("configuration error on rank 0: ")
