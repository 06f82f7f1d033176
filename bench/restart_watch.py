"""The outside watch of bench/restart_warm.py's runs: every 0.1 s, the ft-launcher's children
read from /proc (their start time, command line, RSS, PSS and USS): the worker templates,
when each was started and ready, and attempt 1's memory after the restart."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import read_kb

TEMPLATE_MODULE = "ft_monitor.launcher.warm.template"
AFTER_RESTART_S = (0.5, 3.0)
"""When, after the launcher's "all ranks running again" line, attempt 1's memory is read (the
figure is the last: forked workers share fewer of the template's pages as they run)."""


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks since boot) of /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def _memory_kb(pid: int) -> dict[str, int | None]:
    """VmRSS, and Pss and USS (Private_*) of /proc/PID/smaps_rollup (None where unreadable)."""
    out: dict[str, int | None] = {"rss_kb": None, "pss_kb": None, "uss_kb": None}
    try:
        out["rss_kb"] = read_kb(pid)
    except (OSError, KeyError):
        return out
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
    except (OSError, ValueError, IndexError):
        return out
    out["pss_kb"] = fields.get("Pss")
    out["uss_kb"] = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return out


class Watch(threading.Thread):
    """Watches one ft-launcher run from outside, every 0.1 s: its worker templates (children
    running `TEMPLATE_MODULE`, one per --socket path: a forked worker keeps its template's
    command line, so the first pid seen with a path is the template), when each was started
    (/proc/PID/stat) and ready (its socket exists: it binds it once its imports are done), and
    its memory 0.5 s after ready (idle, before any fork); and, at each of AFTER_RESTART_S after
    the launcher's "all ranks running again" line, the memory of attempt 1: its workers (forked:
    the template's command line, another pid; cold: the script's) and the templates alive."""

    def __init__(self, launcher: int, out_path: Path, script_mark: str) -> None:
        super().__init__(daemon=True)
        self.launcher = launcher
        self.out_path = out_path
        self.script = script_mark
        self.btime = _boot_time()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.templates: list[dict[str, Any]] = []
        self._by_socket: dict[str, dict[str, Any]] = {}
        self.after: dict[str, Any] = {}
        self._restarted_at: float | None = None
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    def run(self) -> None:
        while not self._done.wait(0.1):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - a bench watcher: never kill the run; say it in the JSON
                self.after["error"] = f"{type(e).__name__}: {e}"
                return

    def _children(self) -> list[tuple[int, int, list[str]]]:
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            st = _proc_stat(int(name))
            if st is not None and st[0] == self.launcher:
                out.append((int(name), st[1], _cmdline(int(name))))
        return out

    def _tick(self) -> None:
        now = time.time()
        children = self._children()
        for pid, started, argv in children:
            if TEMPLATE_MODULE in argv and "--socket" in argv and self._restarted_at is None:
                sock = argv[argv.index("--socket") + 1]
                if sock not in self._by_socket:
                    preload = argv[argv.index("--preload") + 1].split(",") if "--preload" in argv else []
                    t = {"pid": pid, "socket": sock, "modules": len(preload),
                         "started": self.btime + started / self.tick, "ready": None,
                         "rss_kb": None, "pss_kb": None, "uss_kb": None}
                    self._by_socket[sock] = t
                    self.templates.append(t)
        for t in self.templates:
            if t["ready"] is None and os.path.exists(t["socket"]):
                t["ready"] = now
            elif t["ready"] is not None and t["rss_kb"] is None and now - t["ready"] >= 0.5 \
                    and self._restarted_at is None:
                t.update(_memory_kb(t["pid"]))
        if self._restarted_at is None:
            try:
                if "all ranks running again" in self.out_path.read_text(errors="replace"):
                    self._restarted_at = now
            except OSError:
                pass
            return
        due = [t for t in AFTER_RESTART_S if f"{t:g}" not in self.after and now - self._restarted_at >= t]
        if due:
            tpids = {t["pid"] for t in self.templates}
            socks = set(self._by_socket)
            workers = [pid for pid, _, argv in children if pid not in tpids and (
                self.script in argv or (TEMPLATE_MODULE in argv and socks.intersection(argv)))]
            alive = [pid for pid, _, _ in children if pid in tpids]
            mem = {pid: _memory_kb(pid) for pid in workers + alive}

            def total(pids: list[int], key: str) -> int | None:
                vals = [mem[p][key] for p in pids]
                return None if not vals or any(v is None for v in vals) else sum(v for v in vals if v is not None)

            self.after[f"{due[0]:g}"] = {"at_s": round(now - self._restarted_at, 2), "workers": len(workers),
                                           "templates_alive": len(alive),
                                           "workers_rss_kb": total(workers, "rss_kb"),
                                           "workers_pss_kb": total(workers, "pss_kb"),
                                           "templates_pss_kb": total(alive, "pss_kb") if alive else 0}

