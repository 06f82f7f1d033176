"""deploy/: the Slurm script, the Kubernetes manifest and the systemd unit parse, use only real
settings, and keep their timing promises.

What is checked, without Slurm, a cluster or a running systemd:
* every ``--ft-<field>`` flag in deploy/ names a FaultToleranceConfig field (or a launcher flag);
* Slurm: ``bash -n``; the #SBATCH lines; the signal lead covers the launcher's kill escalation;
  the script run against fake ``srun``/``scontrol``/``scancel``/``squeue``/``ft-launcher``
  commands: the launcher's arguments (the rendezvous at the first node's NodeAddr), the exit code
  and requeue decision for each launcher exit code, the SIGTERM trap (forwarded with scancel,
  then requeued, unless the job was cancelled), and a slurmctld that is down or does not answer
  (tests/test_slurm_e2e.py runs the script on a real Slurm);
* Kubernetes: ``yaml.safe_load_all``; the kinds; the ConfigMap's YAML loads with load_config;
  terminationGracePeriodSeconds above the kill escalation computed from that YAML; the wiring
  (rendezvous DNS, /tmp and /dev/shm emptyDirs, podFailurePolicy on the launcher's exit codes);
* systemd: the unit's sections and keys; its ExecStart parses with ft-monitor's own parser;
  ``systemd-analyze verify`` where that tool exists (skipped where the environment prevents it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ft_monitor import cli
from ft_monitor.config import FIELDS, FaultToleranceConfig, cli_overrides, load_config
from ft_monitor.launcher import exit_codes
from tests.procs import wait_until

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SBATCH = DEPLOY / "slurm" / "ft_train.sbatch"
K8S = DEPLOY / "kubernetes" / "ft-train.yaml"
UNIT = DEPLOY / "systemd" / "ft-monitor@.service"
NO_ENV: dict[str, str] = {}

TORCH_SHUTDOWN_TIMEOUT = 30
"""torch.distributed.elastic's default wait between SIGTERM and SIGKILL when the agent is signalled."""
LAUNCHER_ONLY_FLAGS = {"cfg_path": "--ft-cfg-path", "summary_json": "--ft-summary-json"}
"""ft-launcher flags that start with --ft- but are not config fields."""


def kill_escalation(cfg: FaultToleranceConfig) -> float:
    """Longest orderly stop of one launcher after SIGTERM: a hang being handled (stack dump,
    grace), torch's shutdown, then the monitors' stop."""
    return cfg.stack_dump_timeout + cfg.termination_grace_time + TORCH_SHUTDOWN_TIMEOUT + cfg.termination_grace_time


# ---------------------------------------------------------------------------
# All files


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def test_deploy_has_the_three_targets() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in deploy_files()}
    for name in ("slurm/ft_train.sbatch", "slurm/README.md", "kubernetes/ft-train.yaml", "kubernetes/README.md",
                 "systemd/ft-monitor@.service", "systemd/README.md"):
        assert name in names


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_ft_flags_are_real_settings(path: Path) -> None:
    """A misspelt --ft-<field> would make ft-launcher or ft-monitor exit 2 at start."""
    launcher_src = (ROOT / "ft_monitor" / "launcher" / "main.py").read_text()
    config_src = (ROOT / "ft_monitor" / "config.py").read_text()
    for flag in re.findall(r"--ft[-_]([a-z][a-z0-9_-]*)", path.read_text()):
        name = flag.replace("-", "_")
        if name in LAUNCHER_ONLY_FLAGS:
            assert LAUNCHER_ONLY_FLAGS[name] in launcher_src + config_src, flag
        else:
            assert name in FIELDS, f"{path.name}: --ft-{flag} is not a config field"


# ---------------------------------------------------------------------------
# Slurm


