"""Learned timeouts across 4 real gloo ranks, each with its own real monitor daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import zygote
from tests.procs import ROOT, Daemon, cleanup_dir, free_port, short_tmpdir, status

pytestmark = pytest.mark.e2e

WORLD = 4
STEP_SLEEP = 0.1  # x rank+1: the slowest step x 5 stays above the 1 s floor on learned timeouts
CONFIG = ("--ft-rank-section-timeouts", "step:100,ckpt:100", "--ft-rank-out-of-section-timeout", "100",
          "--ft-rank-heartbeat-timeout", "100", "--ft-initial-rank-heartbeat-timeout", "100",
          "--ft-stack-dump-timeout", "2", "--ft-termination-grace-time", "2", "--ft-min-learned-timeout", "1")



@pytest.fixture
def cluster() -> Iterator[tuple[Path, list[Daemon]]]:
    d = short_tmpdir()
    daemons = [Daemon(d, *CONFIG, name=f"r{r}.sock") for r in range(WORLD)]
    try:
        for dm in daemons:
            dm.wait_ready()
        yield d, daemons
    finally:
        for dm in daemons:
            dm.stop()
        if os.environ.get('FT_KEEP'):
            print(d)
        else:
            cleanup_dir(d)


def _run(d: Path, daemons: list[Daemon], run: str, state_in: str | None, *extra: str) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "FT_RANK_MONITOR_IPC_SOCKET": str(daemons[r].socket)}
        argv = [sys.executable, str(ROOT / "tests/workers/learn.py"), "--state-out", str(d / f"{run}-r{r}.json"),
                "--step-sleep", str(STEP_SLEEP)]
        if state_in:
            argv += ["--state-in", str(d / f"{state_in}-r{r}.json")]
        procs.append(zygote.popen([*argv, *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        outs.append(out)
    return outs


def _states(d: Path, run: str) -> list[dict]:
    return [json.loads((d / f"{run}-r{r}.json").read_text()) for r in range(WORLD)]


def test_ranks_agree_and_learned_values_average_over_three_runs_then_are_enforced(
    cluster: tuple[Path, list[Daemon]],
) -> None:
    d, daemons = cluster
    # run 1: learn from scratch; ranks observe different step times, all agree on the max
    _finish(_run(d, daemons, "run1", None))
    s1 = _states(d, "run1")
    assert all(s == s1[0] for s in s1), "state_dict must be identical on every rank"
    t1 = s1[0]["timeouts"]
    obs1 = s1[0]["observations"]
    assert obs1["sections"]["step"] >= STEP_SLEEP * WORLD  # the slowest rank's step
    assert obs1["sections"]["ckpt"] >= 0.06 * WORLD  # only the slowest rank saw this
    assert t1["rank_section_timeouts"]["step"] == pytest.approx(obs1["sections"]["step"] * 5.0)
    assert {"section:step", "section:ckpt", "rank_out_of_section_timeout", "rank_heartbeat_timeout",
            "initial_rank_heartbeat_timeout"} <= set(t1["learned"])
    for dm in daemons:  # in force in every daemon
        assert status(dm.socket)["timeouts"]["rank_section_timeouts"]["step"] == t1["rank_section_timeouts"]["step"]

    # runs 2 and 3: load the checkpoint, learn again: new = (old + observed x 5) / 2
    previous = t1
    for run, state_in in (("run2", "run1"), ("run3", "run2")):
        _finish(_run(d, daemons, run, state_in))
        s = _states(d, run)
        assert all(x == s[0] for x in s)
        obs = s[0]["observations"]["sections"]["step"]
        expect = (previous["rank_section_timeouts"]["step"] + obs * 5.0) / 2
        assert s[0]["timeouts"]["rank_section_timeouts"]["step"] == pytest.approx(expect)
        previous = s[0]["timeouts"]

    # run 4: the learned step timeout (~1 s) is enforced although the config says 100 s
    learned_step = previous["rank_section_timeouts"]["step"]
    assert learned_step < 10.0
    procs = _run(d, daemons, "run4", "run3", "--hang-step", "2")
    hung = procs[1]
    out, _ = hung.communicate(timeout=90)
    assert hung.returncode == -signal.SIGTERM
    assert "hanging" in out
    for p in procs[:1] + procs[2:]:  # stuck in the step's collective: their monitors stop them too
        p.communicate(timeout=90)
    report = daemons[1].report(rank=1)
    assert report["section"] == "step"
    assert report["timeout_s"] == pytest.approx(learned_step)
    assert "in hang_in_step" in Path(report["stack_dump"]).read_text()
