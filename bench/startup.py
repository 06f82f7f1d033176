"""Figure 4a: daemon start-to-ready and its memory at ready.

Each run spawns `python -m ft_monitor.cli serve --socket S --loop L` (with a
heartbeat and a section timeout configured, as in training) in a fresh private
directory and polls the socket every millisecond until it answers a PING
(connect + HELLO + PING). Start-to-ready = spawn -> PONG. At that moment VmRSS
is read from /proc/PID/status (and, for reference, the memory only the
daemon holds: USS from /proc/PID/smaps_rollup), and /proc/PID/maps is checked
for torch.
"""

from __future__ import annotations

import glob

from bench.harness import Daemon, Figure, Mode, cleanup, maps_mention, private_dir, private_kb, read_kb

DAEMON_FLAGS = ("--ft-rank-heartbeat-timeout", "600", "--ft-rank-section-timeouts", "step:600")
READY_TARGET_MS = 200.0
RSS_TARGET_MB = 30.0


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in nanoseconds."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def run(mode: Mode, loop: str) -> list[Figure]:
    runs = mode.pick(15, 7, 2)
    ready_ms: list[float] = []
    cpu_ms: list[float] = []
    rss_mb: list[float] = []
    uss_mb: list[float] = []
    anon_mb: list[float] = []
    torch_mapped = False
    for _ in range(runs):
        d = private_dir()
        try:
            daemon = Daemon(d, loop, *DAEMON_FLAGS)
            try:
                daemon.wait_ready()
                assert daemon.ready_after is not None
                ready_ms.append(daemon.ready_after * 1000)
                cpu_ms.append(cpu_ns(daemon.pid) / 1e6)
                rss_mb.append(daemon.rss_kb() / 1024)
                anon_mb.append(read_kb(daemon.pid, "RssAnon") / 1024)
                uss = private_kb(daemon.pid)
                if uss is not None:
                    uss_mb.append(uss / 1024)
                torch_mapped |= maps_mention(daemon.pid, "torch")
            finally:
                daemon.stop()
        finally:
            cleanup(d)
    how = f"{runs} daemons, spawn -> PONG, polled every 1 ms"
    return [
        Figure(id="daemon.ready", what="daemon start to ready", unit="ms", samples=ready_ms,
               target=f"<= {READY_TARGET_MS:g} ms", limit=READY_TARGET_MS, loop=loop, details={"how": how}),
        Figure(id="daemon.ready_cpu", what="daemon CPU time to ready", unit="ms", samples=cpu_ms, loop=loop,
               details={"how": "the daemon process's CPU time at its first PONG (/proc/PID/task/*/schedstat): "
                               "what load on the machine does not inflate"}),
        Figure(id="daemon.rss_ready", what="daemon RSS at ready", unit="MB", samples=rss_mb,
               target=f"<= {RSS_TARGET_MB:g} MB", limit=RSS_TARGET_MB, loop=loop,
               details={"how": "VmRSS from /proc/PID/status at ready", "torch_mapped": torch_mapped,
                        "rss_anon_mb": anon_mb}),
        Figure(id="daemon.uss_ready", what="daemon private memory (USS) at ready", unit="MB", samples=uss_mb,
               loop=loop, details={"how": "Private_Clean + Private_Dirty of /proc/PID/smaps_rollup; "
                                          "shared library pages are not counted"}),
        Figure(id="daemon.no_torch", what="daemon maps no torch library", unit="", value=not torch_mapped,
               target="no torch", met=not torch_mapped, loop=loop),
    ]