def sbatch_options() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in SBATCH.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([a-z-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def test_sbatch_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr


def test_sbatch_directives_and_signal_lead() -> None:
    opts = sbatch_options()
    assert opts["ntasks-per-node"] == "1"  # one launcher per node
    for key in ("nodes", "time", "gpus-per-node", "requeue"):
        assert key in opts
    m = re.fullmatch(r"B:TERM@(\d+)", opts["signal"])
    assert m, opts["signal"]
    default_cfg = load_config(ROOT / "examples" / "ft.yaml", NO_ENV)  # the script's default FT_CFG
    assert int(m.group(1)) > kill_escalation(default_cfg)
    assert int(m.group(1)) > kill_escalation(FaultToleranceConfig())
    text = SBATCH.read_text()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    assert "srun --kill-on-bad-exit=0" in text


FAKE_HOST = "node-a"
DOWN = "Slurmctld(primary) at ctl is DOWN"


def fake_slurm(tmp_path: Path, launcher_body: str) -> tuple[dict[str, str], Path]:
    """A PATH with fake srun/scontrol/scancel/squeue/ft-launcher; they log their calls to calls.log.
    FAKE_CTLD=down: every call that needs slurmctld fails as Slurm's do when it is down;
    FAKE_SQUEUE: squeue's answer ("STATE REASON"; a job being cancelled is COMPLETING);
    FAKE_NODE_ADDR: the first node's NodeAddr in ``scontrol show node``; scancel finds "No active
    steps" until srun has made the step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    down = '[[ "${FAKE_CTLD:-up}" == down ]]'
    scripts = {
        "scontrol": 'echo "scontrol $*" >> "$FAKE_LOG"\n'
                    f'[[ "$1 $2" == "show hostnames" ]] && {{ echo {FAKE_HOST}; exit 0; }}\n'
                    f'if [[ "$1" == ping ]]; then {down} && {{ echo "{DOWN}"; exit 1; }}; '
                    'echo "Slurmctld(primary) at ctl is UP"; exit 0; fi\n'
                    f'{down} && {{ echo "Unexpected message received for job $SLURM_JOB_ID" >&2; exit 1; }}\n'
                    '[[ "$1 $2" == "show node" && -n "${FAKE_NODE_ADDR:-}" ]] && '
                    'echo "NodeName=$4 Arch=x86_64 CoresPerSocket=1 NodeAddr=$FAKE_NODE_ADDR NodeHostName=$4"\n'
                    '[[ "$1" == requeue && -n "${FAKE_REQUEUE_SLEEP:-}" ]] && sleep "$FAKE_REQUEUE_SLEEP"\n'
                    'exit 0\n',
        # scancel --signal=TERM signals the step: here, the process group fake srun started.
        "scancel": 'echo "scancel $*" >> "$FAKE_LOG"\n'
                   f'{down} && {{ echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1; }}\n'
                   '[[ -s "$FAKE_STEP_PGID" ]] || { echo "scancel: error: Kill job error on job id $2: No active '
                   'steps" >&2; exit 1; }\n'
                   '[[ "$1" == --signal=TERM ]] && kill -TERM -- "-$(cat "$FAKE_STEP_PGID")"\nexit 0\n',
        "squeue": 'echo "squeue $*" >> "$FAKE_LOG"\n'
                  f'{down} && {{ echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1; }}\n'
                  'echo "${FAKE_SQUEUE:-RUNNING None}"\n',
        # FAKE_STEP_GATE (a FIFO): srun creates the step only once a line is written to it
        "srun": 'echo "srun $*" >> "$FAKE_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\n'
                '[[ -n "${FAKE_STEP_GATE:-}" ]] && read -r _ < "$FAKE_STEP_GATE"\n'
                'SLURM_NODEID=0 SLURMD_NODENAME=' + FAKE_HOST + ' setsid "$@" &\n'
                # the step exists once its task runs (past the wrapper's `trap`, which makes the node's folder):
                # a SIGTERM scancel sends before that would kill a bash that has no trap yet
                'task=$!\nfor _ in $(seq 200); do [[ -d "$FT_LOG_DIR/' + FAKE_HOST + '" ]] && break; sleep 0.02; done\n'
                'echo $task > "$FAKE_STEP_PGID"\nwait $task\n',
        "ft-launcher": 'printf "%s\\n" "$@" > "$FAKE_ARGS"\n' + launcher_body,
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(log),
        "FAKE_ARGS": str(tmp_path / "launcher-args"),
        "FAKE_STEP_PGID": str(tmp_path / "step-pgid"),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": f"{FAKE_HOST},node-b",
        "SLURM_NNODES": "1",
        "FT_LOG_ROOT": str(tmp_path / "logs"),
    }
    return env, log


def run_sbatch(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SBATCH), *args], env={**env, **extra}, capture_output=True, text=True,
                          timeout=20)


def ft_train_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("ft-train:")]


def test_sbatch_launches_one_launcher_with_the_rendezvous_on_the_first_node(tmp_path: Path) -> None:
    env, log = fake_slurm(tmp_path, "exit 0\n")
    proc = run_sbatch(env, "train.py", "--lr", "3e-4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (tmp_path / "launcher-args").read_text().splitlines()
    log_dir = tmp_path / "logs" / "4242" / "run-0" / FAKE_HOST
    assert args == [
        "--log-dir", str(log_dir), "--ft-summary-json", str(log_dir / "summary.json"), "--rdzv-conf=is_host=1",
        "--nnodes=1", "--nproc-per-node=8", "--rdzv-backend=c10d", f"--rdzv-endpoint={FAKE_HOST}:29500",
        "--rdzv-id=4242", "--max-restarts=3", f"--ft-cfg-path={ROOT / 'examples' / 'ft.yaml'}",
        "train.py", "--lr", "3e-4",
    ]
    assert (tmp_path / "logs" / "4242" / "run-0" / "exit-code.0").read_text().strip() == "0"
    assert "requeue" not in log.read_text()


def test_sbatch_rendezvous_is_at_the_first_nodes_address_with_the_users_flags(tmp_path: Path) -> None:
    """A Slurm node name need not resolve (NodeName=gpu17 NodeAddr=10.0.3.17): the endpoint is the
    NodeAddr slurmctld gives; FT_LAUNCHER_FLAGS and FT_RDZV_CONF reach the launcher."""
    env, log = fake_slurm(tmp_path, "exit 0\n")
    proc = run_sbatch(env, "train.py", FAKE_NODE_ADDR="10.0.3.17", FT_RDZV_CONF="join_timeout=900",
                      FT_LAUNCHER_FLAGS="--ft-warm-start --ft-preload torch.nn.parallel,ft_client")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (tmp_path / "launcher-args").read_text().splitlines()
    assert "--rdzv-endpoint=10.0.3.17:29500" in args
    assert "--rdzv-conf=is_host=1,join_timeout=900" in args
    assert args[-4:] == ["--ft-warm-start", "--ft-preload", "torch.nn.parallel,ft_client", "train.py"]
    assert f"scontrol show node -o {FAKE_HOST}" in log.read_text()
    assert f"rendezvous at 10.0.3.17:29500 ({FAKE_HOST})" in proc.stdout
    proc = run_sbatch(env, "train.py", FT_RDZV_HOST="ib-node-a", FAKE_NODE_ADDR="10.0.3.17")
    assert "--rdzv-endpoint=ib-node-a:29500" in (tmp_path / "launcher-args").read_text().splitlines()


@pytest.mark.parametrize(
    ("launcher_code", "job_code", "requeued"),
    [
        (exit_codes.SUCCESS, 0, False),
        (exit_codes.WORKERS_FAILED, 1, True),
        (exit_codes.LAUNCHER_ERROR, 2, False),
        (exit_codes.NO_PROGRESS, 3, False),
        (exit_codes.SHUTDOWN_REQUESTED, 4, False),
        (exit_codes.NODE_EXCLUDED, 5, False),
        (exit_codes.STORE_UNREACHABLE, 6, True),
    ],
)
def test_sbatch_exit_code_policy(tmp_path: Path, launcher_code: int, job_code: int, requeued: bool) -> None:
    """Requeue when the restart budget ran out or the store went away; never when requeueing
    cannot help (2, 3, 4, 5)."""
    env, log = fake_slurm(tmp_path, f"exit {launcher_code}\n")
    proc = run_sbatch(env)
    assert proc.returncode == job_code, proc.stdout + proc.stderr
    assert ("scontrol requeue 4242" in log.read_text()) is requeued


def test_sbatch_requeue_limits(tmp_path: Path) -> None:
    env, log = fake_slurm(tmp_path, "exit 1\n")
    assert run_sbatch(env, SLURM_RESTART_COUNT="5", FT_MAX_REQUEUES="5").returncode == 1
    (tmp_path / "logs" / "4242").mkdir(parents=True, exist_ok=True)
    (tmp_path / "logs" / "4242" / "NO_REQUEUE").touch()
    assert run_sbatch(env).returncode == 1
    assert "requeue" not in log.read_text()


def test_sbatch_says_in_one_line_that_a_requeue_found_no_slurmctld(tmp_path: Path) -> None:
    """Issue 43: slurmctld stopped mid-job. The job needs it only to requeue: the script tries,
    says so in one line and keeps the launcher's code (1: restarts exhausted)."""
    env, log = fake_slurm(tmp_path, "exit 1\n")
    proc = run_sbatch(env, FAKE_CTLD="down")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = ft_train_lines(proc.stdout)[-1]
    assert last == ("ft-train: could not requeue job 4242 (restarts exhausted): scontrol requeue: Unexpected message "
                    f"received for job 4242 ({DOWN}); once slurmctld answers: scontrol requeue 4242"), last


def test_sbatch_bounds_a_slurmctld_that_does_not_answer(tmp_path: Path) -> None:
    """A controller that accepts and never answers: FT_SLURM_TIMEOUT ends the requeue's wait."""
    env, _ = fake_slurm(tmp_path, "exit 1\n")
    start = time.monotonic()
    proc = run_sbatch(env, FAKE_REQUEUE_SLEEP="30", FT_SLURM_TIMEOUT="1")
    assert time.monotonic() - start < 10
    assert proc.returncode == 1
    assert ft_train_lines(proc.stdout)[-1].startswith("ft-train: could not requeue job 4242 (restarts exhausted)")


def _sigterm_the_batch_shell(tmp_path: Path, **extra: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the script with a launcher that exits 143 on SIGTERM; SIGTERM the batch shell once the
    launcher runs, as ``--signal=B:TERM`` (or ``scancel``) does."""
    started = tmp_path / "launcher-started"
    env, log = fake_slurm(tmp_path, f"trap 'exit 143' TERM\ntouch {started}\nsleep 30 & wait\n")
    proc = subprocess.Popen(["bash", str(SBATCH)], env={**env, **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 10
        while not started.exists():
            assert time.monotonic() < deadline, "the fake launcher did not start"
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "logs" / "4242" / "run-0" / "exit-code.0").read_text().strip() == "143"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), log.read_text()


def test_sbatch_forwards_sigterm_to_the_step_and_requeues(tmp_path: Path) -> None:
    """--signal=B:TERM reaches the batch shell; the launcher gets it through scancel, not srun."""
    proc, calls = _sigterm_the_batch_shell(tmp_path)
    assert proc.returncode == 143, proc.stdout
    assert "scancel --signal=TERM 4242" in calls
    assert "scontrol requeue 4242" in calls


def test_sbatch_does_not_requeue_a_cancelled_job(tmp_path: Path) -> None:
    """A plain scancel sends SIGTERM to the batch shell too, with the job already ending in
    slurmctld (COMPLETING): requeueing would undo the cancel (tests/test_slurm_e2e.py saw it)."""
    proc, calls = _sigterm_the_batch_shell(tmp_path, FAKE_SQUEUE="COMPLETING None")
    assert proc.returncode == 143, proc.stdout
    assert "requeue" not in calls
    assert ft_train_lines(proc.stdout)[-1] == "ft-train: job 4242 was cancelled (slurmctld: COMPLETING None); not requeued"


def test_sbatch_requeues_a_job_that_reached_its_time_limit(tmp_path: Path) -> None:
    proc, calls = _sigterm_the_batch_shell(tmp_path, FAKE_SQUEUE="COMPLETING TimeLimit")
    assert proc.returncode == 143, proc.stdout
    assert "scontrol requeue 4242" in calls
    assert "raise --signal's lead" in ft_train_lines(proc.stdout)[-1]


def test_sbatch_sigterm_before_the_launchers_start_starts_none(tmp_path: Path) -> None:
    """A SIGTERM that comes while the script sets up (the secret, the head node) is not lost: no
    launcher is started, and the job is requeued as after any other SIGTERM."""
    env, log = fake_slurm(tmp_path, "exit 0\n")
    env["PATH"] = f"{tmp_path / 'slow'}:{env['PATH']}"
    (tmp_path / "slow").mkdir()
    pid_file = tmp_path / "setup-pid"
    slow = tmp_path / "slow" / "python3"  # the script's secret generator, slow on purpose
    slow.write_text(f"#!/bin/bash\necho $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}\nexec sleep 30\n")
    slow.chmod(0o755)
    proc = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_until(pid_file.exists, 10, "the script's setup to start")
        proc.send_signal(signal.SIGTERM)  # bash runs the trap once the command it waits for ends:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, out
    calls = log.read_text()
    assert "srun" not in calls and "scontrol requeue 4242" in calls
    assert "ft-train: SIGTERM received before the launchers started; not starting them" in out


@pytest.mark.parametrize("step_sees_the_mark", [True, False], ids=["mark-seen", "mark-seen-late"])
def test_sbatch_keeps_a_sigterm_that_came_before_the_step(tmp_path: Path, step_sees_the_mark: bool) -> None:
    """Issue 49: a SIGTERM that reaches the batch shell while srun is still creating its step
    was forwarded once, failed ("No active steps") and was lost: the job ran on and exited 0,
    not requeued. Now the task started after it finds the STOP mark and starts no launcher; and
    where it does not see the mark (another node's file system showing it late, played here by
    removing it), the forward is retried until the step is there, and the launcher stops."""
    started = tmp_path / "launcher-started"
    gate = tmp_path / "step-gate"
    os.mkfifo(gate)
    env, log = fake_slurm(tmp_path, f"trap 'exit 143' TERM\ntouch {started}\nsleep 30 & wait\nexit 0\n")
    proc = subprocess.Popen(["bash", str(SBATCH)], env={**env, "FAKE_STEP_GATE": str(gate)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "logs" / "4242" / "run-0"
    try:
        wait_until(lambda: "srun " in (log.read_text() if log.exists() else ""), 10, "srun to be creating the step")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "scancel --signal=TERM 4242" in log.read_text(), 10, "the first forward")
        if not step_sees_the_mark:
            (run_dir / "STOP").unlink(missing_ok=True)
        with open(gate, "w") as f:  # srun makes the step now
            f.write("go\n")
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = log.read_text()
    assert proc.returncode == 143, out
    assert "scontrol requeue 4242" in calls, out
    assert (run_dir / "exit-code.0").read_text().strip() == "143"
    assert "scancel could not forward SIGTERM: scancel: error: Kill job error on job id 4242: No active steps; " \
           "trying again every second while srun runs" in out
    if step_sees_the_mark:
        assert not started.exists(), out
        assert "ft-train: node 0: the job got SIGTERM before its launcher started; not starting it" in out
    else:
        assert started.exists() and calls.count("scancel --signal=TERM 4242") >= 2, out


@pytest.mark.parametrize("given", ["none", "FT_JOB_SECRET", "FT_JOB_SECRET_FILE"])
def test_sbatch_hands_each_launcher_the_secret_in_a_file_of_its_own(tmp_path: Path, given: str) -> None:
    """Issue 49: the srun wrapper, which lives for the whole run, had FT_JOB_SECRET in its
    environment (readable by every worker of the node in /proc/PID/environ), and so did the batch
    shell where the user gave it. Now: no process of the job but the launcher learns it, from a
    0600 file in a 0700 folder of the run that names it in FT_JOB_SECRET_FILE with
    FT_JOB_SECRET_FILE_ONCE=1 (the launcher removes it once read); whatever is left is removed
    when srun returns."""
    seen = tmp_path / "seen"
    body = ('wrapper=$PPID; srun=$(($(ps -o ppid= -p "$wrapper"))); batch=$(($(ps -o ppid= -p "$srun")))\n'
            f'mkdir {seen}; env > {seen}/launcher.env\n'
            f'tr "\\0" "\\n" < /proc/$wrapper/environ > {seen}/wrapper.env\n'
            f'tr "\\0" "\\n" < /proc/$batch/environ > {seen}/batch.env\n'
            f'if [[ -n "${{FT_JOB_SECRET_FILE:-}}" ]]; then cp "$FT_JOB_SECRET_FILE" {seen}/secret\n'
            f'  stat -c %a "$FT_JOB_SECRET_FILE" "$(dirname "$FT_JOB_SECRET_FILE")" > {seen}/modes; fi\n'
            'exit 0\n')
    env, _ = fake_slurm(tmp_path, body)
    mine = "given-by-the-user-" + "0123456789abcdef"
    extra = {}
    if given == "FT_JOB_SECRET":
        extra[given] = mine
    elif given == "FT_JOB_SECRET_FILE":
        (tmp_path / "mine").write_text(mine + "\n")
        (tmp_path / "mine").chmod(0o600)
        extra[given] = str(tmp_path / "mine")
    proc = run_sbatch(env, **extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    secret = (seen / "secret").read_text().strip()
    assert secret == mine if given != "none" else re.fullmatch(r"[0-9a-f]{64}", secret), secret
    assert (seen / "modes").read_text().split() == ["600", "700"]
    launcher = dict(line.split("=", 1) for line in (seen / "launcher.env").read_text().splitlines() if "=" in line)
    run_dir = tmp_path / "logs" / "4242" / "run-0"
    assert launcher["FT_JOB_SECRET_FILE"] == str(run_dir / ".secret" / "0")
    assert launcher["FT_JOB_SECRET_FILE_ONCE"] == "1" and "FT_JOB_SECRET" not in launcher
    for process in ("wrapper", "batch"):  # both live for the whole run
        text = (seen / f"{process}.env").read_text()
        assert secret not in text and "FT_JOB_SECRET" not in text, (process, text)
    assert not (run_dir / ".secret").exists()  # the stub did not remove its file: the script did
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in (run_dir, run_dir.parent, run_dir / FAKE_HOST))


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="plants a folder of another uid (65534): needs root")
def test_sbatch_refuses_a_log_folder_another_user_made(tmp_path: Path) -> None:
    """Issue 49: another user pre-created <root>/<job id>/run-0 (0777) in a shared FT_LOG_ROOT,
    with symlinks at exit-code.0 and the node's summary.json to files of the job's user, and
    NO_REQUEUE: the script used the folder, and the exit-code write went through the link. Now
    the folder is refused in one line, exit 2, not requeued, and nothing is written in it; the
    job's own folder left writable by others is refused the same way, and so is a root of another
    user's (its owner could swap the job's folder in it)."""
    root = tmp_path / "logs"
    root.mkdir()
    root.chmod(0o1777)  # shared, sticky, as /tmp
    victim = tmp_path / "precious"
    victim.write_text("the job user's own\n")
    victim.chmod(0o600)
    job = root / "4242"
    node = job / "run-0" / FAKE_HOST
    node.mkdir(parents=True)
    (job / "NO_REQUEUE").touch()
    (job / "run-0" / "exit-code.0").symlink_to(victim)
    (node / "summary.json").symlink_to(victim)
    for path in (job, job / "run-0", node, job / "NO_REQUEUE", job / "run-0" / "exit-code.0", node / "summary.json"):
        os.lchown(path, NOBODY, NOBODY)
        if not path.is_symlink():
            path.chmod(0o777)
    env, log = fake_slurm(tmp_path, "exit 0\n")
    proc = run_sbatch(env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ft_train_lines(proc.stdout) == [
        f"ft-train: refusing the log folder {job}: it belongs to uid {NOBODY}, not to you (0); not requeued (a "
        "requeue would find it again): remove it, or set FT_LOG_ROOT to a folder of yours"], proc.stdout
    assert not log.exists() or "srun" not in log.read_text()
    assert victim.read_text() == "the job user's own\n"
    assert all(p.lstat().st_uid == NOBODY for p in job.rglob("*")), sorted(job.rglob("*"))
    os.chown(job, 0, 0)  # the job's own folder, but others may write to it
    proc = run_sbatch(env)
    assert proc.returncode == 2 and ft_train_lines(proc.stdout)[0].startswith(
        f"ft-train: refusing the log folder {job}: mode 777: others can write to it;"), proc.stdout
    assert victim.read_text() == "the job user's own\n"
    shutil.rmtree(job)
    os.chown(root, NOBODY, NOBODY)  # a root of another user's: it could swap the job's folder in it
    root.chmod(0o777)
    proc = run_sbatch(env)
    assert proc.returncode == 2 and ft_train_lines(proc.stdout)[0].startswith(
        f"ft-train: refusing the log folder {root}: uid {NOBODY}, mode 777: the root must be yours or root's"), \
        proc.stdout
    assert list(root.iterdir()) == []


# ---------------------------------------------------------------------------
# Kubernetes


def k8s_objects() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d is not None]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind expected"
    return by_kind


def pod_spec() -> dict[str, Any]:
    return k8s_objects()["Job"]["spec"]["template"]["spec"]


def launcher_container() -> dict[str, Any]:
    (container,) = pod_spec()["containers"]
    return container


def launcher_args() -> dict[str, str]:
    out: dict[str, str] = {}
    for arg in launcher_container()["args"]:
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            out[key] = value
    return out


def configmap_config(tmp_path: Path) -> FaultToleranceConfig:
    (name, text), = k8s_objects()["ConfigMap"]["data"].items()
    path = tmp_path / name
    path.write_text(text)
    return load_config(path, NO_ENV)


def test_k8s_manifest_kinds() -> None:
    objs = k8s_objects()
    assert set(objs) == {"ConfigMap", "Service", "Job", "NetworkPolicy"}
    assert objs["Job"]["apiVersion"] == "batch/v1"
    assert {objs["ConfigMap"]["apiVersion"], objs["Service"]["apiVersion"]} == {"v1"}


def test_k8s_only_the_jobs_pods_reach_the_rendezvous_store() -> None:
    """Issue 38: the store has no authentication and torch's rendezvous state in it is a pickle."""
    objs = k8s_objects()
    policy, labels = objs["NetworkPolicy"], objs["Job"]["spec"]["template"]["metadata"]["labels"]
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = policy["spec"]["ingress"]
    assert [peer["podSelector"]["matchLabels"] for peer in rule["from"]] == [policy["spec"]["podSelector"]["matchLabels"]]
    port = int(launcher_args()["--rdzv-endpoint"].rsplit(":", 1)[1])
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]


def test_k8s_configmap_loads_and_grace_period_covers_the_kill_escalation(tmp_path: Path) -> None:
    cfg = configmap_config(tmp_path)
    env = {e["name"]: e.get("value") for e in launcher_container().get("env", [])}
    torch_shutdown = int(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or TORCH_SHUTDOWN_TIMEOUT)
    grace = pod_spec()["terminationGracePeriodSeconds"]
    assert grace > cfg.stack_dump_timeout + cfg.termination_grace_time + torch_shutdown
    assert grace > kill_escalation(cfg)


def test_k8s_launcher_is_the_entrypoint_with_the_configmap(tmp_path: Path) -> None:
    container = launcher_container()
    assert container["command"] == ["ft-launcher"]
    args = launcher_args()
    cfg_path = Path(args["--ft-cfg-path"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    config_volume = volumes[mounts[str(cfg_path.parent)]]
    assert config_volume["configMap"]["name"] == k8s_objects()["ConfigMap"]["metadata"]["name"]
    assert cfg_path.name in k8s_objects()["ConfigMap"]["data"]


def test_k8s_rendezvous_on_pod_zero_of_the_indexed_job() -> None:
    objs = k8s_objects()
    job, service = objs["Job"], objs["Service"]
    spec, args = job["spec"], launcher_args()
    assert spec["completionMode"] == "Indexed"
    assert int(args["--nnodes"]) == spec["completions"] == spec["parallelism"]
    assert service["spec"]["clusterIP"] == "None"
    assert pod_spec()["subdomain"] == service["metadata"]["name"]
    labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    host, port = args["--rdzv-endpoint"].rsplit(":", 1)
    assert host.split(".")[:2] == [f"{job['metadata']['name']}-0", service["metadata"]["name"]]
    assert args["--rdzv-backend"] == "c10d"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]


def test_k8s_tmp_and_shm_are_emptydirs() -> None:
    """The launcher's run dir (sockets) is made in a hard-coded /tmp, not in $TMPDIR."""
    assert 'tempfile.mkdtemp(prefix="ft-launcher-", dir="/tmp")' in (ROOT / "ft_monitor/launcher/main.py").read_text()
    mounts = {m["mountPath"]: m["name"] for m in launcher_container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_k8s_pod_failure_policy_follows_the_exit_codes() -> None:
    spec = k8s_objects()["Job"]["spec"]
    assert pod_spec()["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert spec["backoffLimit"] >= 1
    fail_job: set[int] = set()
    for rule in spec["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        assert codes["operator"] == "In"
        assert codes["containerName"] == launcher_container()["name"]
        if rule["action"] == "FailJob":
            fail_job |= set(codes["values"])
    assert fail_job == {exit_codes.LAUNCHER_ERROR, exit_codes.NO_PROGRESS, exit_codes.SHUTDOWN_REQUESTED}


# ---------------------------------------------------------------------------
# systemd


def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """systemd's INI dialect: [Section], Key=Value (keys may repeat, values may be empty)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        m = re.fullmatch(r"\[([A-Za-z]+)\]", line)
        if m:
            current = sections.setdefault(m.group(1), [])
            continue
        m = re.fullmatch(r"([A-Za-z][A-Za-z0-9]*)=(.*)", line)
        assert m and current is not None, f"line {n} is neither a section nor Key=Value: {line!r}"
        current.append((m.group(1), m.group(2).strip()))
    return sections


def unit() -> dict[str, dict[str, str]]:
    return {name: dict(items) for name, items in unit_sections(UNIT.read_text()).items()}


def test_systemd_unit_sections_and_keys() -> None:
    u = unit()
    assert set(u) == {"Unit", "Service", "Install"}
    svc = u["Service"]
    assert u["Unit"]["Description"]
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert svc["User"] not in ("", "root")
    assert svc["RuntimeDirectory"] == "ft-monitor"
    assert svc["RuntimeDirectoryMode"] == "0700"
    assert svc["Restart"] == "on-failure"
    assert svc["KillSignal"] == "SIGTERM"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}.items():
        assert svc[key] == value


def test_systemd_execstart_is_a_valid_serve_command() -> None:
    exec_start = unit()["Service"]["ExecStart"].split()
    assert Path(exec_start[0]).name == "ft-monitor"
    argv = [a.replace("%i", "rank0") for a in exec_start[1:]]
    args = cli.build_parser().parse_args(argv)
    assert args.command == "serve"
    assert args.socket == "/run/ft-monitor/rank0.sock"
    assert args.config == "/etc/ft-monitor/ft.yaml"
    cfg = load_config(None, NO_ENV, cli_overrides(args))
    assert cfg.report_dir is not None
    svc = unit()["Service"]
    writable = [p.lstrip("-") for p in svc["ReadWritePaths"].split()] + ["/var/lib/" + svc["StateDirectory"]]
    assert any(Path(cfg.report_dir).is_relative_to(p) for p in writable)


def test_systemd_stop_timeout_covers_the_hang_handling() -> None:
    cfg = FaultToleranceConfig()  # /etc/ft-monitor/ft.yaml starts from examples/ft.yaml; both are below
    example = load_config(ROOT / "examples" / "ft.yaml", NO_ENV)
    stop = float(unit()["Service"]["TimeoutStopSec"])
    for c in (cfg, example):
        assert stop > c.stack_dump_timeout + c.termination_grace_time
        assert stop > c.termination_grace_time + 1.0  # the daemon's own bound at shutdown


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on a copy whose ExecStart points at an executable that exists here."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    exe = Path(sys.executable).parent / "ft-monitor"
    if not exe.exists():
        exe = Path(shutil.which("true") or "/bin/true")
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", UNIT.read_text(), flags=re.M)
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    try:
        proc = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=20,
                              env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})
    except subprocess.TimeoutExpired:
        pytest.skip("systemd-analyze verify did not finish in 20 s here")
    out = proc.stdout + proc.stderr
    # A problem in the file itself is reported as "<file>:<line>: ..." (unknown key, bad value),
    # even with exit status 0: that fails the test. Anything else failing is the environment.
    problems = [line for line in out.splitlines() if re.search(re.escape(UNIT.name) + r":\d+:", line)]
    assert not problems, "\n".join(problems)
    if proc.returncode != 0:
        pytest.skip(f"systemd-analyze verify cannot run here: {out.strip()[:300]}")
