"""A real Slurm on this machine, for the end-to-end tests of deploy/slurm (issue 43).

Debian bookworm's Slurm 22.05 (slurmctld, slurmd, slurm-client, munge) and, for Slurm's own
accounting (`sacct`), slurmdbd with a MariaDB server: scripts/setup-env installs them where it
runs as root with apt. Nothing of the machine's own configuration is used or changed: one
private folder holds a munge key and socket, a MariaDB data folder (an empty one: MariaDB
creates what it needs, and with ``--skip-grant-tables`` on a loopback port no user tables are
wanted), slurmdbd.conf, and per cluster a generated slurm.conf (found through ``SLURM_CONF``),
the controller's state, the slurmds' spool folders, pid files and every daemon's log. Ports are
free loopback ports. The daemons run in the foreground as children of the test process, each in
its own session, and are stopped by `Site.stop`; Slurm's own step daemons (``slurmstepd``,
orphaned on purpose by slurmd) are found by the ``SLURM_CONF`` in their environment.

Containers have neither systemd nor usable cgroups: processes are tracked by parentage
(proctrack/linuxproc), tasks are not bound (task/none). The slurmds declare more CPUs than the
machine has (``SlurmdParameters=config_overrides``), so that a test module's jobs run side by
side. A cluster may have two slurmds on this one machine (``slurmd -N``, each its own port):
Debian's build runs them; `Cluster.nodes` says how many registered.

`Site.skip_reason` says why the tests cannot run here (not root, a program missing).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.procs import free_port, wait_until

PROGRAMS = ("munged", "mariadbd", "slurmdbd", "sacctmgr", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo",
            "sacct", "scontrol", "scancel", "srun")
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE")
"""sacct states after which a job (this run of it) does nothing more."""
CRED_EXPIRE = 10
"""AuthInfo's cred_expire: also the seconds a requeued job waits before it may start again
(Slurm's default, 120, would make the requeue test wait two minutes)."""


def skip_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "the Slurm tests start munged, slurmdbd, slurmctld and slurmd as root, and this is not root"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (f"no {', '.join(missing)} here (scripts/setup-env installs Debian's slurmctld, slurmd, slurm-client, "
                "munge, slurmdbd and mariadb-server where it runs as root with apt)")
    return None


class Daemon:
    """One daemon in the foreground, its own session, its output appended to ``log``."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str]) -> None:
        self.argv = list(argv)
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (each of these daemons saves its state and exits on it); SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _tcp_answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def process_table() -> dict[int, tuple[str, bytes]]:
    """Every process now: pid -> (command line, environment block)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            cmd = _read(Path("/proc", name, "cmdline")).replace(b"\0", b" ").decode(errors="replace").strip()
            if cmd:  # a zombie or a kernel thread has none
                out[int(name)] = (cmd, _read(Path("/proc", name, "environ")))
    return out


@dataclass
class Cluster:
    """One slurmctld and its slurmds; every command runs with ``SLURM_CONF`` set to its slurm.conf."""

    name: str
    dir: Path
    conf: Path
    env: dict[str, str]
    ctld_port: int
    node_names: list[str]
    controller: Daemon | None = None
    slurmds: list[Daemon] | None = None
    nodes: int = 0
    """How many slurmds registered (two asked for: one where this Slurm cannot run two)."""
    node_note: str = ""
    """Why fewer nodes registered than were asked for."""

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster."""
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def start_controller(self) -> None:
        self.controller = Daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], self.dir / "log" / "slurmctld.out",
                                 self.env)
        wait_until(self._controller_up, 60, f"slurmctld of cluster {self.name} answering", interval=0.1)

    def _controller_up(self) -> bool:
        assert self.controller is not None and self.controller.alive(), self.log_tail("slurmctld.out")
        return "is UP" in self.run("scontrol", "ping", check=False, timeout=30).stdout

    def stop_controller(self) -> None:
        """Stop slurmctld (it saves its state: `start_controller` brings the jobs back)."""
        assert self.controller is not None
        self.controller.stop()

    def idle_nodes(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=30).stdout
        return sorted(n for n, state in (line.split() for line in out.splitlines() if line.strip())
                      if state in ("idle", "mix", "alloc"))

    def queue(self) -> dict[str, str]:
        """job id -> "STATE REASON" of every job slurmctld lists (pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%i %T %r", check=False, timeout=30).stdout
        return {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.strip()}

    def sacct(self, job_id: str) -> list[dict[str, str]]:
        """Slurm's accounting of the job: every run (--duplicates: a requeued job has one record
        per run) and every step, in order."""
        fields = ("JobID", "State", "ExitCode", "DerivedExitCode", "TotalCPU", "NNodes", "NodeList", "Start", "End")
        out = self.run("sacct", "-n", "-P", "--duplicates", "-j", job_id, "-o", ",".join(fields), timeout=60).stdout
        return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]

    def job_processes(self, job_id: str) -> dict[int, str]:
        """The job's processes on this machine: the batch script, srun, the launchers, monitors and
        ranks (their environment has the job's id and this cluster's slurm.conf), and Slurm's step
        daemons for the job (``slurmstepd: [ID.STEP]``)."""
        conf = f"SLURM_CONF={self.conf}\0".encode()
        job = f"SLURM_JOB_ID={job_id}\0".encode()
        out = {}
        for pid, (cmd, env) in process_table().items():
            ours = (b"\0" + conf) in (b"\0" + env)
            if ours and ((b"\0" + job) in (b"\0" + env) or cmd.startswith(f"slurmstepd: [{job_id}.")):
                out[pid] = cmd
        return out

    def stray_processes(self) -> dict[int, str]:
        """Slurm's step daemons and the jobs' processes of this cluster still running (not its
        daemons, nor slurmctld's helper, slurmscriptd)."""
        conf = f"SLURM_CONF={self.conf}\0".encode()
        return {pid: cmd for pid, (cmd, env) in process_table().items()
                if (b"\0" + conf) in (b"\0" + env) and pid != os.getpid()
                and (cmd.startswith("slurmstepd:") or b"\0SLURM_JOB_ID=" in b"\0" + env)}

    def log_tail(self, name: str, lines: int = 40) -> str:
        text = _read(self.dir / "log" / name).decode(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def logs(self) -> str:
        """The tail of each daemon's log, for a failing test's report."""
        names = sorted(p.name for p in (self.dir / "log").iterdir()) if (self.dir / "log").is_dir() else []
        return "\n".join(f"--- {self.name}: {n} ---\n{self.log_tail(n)}" for n in names)

    def stop(self) -> None:
        # first what Slurm left: a step daemon still retrying its message to a controller that
        # was down keeps slurmd from exiting on SIGTERM (30 s, then our SIGKILL)
        for pid in self.stray_processes():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for d in [*(self.slurmds or []), self.controller]:
            if d is not None:
                d.stop()


class Site:
    """munged, MariaDB and slurmdbd, shared by one or more clusters (each its own slurmctld and
    slurmds and ClusterName in the one accounting database)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemons: list[Daemon] = []
        self.clusters: dict[str, Cluster] = {}
        self.hostname = socket.gethostname().split(".")[0]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "FT_"))}
        try:
            self._start_accounting()
        except BaseException:
            self.stop()
            raise

    def add(self, clusters: dict[str, int]) -> None:
        """Configure and start clusters: name -> how many slurmds (nodes) it should have. The
        caller stops the site if this raises."""
        added = [self._configure(name, nodes) for name, nodes in clusters.items()]
        self.clusters.update((c.name, c) for c in added)
        # slurmctld records jobs only for a cluster slurmdbd knows (22.05 does not add it itself)
        added[0].run("sacctmgr", "-i", "add", "cluster", *clusters, timeout=120)
        for cluster in added:
            cluster.start_controller()
        for cluster in added:
            self._start_slurmds(cluster)

    # -- accounting: munge, MariaDB, slurmdbd ---------------------------------------------------

    def _start_accounting(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = munge / "sock"
        log = self.root / "log"
        log.mkdir(exist_ok=True)
        self._add(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                   f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}", "--num-threads=2"],
                  log / "munged.log")
        wait_until(lambda: self._alive() and self.munge_socket.exists(), 30, "munged's socket", interval=0.05)

        self.db_port = free_port()
        data = self.root / "db"
        data.mkdir(mode=0o700)
        self._add(["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={self.root / 'db.sock'}",
                   f"--port={self.db_port}", "--bind-address=127.0.0.1", "--skip-grant-tables", "--user=root",
                   f"--pid-file={self.root / 'db.pid'}", "--skip-log-bin", "--innodb-buffer-pool-size=16M",
                   "--innodb-log-file-size=4M", "--innodb-flush-method=nosync", "--innodb-doublewrite=0",
                   "--innodb-flush-log-at-trx-commit=0"], log / "mariadbd.log")
        wait_until(lambda: self._alive() and _tcp_answers(self.db_port), 60, "MariaDB on its port", interval=0.05)

        # slurmdbd reads slurmdbd.conf from the folder of SLURM_CONF (which it does not read)
        self._dbd_conf_dir = self.root / "dbd"
        self._dbd_conf_dir.mkdir(mode=0o700)
        self.dbd_port = free_port()
        conf = self._dbd_conf_dir / "slurmdbd.conf"
        conf.write_text("\n".join([
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}", "DbdHost=localhost",
            "DbdAddr=127.0.0.1", f"DbdPort={self.dbd_port}", "SlurmUser=root",
            f"PidFile={self.root / 'slurmdbd.pid'}", "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1", f"StoragePort={self.db_port}", "StorageUser=root", "StorageLoc=slurm_acct",
            "DebugLevel=info", "",
        ]))
        conf.chmod(0o600)
        self._add(["slurmdbd", "-D"], log / "slurmdbd.log", {**self.env, "SLURM_CONF": str(self._dbd_conf_dir / "slurm.conf")})
        wait_until(lambda: self._alive() and _tcp_answers(self.dbd_port), 60, "slurmdbd on its port", interval=0.05)

    def _add(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(argv, log, self.env if env is None else env)
        self.daemons.append(d)
        return d

    def _alive(self) -> bool:
        dead = [d for d in self.daemons if not d.alive()]
        assert not dead, "\n".join(f"{d.argv[0]} exited {d.proc.returncode}:\n{_read(d.log).decode(errors='replace')}"
                                   for d in dead)
        return True

    def _client_env(self, conf: Path | None = None) -> dict[str, str]:
        return {**self.env, "SLURM_CONF": str(conf or self._dbd_conf_dir / "slurm.conf")}

    # -- clusters --------------------------------------------------------------------------------

    def _configure(self, name: str, nodes: int) -> Cluster:
        d = self.root / name
        node_names = [f"{name}{i + 1}" for i in range(nodes)]
        for sub in ("state", "log", *(f"spool/{n}" for n in node_names)):
            (d / sub).mkdir(parents=True, mode=0o700)
        ctld_port = free_port()
        node_lines = [f"NodeName={n} NodeHostname={self.hostname} NodeAddr=127.0.0.1 Port={free_port()} CPUs=16 "
                      "RealMemory=4000 State=UNKNOWN" for n in node_names]
        conf = d / "slurm.conf"
        conf.write_text("\n".join([
            f"ClusterName={name}",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd'}-%n.pid",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # no systemd, no cgroups in a container: track processes by parentage, bind nothing
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/linux",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.dbd_port}",
            f"AccountingStoragePass={self.munge_socket}",  # for slurmdbd connections: munge's socket
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # a requeued job starts 2 s after it may, not 60 s
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # CPUs= below, whatever the machine has
            "KillWait=30",  # Slurm's default, which deploy/slurm/README.md's timing is about
            "MinJobAge=600",
            "MailProg=/bin/true",
            *node_lines,
            "PartitionName=ft Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        return Cluster(name, d, conf, self._client_env(conf), ctld_port, node_names)

    def _start_slurmds(self, cluster: Cluster) -> None:
        cluster.slurmds = [Daemon(["slurmd", "-D", "-N", n, "-f", str(cluster.conf)],
                                  cluster.dir / "log" / f"slurmd-{n}.out", cluster.env) for n in cluster.node_names]

        def registered() -> list[str]:
            assert cluster.slurmds is not None
            idle = cluster.idle_nodes()
            if len(idle) == len(cluster.node_names):
                return idle
            if not cluster.slurmds[0].alive():
                raise AssertionError(f"slurmd of {cluster.node_names[0]} exited:\n{cluster.logs()}")
            if idle and any(not d.alive() for d in cluster.slurmds):
                return idle  # the first node runs; a second slurmd on this machine does not
            return []

        idle = wait_until(registered, 60, f"the slurmds of cluster {cluster.name} registering", interval=0.1)
        cluster.nodes = len(idle)
        if cluster.nodes < len(cluster.node_names):
            dead = [d for d in cluster.slurmds if not d.alive()]
            cluster.node_note = "; ".join(f"{' '.join(d.argv)} exited {d.proc.returncode}: "
                                          f"{_read(d.log).decode(errors='replace')[-500:]}" for d in dead)

    # -- the end ---------------------------------------------------------------------------------

    def logs(self) -> str:
        site = "\n".join(f"--- {d.log.name} ---\n" + "\n".join(_read(d.log).decode(errors="replace").splitlines()[-30:])
                         for d in self.daemons)
        return "\n".join([site, *(c.logs() for c in self.clusters.values())])

    def stop(self) -> None:
        """Stop every cluster, then slurmdbd, MariaDB and munged; kill what Slurm left (its step
        daemons wait for a controller that is gone)."""
        for cluster in self.clusters.values():
            cluster.stop()
        for d in reversed(self.daemons):
            d.stop()


def elapsed_seconds(text: str) -> int:
    """squeue's %M ([D-][HH:]MM:SS) in seconds."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


@dataclass
class Job:
    """A batch job submitted to a `Cluster`, its output and ft-logs in ``dir``."""

    cluster: Cluster
    dir: Path
    id: str

    @property
    def out_path(self) -> Path:
        return self.dir / f"slurm-{self.id}.out"

    def output(self) -> str:
        return _read(self.out_path).decode(errors="replace")

    def run_dir(self, run: int) -> Path:
        """ft-logs/<job id>/run-<requeue count>, as deploy/slurm/ft_train.sbatch lays it out."""
        return self.dir / "ft-logs" / self.id / f"run-{run}"

    def exit_codes(self, run: int) -> list[str]:
        """The launchers' exit codes of one run, by node id."""
        files = sorted(self.run_dir(run).glob("exit-code.*"), key=lambda p: int(p.suffix[1:]))
        return [p.read_text().strip() for p in files]


def submit(cluster: Cluster, directory: Path, argv: Sequence[str], env: dict[str, str], cwd: Path) -> Job:
    """``sbatch --parsable ARGV`` from ``cwd``; the job's output goes to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["sbatch", "--parsable", f"--output={directory}/slurm-%j.out", *argv],
                          env={**cluster.env, **env}, cwd=cwd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"sbatch exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    return Job(cluster, directory, proc.stdout.strip().split(";")[0])
