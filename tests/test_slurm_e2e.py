"""Issue 43: deploy/slurm/ft_train.sbatch on a real Slurm (tests/slurm.py: Debian's 22.05,
munge, slurmdbd and MariaDB, started and stopped here), submitted as a user submits it:

    sbatch --nodes=1 --gpus-per-node=0 --cpus-per-task=2 --exclusive=user \\
        --export=ALL,FT_VENV=.venv,FT_NPROC_PER_NODE=2,... deploy/slurm/ft_train.sbatch \\
        examples/train_ddp.py --hang rank=1,step=12,attempt=0

(``--exclusive=user``: the script asks for whole nodes; here the scenarios' jobs share the
machine's declared CPUs, one user's jobs side by side.) What happened is read from Slurm's own
accounting (``sacct``: every run of a requeued job, every step), the job's output and its
ft-logs, and the process table.

The scenarios run once, side by side, driven by one module fixture (`Scenarios`: every wait
advances every scenario), and each test checks one scenario's facts: a hang restarted in the
job; a plain ``scancel``; the time-limit warning with a requeue and, on two nodes where this
Slurm runs two slurmds, with ``NO_REQUEUE``; and a slurmctld stopped mid-job (on a cluster of
its own, so that the others keep theirs). All of it, the daemons and the jobs, is started and
stopped in module fixtures: no test leaves a process (tests/leaks.py).

The warning: slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT, compiled in) and sends
``--signal=B:TERM@N`` at the first check from end - N - 30 s on, so with any short ``--time`` it
comes at a random moment of the job's first 30 s, often before it has trained a step. The
jobs here keep the script's own ``@120`` and a 10-minute ``--time``; once a job has written its
checkpoint and waits, ``scontrol update TimeLimit=`` moves its end to 60-120 s from now, and the
next check sends the warning: the same signal, sent by the same code (job_time_limit ->
send_job_warn_signal) from the job's --signal and end time, at a moment the test knows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import slurm
from tests.conftest import KEEP_ENV
from tests.launchers import WARM
from tests.procs import ROOT, free_port, short_tmpdir, slack, wait_until
from tests.slurm import FINAL_STATES, Cluster, Job, Site

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SBATCH = "deploy/slurm/ft_train.sbatch"
TRAIN = "examples/train_ddp.py"
PARK = ("--steps", "20", "--ckpt-every", "10", "--wait-at", "10")
"""Train 10 steps, write the checkpoint of step 10, then wait (heartbeating, up to 100 s) for
the job's ``go`` file: the moment a scenario acts on its job is one where a checkpoint exists."""
WARNED = "ft-train: SIGTERM received; forwarding it to the launchers"
POLL = 0.5


def sbatch(cluster: Cluster, d: Path, nodes: int, *train_args: str, exports: dict[str, str] | None = None,
           script: str = TRAIN, warm: bool = True) -> Job:
    """The user's command line. ``--export`` carries the settings; FT_LAUNCHER_FLAGS (the
    launchers' warm start, whose module list has commas) comes through ALL, from the environment."""
    settings = {"FT_VENV": sys.prefix, "FT_NPROC_PER_NODE": "2", "FT_LOG_ROOT": str(d / "ft-logs"),
                "FT_RDZV_PORT": str(free_port()), **(exports or {})}
    argv = [f"--nodes={nodes}", "--gpus-per-node=0", "--cpus-per-task=2", "--exclusive=user", "--time=10",
            f"--job-name=ft-{d.name}", "--export=ALL," + ",".join(f"{k}={v}" for k, v in settings.items()),
            SBATCH, script, *train_args]
    return slurm.submit(cluster, d, argv, {"FT_LAUNCHER_FLAGS": " ".join(WARM) if warm else ""}, ROOT)


def train(cluster: Cluster, d: Path, nodes: int, *args: str, exports: dict[str, str] | None = None) -> Job:
    """examples/train_ddp.py, its checkpoint in the job's folder."""
    return sbatch(cluster, d, nodes, "--ckpt-dir", str(d / "ckpt"), *args, exports=exports)


