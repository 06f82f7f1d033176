"""One `ft-monitor serve` daemon per local rank, owned by the launcher.

Daemons are separate processes (they never import torch), started before the
first workers, ready (their socket answers) before any worker starts, and kept
across worker restarts. A daemon that dies is started again and the event is
logged. Each daemon gets the launcher's validated settings and socket, as a
`settings.ServeSpec` in ``<run>/monitor<L>.json`` (``ft-monitor --run-checked``),
and dies with the launcher (parent-death signal) if the launcher is killed outright.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from ft_client import wire
from ft_client.observer import ping, try_status
from ft_client.startup.parent_death import die_with_parent
from ft_client.wire.transport import TransportError, connect
from ft_monitor.core.serve_argv import RUN_CHECKED
from ft_monitor.core.settings import ServeSpec, Settings
from ft_monitor.core.status import MonitorStatus, StatusError
from ft_monitor.processes.escalation import terminate_then_kill
from ft_monitor.processes.monitor_process import MonitorStartError

log = logging.getLogger("ft_monitor.launcher")


READY_TIMEOUT = 30.0
ANNOUNCE_TIMEOUT = 2.0
"""Seconds for telling a daemon of its new worker (connect, handshake, WORKER_STARTED, ACK)."""


class MonitorPool:
    def __init__(self, run_dir: Path, nproc: int, launcher_socket: str, config: Settings) -> None:
        self.run_dir = run_dir
        self.nproc = nproc
        self.launcher_socket = launcher_socket
        self.config = config  # validated once, by the launcher
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts = 0

    def socket(self, local_rank: int) -> Path:
        return self.run_dir / f"monitor{local_rank}.sock"

    def log_path(self, local_rank: int) -> Path:
        return self.run_dir / f"monitor{local_rank}.log"

    def _spawn(self, local_rank: int) -> subprocess.Popen[bytes]:
        settings = self.run_dir / f"monitor{local_rank}.json"
        settings.write_text(ServeSpec(self.config, str(self.socket(local_rank)),
                                      launcher_socket=self.launcher_socket).to_json())
        argv = [sys.executable, "-m", "ft_monitor.cli", RUN_CHECKED, str(settings)]
        with open(self.log_path(local_rank), "ab") as out:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=die_with_parent)

    def start(self) -> None:
        for lr in range(self.nproc):
            self.procs[lr] = self._spawn(lr)
        for lr in range(self.nproc):
            self._wait_ready(lr)
        log.info("ft-launcher: %d monitor(s) ready in %s", self.nproc, self.run_dir)

    def _wait_ready(self, local_rank: int) -> None:
        proc = self.procs[local_rank]
        end = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise MonitorStartError(f"monitor for local rank {local_rank} exited with {proc.returncode} "
                                        f"at start; see {self.log_path(local_rank)}:\n{self._tail(local_rank)}")
            if ping(str(self.socket(local_rank)), 1.0):
                return
            time.sleep(0.01)
        raise MonitorStartError(f"monitor for local rank {local_rank} not ready within {READY_TIMEOUT:.0f}s; "
                                f"see {self.log_path(local_rank)}")

    def _tail(self, local_rank: int) -> str:
        try:
            return "".join(self.log_path(local_rank).read_text().splitlines(True)[-10:])
        except OSError:
            return ""

    def check(self) -> None:
        """Restart any daemon that died (logged)."""
        for lr, proc in list(self.procs.items()):
            if proc.poll() is None:
                continue
            self.restarts += 1
            log.error("ft-launcher: monitor for local rank %d (pid %d) died with %s; restarting it",
                      lr, proc.pid, proc.returncode)
            self.procs[lr] = self._spawn(lr)
            self._wait_ready(lr)
            log.warning("ft-launcher: monitor for local rank %d restarted as pid %d", lr, self.procs[lr].pid)

    def announce(self, local_rank: int, pid: int, rank: int, error_file: str | None) -> None:
        """Tell the daemon of ``local_rank`` that its worker ``pid`` (global rank ``rank``) has
        just started, so it times the worker's start-up (startup_timeout). Best effort: a
        daemon that cannot be told is logged, and the worker is then timed from its handshake."""
        path = str(self.socket(local_rank))
        try:
            t, _ = connect(path, ANNOUNCE_TIMEOUT, wire.Role.LAUNCHER, rank)
        except (TransportError, OSError) as e:
            log.warning("ft-launcher: cannot tell monitor %d of worker pid %d: %s; its start-up is not timed",
                        local_rank, pid, e)
            return
        try:
            reply = t.request(wire.WorkerStarted(pid, rank, error_file))
        except TransportError as e:
            reply = wire.Error(wire.ErrorCode.PROTOCOL, str(e))
        finally:
            t.close()
        if not isinstance(reply, wire.Ack):
            log.warning("ft-launcher: monitor %d did not take worker pid %d: %s; its start-up is not timed",
                        local_rank, pid, reply)

    def is_monitor(self, pid: int) -> bool:
        """One of this launcher's daemons (the only peers that may report hangs)."""
        return any(proc.pid == pid and proc.poll() is None for proc in list(self.procs.values()))

    def statuses(self) -> dict[int, MonitorStatus | None]:
        """Each local daemon's status (None where it does not answer, or answers nonsense)."""
        out: dict[int, MonitorStatus | None] = {}
        for lr in range(self.nproc):
            raw = try_status(str(self.socket(lr)))
            try:
                out[lr] = None if raw is None else MonitorStatus.from_wire(raw)
            except StatusError as e:
                log.warning("ft-launcher: monitor %d answered STATUS with %s", lr, e)
                out[lr] = None
        return out

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every daemon, ``grace`` for all of them to exit, then SIGKILL (escalation.py)."""
        procs = list(self.procs.values())

        class Daemons:
            def send(self, sig: int) -> bool:
                running = [p for p in procs if p.poll() is None]
                for p in running:
                    p.send_signal(sig)
                return bool(running)

        async def gone(timeout: float) -> bool:
            end = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() >= end:
                    return False
                await asyncio.sleep(0.01)
            return True

        asyncio.run(terminate_then_kill(Daemons(), signal.SIGTERM, grace, gone, cont=False))
