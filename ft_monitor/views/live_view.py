"""The live view: every monitor of a run directory in one table (`ft-monitor status --all DIR`,
`ft-launcher status [DIR]`).

`gather` asks each ``*.sock`` in the directory for its STATUS (an observer
connection each; a socket that does not answer is a row that says so);
`format_table` (pure) renders one line per rank: state, the section open now and
for how long, the last heartbeat, the median step time, the iteration, the
timeouts in force and the hangs its monitor saw; names a rank chose (sections) are
escaped with `server_log.printable`, as in the logs, so no escape sequence reaches
the operator's terminal. `to_json` is the same for scripts. `find_run_dirs` is how
`ft-launcher status` finds this user's running launchers when no directory is given.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_client.timeouts import STEP_SECTION
from ft_monitor.core.server_log import printable
from ft_monitor.core.status import MonitorStatus, StatusError

RUN_DIR_GLOB = "ft-launcher-*"


@dataclass(frozen=True, slots=True)
class Row:
    socket: str
    status: MonitorStatus | None
    error: str | None = None


def _socket_order(path: Path) -> tuple[int, str]:
    m = re.search(r"(\d+)\.sock$", path.name)
    return (int(m.group(1)) if m else 1 << 30, path.name)


def monitor_sockets(directory: str | os.PathLike[str]) -> list[Path]:
    """The monitor sockets in ``directory`` (``monitor<L>.sock`` first, by local rank), not the launcher's."""
    out = []
    for p in Path(directory).glob("*.sock"):
        try:
            if stat.S_ISSOCK(p.lstat().st_mode) and p.name != "launcher.sock":
                out.append(p)
        except OSError:
            continue
    return sorted(out, key=_socket_order)


def gather(directory: str | os.PathLike[str], timeout: float = 2.0) -> list[Row]:
    from ft_client.observer import status
    from ft_client.transport import TransportError

    rows = []
    for sock in monitor_sockets(directory):
        try:
            rows.append(Row(str(sock), MonitorStatus.from_wire(status(str(sock), timeout))))
        except (OSError, TransportError) as e:
            rows.append(Row(str(sock), None, f"no answer: {e}"))
        except StatusError as e:
            rows.append(Row(str(sock), None, f"unreadable status: {e}"))
    return rows


def find_run_dirs(base: str = "/tmp") -> list[Path]:
    """This user's ft-launcher run directories under ``base`` that hold monitor sockets."""
    out = []
    for d in sorted(Path(base).glob(RUN_DIR_GLOB)):
        try:
            st = d.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and monitor_sockets(d):
            out.append(d)
    return out


def _secs(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}s"


def _timeouts(t: dict[str, Any]) -> str:
    learned = set(t.get("learned", ()))
    parts = []
    for name, value in sorted((t.get("rank_section_timeouts") or {}).items()):
        mark = "*" if f"section:{name}" in learned else ""
        parts.append(f"{printable(name)}={'off' if value is None else f'{value:g}'}{mark}")
    hb = t.get("rank_heartbeat_timeout")
    if hb is not None:
        parts.append(f"hb={hb:g}{'*' if 'rank_heartbeat_timeout' in learned else ''}")
    return " ".join(parts) or "-"


def row_fields(row: Row) -> dict[str, Any]:
    """One rank's line as values (the JSON form)."""
    st = row.status
    out: dict[str, Any] = {"socket": row.socket, "error": row.error}
    if st is None:
        return out
    step = st.section_stats.get(STEP_SECTION)
    out.update({"monitor_pid": st.monitor_pid, "hangs": st.hangs_detected, "timeouts": st.timeouts,
                "step_median_s": None if step is None else step.median_recent(),
                "steps_timed": 0 if step is None else step.count})
    r = st.rank
    if r is None:
        out.update({"state": "not connected"})
        return out
    sec = r.open_sections[-1] if r.open_sections else None
    out.update({"rank": r.rank, "pid": r.pid, "state": r.phase,
                "section": None if sec is None else sec.name, "section_age_s": None if sec is None else sec.elapsed_s,
                "section_timeout_s": None if sec is None else sec.timeout_s,
                "since_last_heartbeat_s": r.since_last_heartbeat_s, "iteration": r.iteration_now})
    return out


HEADER = ("rank", "pid", "state", "section (age/timeout)", "last hb", "step p50", "iter", "timeouts (*learned)",
          "hangs")


def format_table(rows: Sequence[Row]) -> str:
    """The table (pure)."""
    lines: list[tuple[str, ...]] = [HEADER]
    for row in rows:
        f = row_fields(row)
        if row.status is None:
            lines.append((printable(Path(row.socket).name), "-", f"down ({printable(row.error)})", "", "", "", "", "",
                          ""))
            continue
        if "rank" not in f:
            lines.append((printable(Path(row.socket).name), "-", f["state"], "-", "-", _secs(f["step_median_s"], 3),
                          "-", _timeouts(f["timeouts"]), str(f["hangs"])))
            continue
        section = "-" if f["section"] is None else (
            f"{printable(f['section'])} ({_secs(f['section_age_s'])}/{_secs(f['section_timeout_s'])})")
        lines.append((str(f["rank"]), str(f["pid"]), f["state"], section, _secs(f["since_last_heartbeat_s"]),
                      _secs(f["step_median_s"], 3), "-" if f["iteration"] is None else str(f["iteration"]),
                      _timeouts(f["timeouts"]), str(f["hangs"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [row_fields(r) for r in rows]