FAILING_WORKLOAD = """\
# The controller-outage test's workload: every rank waits for the go file (a job that runs),
# then fails; with no restart left the launcher exits 1 (restarts exhausted). No torch: the test
# is about what Slurm and the batch script do, and this costs a fraction of a DDP run.
import os, sys, time
os.makedirs(sys.argv[1] + ".started", exist_ok=True)
end = time.monotonic() + 100
while not os.path.exists(sys.argv[1]) and time.monotonic() < end:
    time.sleep(0.1)
sys.exit(1)
"""


def checkpoint_step(d: Path) -> int | None:
    """The step of the job's file checkpoint (examples/train_ddp.py's ckpt.pt), loaded as it would resume."""
    import torch

    path = d / "ckpt" / "ckpt.pt"
    return int(torch.load(path, weights_only=False)["step"]) if path.exists() else None


@dataclass
class Scenario:
    """One job and what is done to it, advanced a little at each `pump` (never waiting), so that
    every scenario's job progresses while a test waits for one of them."""

    name: str
    job: Job
    deadline: float
    state: str = "submitted"
    done: bool = False
    error: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return self.job.dir

    @property
    def cluster(self) -> Cluster:
        return self.job.cluster

    def parked(self) -> bool:
        return (self.dir / "ckpt" / "ckpt.pt").exists()

    def go(self) -> None:
        (self.dir / "go").touch()

    def to(self, state: str) -> None:
        self.state = state
        self.marks[state] = time.monotonic()

    def pump(self, queue: dict[str, str] | None) -> None:
        """``queue``: the cluster's squeue (None while its controller is stopped)."""
        try:
            if time.monotonic() > self.deadline:
                raise AssertionError(f"scenario {self.name} timed out in state {self.state!r}")
            self.advance(queue)
        except Exception:
            self.error = traceback.format_exc() + "\n--- job output ---\n" + self.job.output()[-4000:]
            self.done = True

    def advance(self, queue: dict[str, str] | None) -> None:
        raise NotImplementedError

    # the common end: the job left the queue, its accounting is final, its processes are gone
    def ended(self, queue: dict[str, str] | None, left_queue: bool = True) -> bool:
        if queue is None or (left_queue and self.job.id in queue):
            return False
        rows = self.cluster.sacct(self.job.id)
        runs = [r for r in rows if r["JobID"] == self.job.id]
        if not runs or runs[-1]["State"].split()[0] not in FINAL_STATES:
            return False
        self.facts["sacct"] = rows
        return True

    def settle(self) -> bool:
        """Whether none of the job's processes is left (Slurm's step daemons included); after
        30 s, records what is."""
        left = self.cluster.job_processes(self.job.id)
        if not left or time.monotonic() - self.marks.get(self.state, 0) > 30 * slack():
            self.facts["left"] = left
            self.facts["output"] = self.job.output()
            return True
        return False

    def finish(self) -> None:
        self.facts["output"] = self.job.output()
        self.done = True

    def runs(self) -> list[dict[str, str]]:
        """sacct's record of each run of the job (not its steps)."""
        return [r for r in self.facts["sacct"] if r["JobID"] == self.job.id]

    def run_dirs_left(self) -> list[str]:
        """The launchers' run directories (/tmp/ft-launcher-*) still there."""
        return [p for p in re.findall(r"monitor\(s\) ready in (\S+)", self.facts["output"]) if Path(p).exists()]

    def summaries(self, run: int) -> dict[str, dict[str, Any]]:
        """Each node's summary.json of a run."""
        return {p.parent.name: json.loads(p.read_text()) for p in sorted(self.job.run_dir(run).glob("*/summary.json"))}


class RunToTheEnd(Scenario):
    """Submitted and left alone: the hang."""

    def advance(self, queue: dict[str, str] | None) -> None:
        if self.state == "submitted" and self.ended(queue):
            self.to("ended")
        if self.state == "ended" and self.settle():
            self.finish()


class Cancel(Scenario):
    """A plain ``scancel JOBID`` once the job has its checkpoint."""

    def advance(self, queue: dict[str, str] | None) -> None:
        if self.state == "submitted" and self.parked():
            self.facts["running"] = self.cluster.job_processes(self.job.id)  # what "nothing left" looks for
            self.cluster.run("scancel", self.job.id)
            self.to("cancelled")
        if self.state == "cancelled" and self.ended(queue):
            self.to("ended")
        if self.state == "ended" and self.settle():
            self.finish()


