"""End-to-end: ft-launcher --ft-warm-restart forks each restart's workers from the worker
template (examples/train_ddp.py, DDP on gloo): environment, output, exit codes, error
files and the stop of a forked group, as torchrun's own start gives them; and the
cases it cannot serve start the workers as usual with one line saying why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ft_monitor.launcher import exit_codes
from tests import zygote
from tests.launchers import Launcher, launcher_argv
from tests.procs import ROOT, launcher_summary, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_restarts_fork_their_workers_from_the_template(workdir: Path) -> None:
    # attempt 0: rank 1 SIGKILLs itself at step 3; attempt 1 (forked): rank 0 raises at step 8
    # (its error file names the exception; the other forked worker is stopped with SIGTERM to
    # its process group); attempt 2 (forked): trains to the end from the checkpoint of step 5
    la = Launcher(workdir, "--max-restarts", "3", "--ft-warm-restart", "--ft-preload", "numpy",
                  train_args=("--die", "rank=1,step=3,attempt=0", "--crash", "rank=0,step=8,attempt=1"), warm=False,
                  cold_launcher=True)  # as a user starts it
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    summary = la.summary()
    assert [a["started"] for a in summary["attempts"]] == ["exec", "forked", "forked"], out
    assert len(re.findall(r"attempt \d: 2 worker\(s\) forked from the worker template", out)) == 2, out
    # the forked workers' environment: their rank, their attempt (TORCHELASTIC_RESTART_COUNT)
    for rank in (0, 1):
        assert f"[rank {rank}] attempt 2: resumed at step 5" in out and f"[rank {rank}] attempt 2: finished 30" in out
    # the crash of a forked worker: exit code 1 and its exception, read from its error file
    crash = [r for r in summary["restarts"] if r["attempt"] == 1]
    assert crash and crash[0]["cause"] == "failure" and "rank 0 crashed at step 8" in crash[0]["message"], summary
    warm = summary["warm_restarts"]
    assert set(warm["forked"]) == {"1", "2"} and not warm["fallbacks"] and "numpy" in warm["preload"]
    assert ("warm restarts", "attempt 1 (2 forked), attempt 2 (2 forked)") in launcher_summary(out)
    pids = [set(a["pids"].values()) for a in summary["attempts"]]
    assert not pids[0] & pids[1] and not pids[1] & pids[2]
    # the template was forked from the launcher once it had imported torch: one import of torch on the node
    assert re.search(r"a worker template \(pid \d+, forked from the launcher with its modules\) imports torch, numpy",
                     out), out


# An entry point the template cannot run (`-m module`) starts as usual with one line saying why:
# checked by tests/test_e2e_launcher.py::test_crashed_rank_restarts_the_job, whose cold run (every
# worker a new interpreter) is that case too.


def test_preload_auto_imports_what_the_workers_loaded(workdir: Path) -> None:
    # the ranks train once the template made again is ready: a restart before that forks from the first
    # one, not waiting for imports (test_warm.py), and this test is about what the new one imports
    go = workdir / "go"
    la = Launcher(workdir, "--max-restarts", "1", "--ft-warm-restart", "--ft-preload", "auto",
                  train_args=("--die", "rank=1,step=8,attempt=0", "--wait-for", str(go), "--wait-at", "5"),
                  warm=False)
    try:
        wait_until(lambda: "modules (pid" in la.output() and "is ready; restarts fork from it" in la.output(), 90,
                   "the template made again with the workers' modules")
        go.touch()
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    summary = la.summary()
    assert [a["started"] for a in summary["attempts"]] == ["exec", "forked"], out
    # the workers' own modules, read from them: ft_client, and torch._dynamo, which DDP imports
    # lazily (2-3 s of a cold start) and `import torch` does not
    assert {"torch", "ft_client", "torch._dynamo"} <= set(summary["warm_restarts"]["preload"]), summary["warm_restarts"]
    assert "--ft-preload auto: the workers loaded" in out


def test_preload_names_are_checked_at_launch(workdir: Path) -> None:

    p = zygote.run(launcher_argv("--standalone", "--nproc-per-node", "1", "--ft-warm-restart", "--ft-preload",
                                 "torch,not a module", "x.py"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == exit_codes.LAUNCHER_ERROR and "'not a module' is not a module name" in p.stderr
