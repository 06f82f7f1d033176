"""Issue 39, item 1: a restart under every rendezvous torchrun accepts. torch's static
rendezvous (``--master-port``, with ``--node-rank`` and ``--master-addr`` on several nodes, the
way many Slurm scripts start torchrun) always shared the agent's store with the workers, whose
keys carry no attempt: attempt 1's gloo read attempt 0's peer addresses and died in
``connectFullMesh ... Connection refused`` (4 of 4 runs), or hung there. c10d is every other
launcher test's rendezvous; torch's two etcd backends are tests/test_etcd_e2e.py's (issue 43:
there with a rank that starts its process group late after the restart too)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launchers import JOB_SECRET, Launcher, all_succeed
from tests.procs import free_port

pytestmark = pytest.mark.e2e

HANG = ("--hang", "rank=1,step=12,attempt=0", "--late-init", "rank=1,s=2")


def _finished(*nodes: Launcher) -> str:
    out = "".join(n.output() for n in nodes)
    assert "finished 30 steps" in out and "resumed at step 10" in out, out
    return out


def _run_to_the_end(workdir: Path, flags_of: Callable[[int], tuple[str, ...]], launchers: int) -> list[Launcher]:
    """``launchers`` ft-launchers (node g with ``flags_of(g)``), the job's last rank hanging in attempt 0
    and starting its process group 2 s late after the restart; every one must succeed, and the
    hung rank is the only one named."""
    rank = 2 * launchers - 1
    nodes = [Launcher(workdir, "--max-restarts", "2", train_args=(
                 "--hang", f"rank={rank},step=12,attempt=0", "--late-init", f"rank={rank},s=2"),
                      name=f"node{g}", env=JOB_SECRET, warm=g == 0, launcher_flags=flags_of(g))
             for g in range(launchers)]
    all_succeed(nodes)
    _finished(*nodes)
    hangs = [h for n in nodes for h in n.summary()["hangs"]]
    assert {h["rank"] for h in hangs} == {rank}, hangs
    return nodes


def _run_ids(la: Launcher) -> set[str]:
    """The run ids of a launcher's attempt_start events."""
    events = Path(la.summary()["observability"]["events"]).read_text().splitlines()
    return {e["run_id"] for e in map(json.loads, events) if e["kind"] == "attempt_start"}


@pytest.mark.compat
def test_one_launcher_with_a_master_port_restarts_after_a_hang(workdir: Path) -> None:
    # new interpreters here; the two-launcher test below forks node 0's workers from its template
    la = Launcher(workdir, "--max-restarts", "2", train_args=HANG, warm=False,
                  launcher_flags=("--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())))
    la.succeed()
    _finished(la)
    assert [h["rank"] for h in la.summary()["hangs"]] == [1]
    assert len(la.summary()["attempts"]) == 2
    (run_id,) = _run_ids(la)  # torch's is "none" for every static job: the page merged two jobs
    assert re.fullmatch(r"none-[0-9a-f]{16}", run_id), run_id


@pytest.mark.compat
def test_two_launchers_with_node_ranks_and_a_master_port_restart_after_a_hang(workdir: Path) -> None:
    port = str(free_port())
    nodes = _run_to_the_end(workdir, lambda g: ("--nnodes", "2", "--node-rank", str(g), "--master-addr", "127.0.0.1",
                                                "--master-port", port), 2)
    assert all(len(n.summary()["attempts"]) == 2 for n in nodes)
    ids = [_run_ids(n) for n in nodes]  # one identity, agreed by both nodes, kept by the restart's new store
    assert ids[0] == ids[1] and len(ids[0]) == 1 and next(iter(ids[0])).startswith("none-"), ids
