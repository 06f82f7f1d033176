"""Real ft-launcher processes for the end-to-end tests, and what they leave behind.

A `Launcher` runs examples/train_ddp.py (DDP on gloo) under ``ft-launcher`` with 2 ranks. It
is forked from the test worker's zygote (`tests.zygote`: torch and the launcher's modules
already imported), and unless ``warm=False`` it runs with ``--ft-warm-start``: its workers,
attempt 0's included, are forked from the launcher's worker template, so that a launcher
imports torch once (in its template) instead of once per worker and attempt. Tests of the
default path, where every worker is a new interpreter (``warm=False``), stay cold:
docs/testing.md lists them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from ft_monitor.launcher import exit_codes
from tests import zygote
from tests.procs import ROOT, free_port, launcher_summary, slack

TRAIN = str(ROOT / "examples" / "train_ddp.py")
FT_FLAGS = ["--ft-cfg-path", str(ROOT / "examples" / "ft.yaml"), "--ft-termination-grace-time", "2"]
JOB_SECRET = {"FT_JOB_SECRET": "test-job-secret-" + "0123456789abcdef"}
"""Multi-node tests sign the launchers' store messages (store_auth) with this."""
WARM = ("--ft-warm-start", "--ft-preload",
        "torch.nn.parallel,torch._dynamo,torch.optim,ft_client,ft_client.inprocess,ft_client.snapshot")
"""What examples/train_ddp.py imports (DDP imports torch._dynamo), preloaded by the launcher's
template, which forks every attempt's workers."""


def _warm(preload: tuple[str, ...]) -> tuple[str, ...]:
    return (*WARM[:-1], ",".join((WARM[-1], *preload))) if preload else WARM


OWN_WARM_FLAGS = {"--ft-warm-restart", "--ft-warm-start", "--ft-preload", "-m", "--module", "--no-python"}
"""A test that gives one of these tests the launcher's warm path itself (or an entry point the
template cannot fork): `WARM` would change its scenario."""


def launcher_argv(*args: str) -> list[str]:
    """``ft-launcher ARGS`` as this interpreter runs it: the installed console script (a script
    the zygote can fork), else ``python -m ft_monitor.launcher.main``."""
    script = Path(sys.executable).parent / "ft-launcher"
    if script.is_file():
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "ft_monitor.launcher.main", *args]


class Launcher:
    """An ft-launcher process; everything it starts inherits a unique marker in its environment."""

    def __init__(self, workdir: Path, *args: str, train_args: tuple[str, ...] = (), name: str = "launcher",
                 launcher_flags: tuple[str, ...] = ("--standalone",), env: dict[str, str] | None = None,
                 relative: bool = False, entry: tuple[str, ...] = (TRAIN,), warm: bool = True,
                 cold_launcher: bool = False, preload: tuple[str, ...] = (), summary_flag: bool = True) -> None:
        """``relative``: started in ``workdir``, with --log-dir and --ft-summary-json relative to it;
        ``entry``: what torchrun runs (the training script; a module name after ``-m``);
        ``warm``: with `WARM`'s flags (False: every worker a new interpreter, as by default);
        ``cold_launcher``: the launcher itself a new interpreter too, as a user starts it;
        ``preload``: modules the warm template imports besides `WARM`'s (a framework: once per
        launcher instead of once per worker and attempt); ``summary_flag``: False leaves out
        --ft-summary-json (the summary then goes where the launcher writes it by default, and
        `summary` reads the path the launcher printed)."""
        if warm and set(args) & OWN_WARM_FLAGS:
            raise ValueError(f"{sorted(set(args) & OWN_WARM_FLAGS)} and warm=True: pass warm=False to test your own")
        self.marker = uuid.uuid4().hex
        self._seen: set[tuple[int, int]] = set()
        self.out_path = workdir / f"{name}.out"
        self.summary_path = workdir / f"{name}-summary.json"
        self.log_dir = workdir / f"{name}-logs"
        self.warm = warm
        paths = (self.log_dir, self.summary_path)
        log_dir, summary = (p.relative_to(workdir) if relative else p for p in paths)
        self.summary_flag = summary_flag
        argv = launcher_argv(*launcher_flags, "--nproc-per-node", "2", "--log-dir", str(log_dir),
                             *(("--ft-summary-json", str(summary)) if summary_flag else ()), *FT_FLAGS, *(_warm(preload) if warm else ()), *args,
                             *entry, "--ckpt-dir", str(workdir / "ckpt"), *train_args)
        self._out = open(self.out_path, "w")
        try:
            self.proc = zygote.popen(argv, stdout=self._out, stderr=zygote.STDOUT, cwd=workdir if relative else ROOT,
                                     env={**os.environ, **(env or {}), "FT_TEST_MARKER": self.marker},
                                     start_new_session=True, cold=cold_launcher)
        except BaseException:
            self._out.close()
            raise

    def processes(self) -> list[int]:
        """The job's live processes: those carrying its marker in their environment (what the
        launcher starts as new interpreters) and every descendant of the launcher seen so far
        (what is forked, whose /proc/PID/environ is the zygote's or the template's). Each call
        adds the launcher's descendants of the moment, so that those still alive after the
        launcher died are found too."""
        table = _process_table()
        self._seen |= _descendants(self.proc.pid, table)
        live = {pid for pid, start in self._seen if table.get(pid, (None, None))[1] == start}
        return sorted(live | set(job_processes(self.marker)))

    def wait(self, timeout: float = 240) -> int:
        try:
            code: int = self.proc.wait(timeout * slack())
            return code
        finally:
            self._out.close()

    def output(self) -> str:
        return self.out_path.read_text()

    def summary(self) -> dict[str, Any]:
        if not self.summary_flag:  # the path the closing summary printed
            self.summary_path = Path(dict(launcher_summary(self.output()))["summary"])
        data: dict[str, Any] = json.loads(self.summary_path.read_text())
        return data

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._out.close()

    def succeed(self) -> dict[str, Any]:
        """Run to the end, which must be a success (its output otherwise); its summary JSON."""
        try:
            assert self.wait() == exit_codes.SUCCESS, self.output()
        finally:
            self.kill()
        return self.summary()


