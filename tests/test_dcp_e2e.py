"""torch.distributed.checkpoint under ft-launcher, for real (issue 41): examples/train_dcp.py, 2
ranks of DDP on gloo, checkpointing with ``dcp.save`` or ``dcp.async_save`` in the ``ckpt``
section. Rank 1's second save never finishes writing (its storage writer blocks): the hang is
attributed to rank 1 in every output, an async save's included, whose background work hangs
while both ranks' main threads wait alike for their futures; the job resumes from the last
complete checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ft_monitor.launcher import exit_codes
from tests.launchers import Launcher
from tests.procs import ROOT

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("how", ["sync", pytest.param("async", marks=pytest.mark.compat)])
def test_a_save_whose_writes_hang_is_attributed_to_its_rank_and_the_job_resumes(workdir: Path, how: str) -> None:
    la = Launcher(workdir, "--max-restarts", "1", name=how, entry=(str(ROOT / "examples" / "train_dcp.py"),),
                  train_args=("--stall-write", "rank=1,save=2,attempt=0", *(("--async-save",) if how == "async" else ())))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()[-6000:]
    finally:
        la.kill()
    out = la.output()
    for r in (0, 1):  # the stalled save (step 10) never completed: the one before it is resumed from
        assert f"[rank {r}] attempt 1: resumed at step 5" in out and f"[rank {r}] attempt 1: finished 30 steps" in out
    (hang,) = la.summary()["hangs"]
    assert (hang["rank"], hang["attempt"], hang["section"]) == (1, 0, "ckpt"), hang
    assert hang["timeout_s"] < 60  # learned from the saves before, not the config's
    verdict = json.loads(Path(hang["diagnosis"]).read_text())["verdict"]
    assert verdict["behind"] == [1] and verdict["waiting"] == [0], verdict
    assert "write_to_stuck_filesystem" in verdict["where"]
    if how == "async":  # both main threads wait in future.result(): the background saves tell them apart
        assert verdict["line"].startswith("rank 1 is not in a collective (its async checkpoint save at "), verdict
        assert "rank 0 waits in all_gather (its async checkpoint save" in verdict["line"]
    assert "write_to_stuck_filesystem" in Path(hang["stack_dump"]).read_text()
