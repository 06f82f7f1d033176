"""End-to-end: in-memory snapshots of FSDP2-sharded state (DTensors) under a real ft-launcher.

examples/train_fsdp2.py trains a tiny MLP sharded with ``fully_shard`` (each Linear and the
root) on 2 ranks (gloo, CPU) with Adam, saving a snapshot after every step: its parameters and
Adam's moments are DTensors, each rank saving only its own shard. Rank 1 SIGKILLs itself
mid-run; the launcher restarts the group, both ranks restore the same step's shards as
DTensors on the new model's device mesh. In that attempt rank 1 hangs in its ``step``
section: the hang is found, the verdict names rank 1 with rank 0 waiting in FSDP2's
all-gather, and the next attempt resumes from the snapshot again. Both ranks end with the
final losses of the same run without the faults, which runs beside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ft_client import torch_features
from ft_monitor.launcher import exit_codes
from tests.launchers import Launcher, final_losses
from tests.procs import ROOT, slack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ENTRY = (str(ROOT / "examples" / "train_fsdp2.py"),)
TRAIN = ("--snapshot-every", "1", "--steps", "24")


def _resumed(out: str) -> dict[str, tuple[int, int, str]]:
    """rank -> (the step it resumed at from a snapshot, how many DTensors it restored, on which mesh)."""
    return {r: (int(s), int(n), where) for r, s, n, where in re.findall(
        r"\[rank (\d+)\] [^\[\n]*?resumed at step (\d+) \(pid \d+, from the snapshot in the monitor's memory; "
        r"(\d+) DTensors (on the model's mesh|on other meshes)\)", out)}


@pytest.mark.skipif(not torch_features.fsdp2_on_cpu(), reason=torch_features.FSDP2_CPU.line(str(torch_features.version())))
def test_an_fsdp2_rank_killed_with_sigkill_resumes_from_its_shards_with_the_loss_of_a_run_without_it(
        workdir: Path) -> None:
    runs = {}
    try:
        faults = ("--die", "rank=1,step=11,attempt=0", "--hang", "rank=1,step=16,attempt=1")
        for name, fault in (("clean", ()), ("killed", faults)):  # side by side
            d = workdir / name
            d.mkdir()
            # the example learns no timeout: a short step timeout, above a step's few ms under any load
            runs[name] = Launcher(d, "--max-restarts", "2" if fault else "0", "--ft-rank-section-timeouts",
                                  f"step:{round(4 * slack())}", name=name, entry=ENTRY, train_args=(*TRAIN, *fault))
        for la in runs.values():
            assert la.wait() == exit_codes.SUCCESS, la.output()[-8000:]
    finally:
        for la in runs.values():
            la.kill()
    clean, killed = runs["clean"].output(), runs["killed"].output()
    assert "killing myself at step 11" in killed and "attempt 2: finished 24 steps" in killed, killed[-8000:]
    summary = runs["killed"].summary()
    (hang,) = summary["hangs"]
    assert (hang["rank"], hang["attempt"], hang["section"]) == (1, 1, "step"), hang
    assert hang["verdict"].startswith("rank 1 is not in a collective (train_fsdp2.py:"), hang["verdict"]
    assert "in write_metrics_to_stuck_filesystem); rank 0 waits in all_gather" in hang["verdict"], hang["verdict"]
    assert "write_metrics_to_stuck_filesystem" in Path(hang["stack_dump"]).read_text()
    assert [(r["cause"], r["rank"]) for r in summary["restarts"]] == [("failure", 1), ("hang", 1)], summary["restarts"]
    assert re.search(r"\[rank [01]\] attempt 2: resumed at step 16 ", killed), killed[-8000:]
    resumed = _resumed(killed.split("hanging at step 16")[0])  # attempt 1's
    # rank 1 died after saving step 12 (its background finish may have been cut short: then 11 is the
    # newest step both hold); 6 parameters and 12 Adam moments, each a DTensor on the new model's mesh
    assert set(resumed) == {"0", "1"} and len({s for s, _, _ in resumed.values()}) == 1, killed[-8000:]
    assert all(s in (11, 12) and n == 18 and where == "on the model's mesh" for s, n, where in resumed.values()), \
        resumed
    assert "resumed" not in clean and set(final_losses(clean)) == {"0", "1"}, clean[-8000:]
    assert final_losses(killed) == final_losses(clean)