def two_nodes(workdir: Path, rdzv_id: str, *args: str, train_args: tuple[str, ...],
              warm: tuple[bool, bool] = (True, True)) -> tuple[Launcher, Launcher]:
    """Two ft-launchers on one c10d rendezvous (one machine playing two nodes), run to the
    end; both must succeed."""
    common = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv-id", rdzv_id)
    a, b = (Launcher(workdir, *args, train_args=train_args, name=name, launcher_flags=common, env=JOB_SECRET,
                     warm=w) for name, w in zip(("node0", "node1"), warm))
    try:
        assert a.wait() == exit_codes.SUCCESS, a.output()
        assert b.wait() == exit_codes.SUCCESS, b.output()
    finally:
        a.kill()
        b.kill()
    return a, b


def all_succeed(nodes: list[Launcher]) -> None:
    """Wait for every launcher of a job; each must succeed (its output shown where one did not)."""
    try:
        for node in nodes:
            assert node.wait() == exit_codes.SUCCESS, node.output()
    finally:
        for node in nodes:
            node.kill()


def job_processes(marker: str) -> list[int]:
    """Live processes carrying the job's marker (the launcher, monitors, workers and their children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"FT_TEST_MARKER={marker}".encode() in environ and state != "Z":
            pids.append(int(entry))
    return pids


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every live (not zombie) process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def _descendants(root: int, table: dict[int, tuple[int, int]]) -> set[tuple[int, int]]:
    """(pid, start time) of ``root`` and every live descendant of it."""
    found: set[tuple[int, int]] = set()
    if root not in table:
        return found
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = [root]
    while todo:
        pid = todo.pop()
        found.add((pid, table[pid][1]))
        todo.extend(children.get(pid, []))
    return found


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_to_success(workdir: Path, *args: str, name: str, entry: tuple[str, ...],
                   train_args: tuple[str, ...] = (), preload: tuple[str, ...] = ()) -> Launcher:
    """A launcher run to its end, which must be a success (its output's tail says why not)."""
    la = Launcher(workdir, *args, name=name, entry=entry, train_args=train_args, preload=preload)
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()[-6000:]
    finally:
        la.kill()
    return la


def final_losses(out: str) -> dict[str, str]:
    """rank -> the final loss it printed (``[rank R] ... finished N steps, loss L``, the examples' last line)."""
    return dict(re.findall(r"\[rank (\d+)\] [^\[\n]*?finished \d+ steps, loss ([-0-9.e]+)", out))


def restarted_once_for_a_sigkill(la: Launcher, rank: int) -> None:
    """The launcher restarted once, for ``rank`` killed by SIGKILL in attempt 0 (its summary says so)."""
    (restart,) = la.summary()["restarts"]
    assert (restart["cause"], restart["rank"], restart["attempt"]) == ("failure", rank, 0), restart
    assert restart["how"].endswith("was killed by SIGKILL"), restart