class TimeLimit(Scenario):
    """The time-limit warning once the job has its checkpoint: ``scontrol update TimeLimit=``
    puts the end 60-120 s ahead, the script's ``--signal=B:TERM@120`` is then due at slurmctld's
    next check. With ``requeue``, the requeued run gets a long limit back (the lowered one would
    warn it at its first check) and its ``go`` file: it resumes and trains to the end."""

    requeue = True

    def advance(self, queue: dict[str, str] | None) -> None:
        if self.state == "submitted" and self.parked():
            used = self.cluster.run("squeue", "-h", "-j", self.job.id, "-o", "%M").stdout.strip()
            limit = slurm.elapsed_seconds(used) // 60 + 2
            self.cluster.run("scontrol", "update", f"JobId={self.job.id}", f"TimeLimit={limit}")
            self.facts["limit_minutes"] = limit
            self.to("limit lowered")
        if self.state == "limit lowered" and WARNED in self.job.output():
            self.to("warned")
            if self.requeue:
                self.cluster.run("scontrol", "update", f"JobId={self.job.id}", "TimeLimit=10")
                self.go()
        if self.state == "warned" and "launcher exit codes by node id" in self.job.output():
            self.facts["checkpoint_at_stop"] = checkpoint_step(self.dir)
            self.facts["tmp_at_stop"] = sorted(p.name for p in (self.dir / "ckpt").glob("*.tmp"))
            self.to("stopped")
        if self.state == "stopped" and self.ended(queue):
            self.to("ended")
        if self.state == "ended" and self.settle():
            self.finish()


class NoRequeue(TimeLimit):
    requeue = False


class ControllerOutage(Scenario):
    """slurmctld stopped while the job runs; then its ranks fail with no restart left (exit 1),
    and the script's requeue finds no controller. slurmctld is started again afterwards."""

    def parked(self) -> bool:
        return (self.dir / "go.started").exists()

    def advance(self, queue: dict[str, str] | None) -> None:
        if self.state == "submitted" and self.parked():
            self.cluster.stop_controller()
            self.go()
            self.to("controller stopped")
        if self.state == "controller stopped":
            last = [line for line in self.job.output().splitlines() if line.startswith("ft-train:")][-1:]
            if last and "requeue" in last[0]:
                self.facts["line"] = last[0]
                self.facts["during_outage"] = self.cluster.job_processes(self.job.id)
                self.facts["script_seconds"] = time.monotonic() - self.marks["controller stopped"]
                self.cluster.start_controller()
                self.to("controller back")
        # The batch step's daemon retries its message every 15 s, so the job's end is recorded
        # soon; the job stays COMPLETING until the step's daemon retries, every 60 s
        # (slurmstepd/mgr.c), which the test does not wait for.
        if self.state == "controller back" and self.ended(queue, left_queue=False):
            self.facts["recorded_after"] = time.monotonic() - self.marks["controller back"]
            self.facts["left"] = self.cluster.job_processes(self.job.id)
            self.facts["slurmd_log"] = "\n".join(self.cluster.log_tail(f"slurmd-{n}.log", 200)
                                                 for n in self.cluster.node_names)
            self.finish()


