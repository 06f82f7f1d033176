"""End-to-end: in-memory snapshots (ft_client.snapshot) under real ft-launchers running
examples/train_ddp.py (DDP on gloo): a rank killed with SIGKILL, an in-process restart, and a
lost node (a launcher killed with its monitors) each resume from the snapshot kept in a
monitor's memory, and train to the loss of a run without the fault."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from ft_monitor.launcher import exit_codes
from tests.launchers import JOB_SECRET, Launcher, listening
from tests.procs import free_port, slack, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SNAP = ("--snapshot-every", "1")


def _losses(out: str) -> dict[str, str]:
    """rank -> the final loss it printed."""
    # two ranks' lines may share one line of the log (each print is two writes): never cross a "["
    return dict(re.findall(r"\[rank (\d+)\] [^\[\n]*?finished \d+ steps, loss ([0-9.]+)", out))


def _resumed(out: str) -> dict[str, int]:
    """rank -> the step it resumed at from a snapshot."""
    return {r: int(s) for r, s in
            re.findall(r"\[rank (\d+)\] [^\[\n]*?resumed at step (\d+) \(pid \d+, from the snapshot", out)}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The final losses of the same job without any fault."""
    d = tmp_path_factory.mktemp("baseline")
    la = Launcher(d, "--max-restarts", "0", train_args=(*SNAP, "--ckpt-every", "10"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    losses = _losses(la.output())
    assert set(losses) == {"0", "1"}, la.output()
    return losses


@pytest.mark.compat
def test_a_rank_killed_with_sigkill_resumes_from_the_snapshot_with_the_loss_of_a_run_without_it(
        workdir: Path, baseline: dict[str, str]) -> None:
    la = Launcher(workdir, "--max-restarts", "2",  # new interpreters, as by default: a kill -9 of a plain worker
                  train_args=(*SNAP, "--ckpt-every", "10", "--die", "rank=1,step=17,attempt=0"), warm=False)
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    resumed = _resumed(out)
    # rank 1 died after completing step 17 (18 steps): the snapshot of step 18 may have been
    # torn by the kill, then step 17's is the newest both hold; never the file checkpoint's 10
    assert set(resumed) == {"0", "1"} and len(set(resumed.values())) == 1 and resumed["0"] in (17, 18), out
    assert "from disk" not in out and re.search(r"lost [01] step\(s\)", out), out
    assert "no snapshot to restore" not in out  # a first start is normal: no warning per rank (issue 55)
    assert _losses(out) == baseline


def test_the_in_process_restart_restores_the_snapshot(workdir: Path, baseline: dict[str, str]) -> None:
    # a hang at step 12 (timeouts learned from step 10 on): the ranks re-enter the training
    # function and restore the snapshot of step 12 from their monitors' memory (the file
    # checkpoint is at step 10)
    la = Launcher(workdir, "--max-restarts", "2", "--ft-on-hang", "inprocess",
                  train_args=(*SNAP, "--ckpt-every", "5", "--inprocess", "--hang", "rank=1,step=12,attempt=0"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    assert "iteration 1: resumed at step" in out and set(_resumed(out)) == {"0", "1"}, out
    assert set(_resumed(out).values()) in ({12}, {13}), out
    assert _losses(out) == baseline


def test_a_rank_killed_under_the_in_process_wrapper_resumes_from_the_snapshot(
        workdir: Path, baseline: dict[str, str]) -> None:
    # a dead process cannot re-enter: the launcher restarts the group, and the new processes
    # restore what the monitors kept
    la = Launcher(workdir, "--max-restarts", "2", "--ft-on-hang", "inprocess",
                  train_args=(*SNAP, "--ckpt-every", "10", "--inprocess", "--die", "rank=1,step=17,attempt=0"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    assert "attempt 1 iteration 0: resumed at step" in out and set(_resumed(out)) == {"0", "1"}, out
    assert _losses(out) == baseline


def test_a_rank_of_a_two_launcher_job_killed_with_sigkill_resumes_from_the_snapshot(workdir: Path) -> None:
    # the same job twice on two launchers (2 ranks each, peer copies on): without a fault, and
    # with rank 3 SIGKILLing itself at step 17; every rank ends with the fault-free loss
    jobs = {}
    try:
        for name, fault in (("clean", ()), ("killed", ("--die", "rank=3,step=17,attempt=0"))):  # side by side
            common = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                      "--rdzv-id", f"ft-snap-{name}")
            d = workdir / name
            d.mkdir()
            jobs[name] = [Launcher(d, "--max-restarts", "2", train_args=(*SNAP, "--ckpt-every", "10", *fault),
                                   name=node, launcher_flags=common, env=JOB_SECRET) for node in ("node0", "node1")]
        for launchers in jobs.values():
            for la in launchers:
                assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        for launchers in jobs.values():
            for la in launchers:
                la.kill()
    clean, killed = ("".join(la.output() for la in jobs[name]) for name in ("clean", "killed"))
    resumed = _resumed(killed)
    assert set(resumed) == {"0", "1", "2", "3"} and len(set(resumed.values())) == 1, killed
    assert min(resumed.values()) in (17, 18) and "from disk" not in killed, killed
    assert set(_losses(clean)) == {"0", "1", "2", "3"} and _losses(killed) == _losses(clean)


def test_a_lost_node_resumes_from_the_copy_its_partner_kept(workdir: Path) -> None:
    # two launchers of 2 ranks each ("nodes"): rank r's snapshot is also kept by rank r + 2's
    # monitor. Node 1 is killed with its monitors (SIGKILL to its process group); a new node 1
    # joins with empty monitors, and its ranks take their snapshots from node 0's monitors.
    port = free_port()
    common = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "ft-snap-peer")
    train = ("--steps", "40", "--snapshot-every", "2", "--ckpt-every", "10", "--step-time", "0.2")
    # node 0 starts first and hosts the rendezvous store (the node lost must not be the one hosting it)
    a = Launcher(workdir, "--max-restarts", "3", train_args=train, name="node0", launcher_flags=common, env=JOB_SECRET)
    b = c = None
    try:
        wait_until(lambda: listening(port), 60 * slack(), "node 0's rendezvous store")
        b = Launcher(workdir, "--max-restarts", "3", train_args=train, name="node1", launcher_flags=common,
                     env=JOB_SECRET)
        # the file checkpoint of step 10 is written: several snapshots were saved and copied
        wait_until(lambda: (workdir / "ckpt" / "ckpt.pt").exists(), 180 * slack(), "the checkpoint of step 10",
                   interval=0.05)
        os.killpg(b.proc.pid, signal.SIGKILL)  # the node is lost: launcher, monitors, workers
        b.wait(30)
        c = Launcher(workdir, "--max-restarts", "3", train_args=train, name="node1b", launcher_flags=common,
                     env=JOB_SECRET)
        assert a.wait() == exit_codes.SUCCESS, a.output()
        assert c.wait() == exit_codes.SUCCESS, c.output()
    finally:
        for la in (a, b, c):
            if la is not None:
                la.kill()
    out = a.output() + c.output()
    resumed = _resumed(out)
    assert set(resumed) == {"0", "1", "2", "3"} and len(set(resumed.values())) == 1 and resumed["0"] >= 10, out
    assert "monitor, which kept a copy of this rank's" in out, out
    assert "from disk" not in out