class Scenarios:
    """The module's Slurm site and its scenarios, started by the first test that needs one.

    Two groups, each on its own cluster: the scenarios of the cluster ``ft`` (the hang, scancel,
    the warning with and without a requeue), and the controller outage on the cluster
    ``outage``, which stops its slurmctld (the others keep theirs). A test of the first group
    starts both, so that a module run on one worker runs them side by side; a worker that gets
    only the outage's test (pytest-xdist may hand it elsewhere) starts that group alone."""

    GROUPS = {"ft": ("hang", "scancel", "no-requeue", "requeue"), "outage": ("outage",)}

    def __init__(self) -> None:
        self.root = short_tmpdir()
        self.failed = False
        self.site: Site | None = None
        self.all: dict[str, Scenario] = {}
        self.two_nodes = False

    def start(self, name: str) -> None:
        """Start the groups a test of ``name`` starts (see the class), if not started yet."""
        groups = [g for g, names in self.GROUPS.items() if g not in (self.site.clusters if self.site else {})
                  and (name in self.GROUPS["ft"] or name in names)]
        if not groups:
            return
        if self.site is None:
            self.site = Site(self.root)
        self.site.add({g: 2 if g == "ft" else 1 for g in groups})
        deadline = time.monotonic() + 240 * slack()
        jobs = self.root / "jobs"
        if "ft" in groups:
            main = self.site.clusters["ft"]
            self.two_nodes = main.nodes >= 2
            no_requeue = train(main, jobs / "no-requeue", 2 if self.two_nodes else 1, *PARK, "--wait-for",
                               str(jobs / "no-requeue" / "go"))
            # NO_REQUEUE, as an operator would: before the warning (the job's folder may not exist yet)
            (no_requeue.dir / "ft-logs" / no_requeue.id).mkdir(parents=True, exist_ok=True)
            (no_requeue.dir / "ft-logs" / no_requeue.id / "NO_REQUEUE").touch()
            self.all["no-requeue"] = NoRequeue("no-requeue", no_requeue, deadline)
            self.all["hang"] = RunToTheEnd("hang", train(main, jobs / "hang", 1, "--hang", "rank=1,step=12,attempt=0"),
                                           deadline)
            self.all["scancel"] = Cancel("scancel", train(main, jobs / "scancel", 1, *PARK, "--wait-for",
                                                          str(jobs / "scancel" / "go")), deadline)
            self.all["requeue"] = TimeLimit("requeue", train(main, jobs / "requeue", 1, *PARK, "--wait-for",
                                                             str(jobs / "requeue" / "go")), deadline)
        if "outage" in groups:
            self.all["outage"] = ControllerOutage("outage", self.failing(self.site.clusters["outage"], jobs / "outage"),
                                                  deadline)

    @staticmethod
    def failing(cluster: Cluster, d: Path) -> Job:
        d.mkdir(parents=True)
        (d / "fail.py").write_text(FAILING_WORKLOAD)
        return sbatch(cluster, d, 1, str(d / "go"), script=str(d / "fail.py"), warm=False,
                      exports={"FT_MAX_RESTARTS": "0"})

    def wait(self, name: str) -> Scenario:
        """Advance every scenario until ``name``'s is done. A failure keeps the site's folder and
        says what the daemons logged."""
        try:
            self.start(name)
            assert self.site is not None
            site, scenario = self.site, self.all[name]

            def pump() -> bool:
                queues = {c.name: c.queue() for c in site.clusters.values()
                          if c.controller is not None and c.controller.alive()}
                for s in self.all.values():
                    if not s.done:
                        s.pump(queues.get(s.cluster.name))
                return scenario.done

            wait_until(pump, 300, f"the {name} scenario", interval=POLL)
            if scenario.error:
                raise AssertionError(scenario.error)
            return scenario
        except Exception as e:
            self.failed = True
            pytest.fail(f"the {name} scenario failed: {e}\n--- the daemons' logs ---\n{self.logs()}", pytrace=False)

    def logs(self) -> str:
        return self.site.logs() if self.site is not None else ""

    def stop(self) -> None:
        if self.site is not None:
            self.site.stop()


@pytest.fixture(scope="module")
def scenarios() -> Iterator[Scenarios]:
    reason = slurm.skip_reason()
    if reason:
        pytest.skip(reason)
    s = Scenarios()
    try:
        yield s
    finally:
        s.stop()
    if s.failed:  # the daemons' logs, the jobs' output and ft-logs, where conftest keeps a failing test's folder
        base = Path(os.environ.get(KEEP_ENV) or "/tmp/ft-failed-tests")
        base.mkdir(parents=True, exist_ok=True)
        shutil.move(str(s.root), base / f"slurm-{s.root.name}")
    else:
        shutil.rmtree(s.root, ignore_errors=True)


@pytest.fixture(autouse=True)
def slurm_evidence(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failing test prints the daemons' logs; the site's folder is kept (see `scenarios`)."""
    yield
    if getattr(request.node, "ft_failed", False) and "scenarios" in request.fixturenames:
        s: Scenarios = request.getfixturevalue("scenarios")
        s.failed = True
        request.node.add_report_section("teardown", "slurm daemons", s.logs())


@pytest.fixture(scope="module")
def hang(scenarios: Scenarios) -> Scenario:
    return scenarios.wait("hang")


@pytest.fixture(scope="module")
def cancelled(scenarios: Scenarios) -> Scenario:
    return scenarios.wait("scancel")


@pytest.fixture(scope="module")
def no_requeue(scenarios: Scenarios) -> Scenario:
    return scenarios.wait("no-requeue")


@pytest.fixture(scope="module")
def requeue(scenarios: Scenarios) -> Scenario:
    return scenarios.wait("requeue")


@pytest.fixture(scope="module")
def outage(scenarios: Scenarios) -> Scenario:
    return scenarios.wait("outage")


def ft_lines(s: Scenario) -> list[str]:
    return [line for line in s.facts["output"].splitlines() if line.startswith("ft-train:")]


def assert_nothing_left(s: Scenario) -> None:
    assert s.facts["left"] == {}, s.facts["left"]
    assert s.run_dirs_left() == []


def assert_private_and_clean(run_dir: Path) -> None:
    """Issue 49: the run's folder made by the script with mode 0700; the per-node secret files
    removed (each by its launcher, the folder by the script), no exit-code temporary left."""
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700, oct(run_dir.stat().st_mode)
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []


def test_a_hang_of_rank_1_is_restarted_in_the_job_which_completes(hang: Scenario) -> None:
    runs = hang.runs()
    assert [(r["State"], r["ExitCode"]) for r in runs] == [("COMPLETED", "0:0")], hang.facts["sacct"]
    assert hang.job.exit_codes(0) == ["0"]
    (summary,) = hang.summaries(0).values()
    assert summary["exit_code"] == 0
    assert [h["rank"] for h in summary["hangs"]] == [1]
    assert len(summary["attempts"]) == 2  # restarted in the job, not requeued
    assert "finished 30 steps" in hang.facts["output"] and "requeue" not in hang.facts["output"]
    assert_nothing_left(hang)
    assert_private_and_clean(hang.job.run_dir(0))
    assert stat.S_IMODE(hang.job.run_dir(0).parent.stat().st_mode) == 0o700  # the job's folder too


def test_a_plain_scancel_stops_the_launcher_in_order_and_the_job_stays_cancelled(cancelled: Scenario) -> None:
    """Slurm sends SIGTERM to every process of the job (SIGKILL KillWait = 30 s later): the
    launcher stops in order and writes its code; the script must not requeue a cancelled job
    (it did: the trap took the cancel's SIGTERM for the time-limit warning)."""
    runs = cancelled.runs()
    assert [r["State"] for r in runs] == ["CANCELLED by 0"], cancelled.facts["sacct"]
    assert cancelled.job.exit_codes(0) == ["143"]  # exited on its own after SIGTERM, not SIGKILLed
    (summary,) = cancelled.summaries(0).values()
    assert summary["exit_code"] == 143
    assert ft_lines(cancelled)[-1].startswith(f"ft-train: job {cancelled.job.id} was cancelled"), ft_lines(cancelled)
    assert not (cancelled.job.run_dir(1)).exists()
    # the process table's view of the job while it ran: the batch script, srun, the launcher,
    # its monitors, its worker template and ranks (forked: the launcher's command line), Slurm's step daemons
    running = list(cancelled.facts["running"].values())
    assert any("slurm_script" in c for c in running) and any(c.startswith("srun ") for c in running), running
    assert sum("ft_monitor.cli --run-checked" in c for c in running) == 2, running
    assert sum("/ft-launcher " in c for c in running) >= 4, running  # launcher, template, 2 ranks
    assert {c for c in running if c.startswith("slurmstepd")} == {f"slurmstepd: [{cancelled.job.id}.batch]",
                                                                  f"slurmstepd: [{cancelled.job.id}.0]"}, running
    assert_nothing_left(cancelled)


def test_the_time_limit_warning_stops_the_job_with_its_checkpoint_and_requeues_it(requeue: Scenario) -> None:
    f = requeue.facts
    assert [r["State"] for r in requeue.runs()] == ["REQUEUED", "COMPLETED"], f["sacct"]  # not TIMEOUT
    assert f["checkpoint_at_stop"] == 10 and f["tmp_at_stop"] == []
    assert requeue.job.exit_codes(0) == ["143"] and requeue.job.exit_codes(1) == ["0"]
    lines = ft_lines(requeue)
    assert f"ft-train: requeued job {requeue.job.id} (SIGTERM before the time limit, or preemption)" in lines, lines
    assert re.search(r"\[rank 0\] attempt 0: resumed at step 10 \(pid \d+, from disk\)", f["output"]), f["output"]
    assert f["output"].count("finished 20 steps") == 2
    stop = requeue.marks["stopped"] - requeue.marks["warned"]
    assert stop < 60, f"the launchers took {stop:.1f} s to stop after the warning"  # the 120 s lead's budget
    assert_nothing_left(requeue)


def test_with_no_requeue_the_time_limit_warning_stops_the_job_for_good(scenarios: Scenarios,
                                                                        no_requeue: Scenario) -> None:
    """On two nodes where this Slurm runs two slurmds: the forwarded SIGTERM reaches both."""
    f = no_requeue.facts
    nodes = 2 if scenarios.two_nodes else 1
    # sacct prints an exit code of 128 or more less 128 (sacct/print.c): the script's 143 is 15:0
    assert [(r["State"], r["ExitCode"], r["NNodes"]) for r in no_requeue.runs()] == [("FAILED", "15:0", str(nodes))]
    assert no_requeue.job.exit_codes(0) == ["143"] * nodes
    assert [s["exit_code"] for s in no_requeue.summaries(0).values()] == [143] * nodes
    assert f["checkpoint_at_stop"] == 10 and f["tmp_at_stop"] == []
    assert ft_lines(no_requeue)[-1].endswith("NO_REQUEUE exists; not requeueing"), ft_lines(no_requeue)
    assert_nothing_left(no_requeue)
    assert_private_and_clean(no_requeue.job.run_dir(0))  # both nodes read (and removed) a file of their own


def test_two_slurmds_on_this_machine_run_a_two_node_job(scenarios: Scenarios, no_requeue: Scenario) -> None:
    if not scenarios.two_nodes:
        assert scenarios.site is not None
        pytest.skip(f"this Slurm does not run a second slurmd on one machine: {scenarios.site.clusters['ft'].node_note}")
    (run,) = no_requeue.runs()
    assert run["NodeList"] == "ft[1-2]"
    assert sorted(no_requeue.summaries(0)) == ["ft1", "ft2"]
    # the rendezvous is at the first node's NodeAddr, not at its Slurm name (which does not resolve)
    assert "rendezvous at 127.0.0.1:" in ft_lines(no_requeue)[0]


def test_a_stopped_slurmctld_leaves_the_job_running_and_the_script_says_it_could_not_requeue(outage: Scenario) -> None:
    f = outage.facts
    job = outage.job.id
    assert f["line"].startswith(f"ft-train: could not requeue job {job} (restarts exhausted):"), f["line"]
    assert "is DOWN" in f["line"]
    assert ft_lines(outage)[-1] == f["line"]
    assert f["script_seconds"] < 60  # the requeue's try ends on its own
    # the training needed no controller: while it was down, only Slurm's step daemons were left
    assert all(cmd.startswith("slurmstepd: ") for cmd in f["during_outage"].values()), f["during_outage"]
    assert outage.job.exit_codes(0) == ["1"] and "no restart was left" in f["output"]
    runs = outage.runs()
    assert [(r["State"], r["ExitCode"]) for r in runs] == [("FAILED", "1:0")], f["sacct"]
    # what is left is Slurm's step daemon, retrying its step-complete message (every 60 s)
    assert all(cmd == f"slurmstepd: [{job}.0]" for cmd in f["left"].values()), f["left"]
    if f["left"]:
        assert f"[{job}.0] error: Rank 0 failed sending step completion message directly to slurmctld, retrying" \
            in f["slurmd_log"], f["slurmd_log"]
    assert outage.run_dirs_left() == []
