"""The live view: every monitor of a run directory in one table (`ft-monitor status --all DIR`,
`ft-launcher status [DIR]`).

`gather` asks each ``*.sock`` in the directory for its STATUS (an observer
connection each; a socket that does not answer is a row that says so);
`format_table` (pure) renders one line per rank: state, the section open now and
for how long, the last heartbeat, the median step time, the iteration, the hangs its
monitor saw and the timeouts in force; names a rank chose (sections), and whatever else
came over a socket or from a directory name, are escaped with `server_log.printable`, as
in the logs, so no escape sequence reaches the operator's terminal. On a terminal the
table fits its width (`format_table`'s ``width``: wide columns give way, cells are cut
with a mark, nothing wraps), columns aligned by display width (a wide character takes
two), and `view_lines` fits a view to its height, so that `--watch` redraws in place
(cli.py). `to_json` is the same for scripts. `find_run_dirs` is how
`ft-launcher status` finds this user's running launchers when no directory is given.
"""

from __future__ import annotations

import os
import re
import stat
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_client.timeouts import STEP_SECTION
from ft_monitor.core.server_log import printable
from ft_monitor.core.status import MonitorStatus, StatusError

RUN_DIR_GLOB = "ft-launcher-*"
ELLIPSIS = "\u2026"
"""Ends a cell or a line cut to fit the terminal (`clip`); "~" where stdout cannot encode it."""


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
    from ft_client.wire.transport import TransportError

    rows = []
    for sock in monitor_sockets(directory):
        try:
            rows.append(Row(str(sock), MonitorStatus.from_wire(status(str(sock), timeout))))
        except (OSError, TransportError) as e:
            rows.append(Row(str(sock), None, f"no answer: {e}"))
        except StatusError as e:
            rows.append(Row(str(sock), None, f"unreadable status: {e}"))
    return rows


def find_run_dirs(base: str = "/tmp", listening: set[str] | None = None) -> list[Path]:
    """This user's ft-launcher run directories under ``base`` whose monitors still listen: a
    launcher killed with SIGKILL leaves its folder and sockets behind, and they are not
    listed (their rows said only "down ... Connection refused")."""
    live = listening_sockets() if listening is None else listening
    out = []
    for d in sorted(Path(base).glob(RUN_DIR_GLOB)):
        try:
            st = d.lstat()
        except OSError:
            continue
        if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()):
            continue
        socks = monitor_sockets(d)
        if socks and (not live or any(str(p) in live for p in [*socks, d / "launcher.sock"])):
            out.append(d)
    return out


def listening_sockets(table: str = "/proc/net/unix") -> set[str]:
    """The paths of the Unix sockets some process listens on now (the kernel's table: nothing is
    connected to); empty where the table cannot be read, and then no folder is passed over."""
    try:
        with open(table, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return set()
    out = set()
    for line in lines:  # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000: __SO_ACCEPTCON
        parts = line.split(None, 7)
        if len(parts) == 8 and parts[3] == "00010000":
            out.add(parts[7])
    return out


def run_dir_of_log_folder(folder: str | os.PathLike[str], base: str = "/tmp") -> Path | None:
    """The running launcher's directory (its monitors' sockets) whose run writes to ``folder``,
    the run's log folder that ``ft-monitor report`` takes (the launcher names it there,
    `LOG_FOLDER_FILE`); None where no running launcher of this user's does."""
    from ft_client.safefiles import read_bounded
    from ft_monitor.launcher.telemetry.events import LOG_FOLDER_FILE

    wanted = os.path.realpath(folder)
    for d in find_run_dirs(base):
        try:
            if read_bounded(d / LOG_FOLDER_FILE, 4096) == wanted:
                return d
        except OSError:
            continue
    return None


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


HEADER = ("rank", "pid", "state", "section (age/timeout)", "last hb", "step p50", "iter", "hangs",
          "timeouts (*learned)")
SEPARATOR = "  "
SHRINK = {8: 8, 3: 12, 2: 8}
"""The columns that give way when the table is wider than the terminal, in this order
(timeouts, then the open section, then the state), and the narrowest each gets; a cell cut
short ends with the ellipsis mark."""


def display_width(text: str) -> int:
    """Columns ``text`` takes on a terminal: East Asian wide and full-width characters two,
    combining marks none (every other character `printable` lets through, one)."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def clip(text: str, width: int, mark: str = ELLIPSIS) -> str:
    """``text`` cut to at most ``width`` columns, ending with ``mark`` when cut."""
    if display_width(text) <= width:
        return text
    room = max(0, width - display_width(mark))
    out, used = [], 0
    for ch in text:
        w = display_width(ch)
        if used + w > room:
            break
        out.append(ch)
        used += w
    return "".join(out) + (mark if width >= display_width(mark) else "")


def _pad(text: str, width: int) -> str:
    return text + " " * max(0, width - display_width(text))


def _cells(row: Row) -> tuple[str, ...]:
    f = row_fields(row)
    name = printable(Path(row.socket).name)
    if row.status is None:
        return (name, "-", "down", "-", "-", "-", "-", "-", printable(row.error))  # why, in the wide last column
    if "rank" not in f:
        return (name, "-", printable(f["state"]), "-", "-", _secs(f["step_median_s"], 3), "-", str(f["hangs"]),
                _timeouts(f["timeouts"]))
    section = "-" if f["section"] is None else (
        f"{printable(f['section'])} ({_secs(f['section_age_s'])}/{_secs(f['section_timeout_s'])})")
    return (str(f["rank"]), str(f["pid"]), printable(f["state"]), section, _secs(f["since_last_heartbeat_s"]),
            _secs(f["step_median_s"], 3), "-" if f["iteration"] is None else str(f["iteration"]), str(f["hangs"]),
            _timeouts(f["timeouts"]))


def format_table(rows: Sequence[Row], width: int | None = None, mark: str = ELLIPSIS) -> str:
    """The table (pure): one line per monitor under a header, columns aligned by display
    width. With ``width`` (the terminal's columns) no line is wider: the columns in `SHRINK`
    give way first (their cells cut with ``mark``), then every line is cut at ``width``, so
    a line never wraps and the columns stay aligned."""
    lines = [HEADER, *(_cells(r) for r in rows)]
    widths = [max(display_width(line[i]) for line in lines) for i in range(len(HEADER))]
    if width is not None:
        for col, least in SHRINK.items():
            excess = sum(widths) + len(SEPARATOR) * (len(widths) - 1) - width
            if excess <= 0:
                break
            widths[col] = max(min(least, widths[col]), widths[col] - excess)
    out = []
    for line in lines:
        text = SEPARATOR.join(_pad(clip(cell, w, mark), w) for cell, w in zip(line, widths)).rstrip()
        out.append(text if width is None else clip(text, width, mark))
    return "\n".join(out)


def view_lines(views: Sequence[tuple[str, Sequence[Row]]], width: int | None = None, height: int | None = None,
               heading: str | None = None, mark: str = ELLIPSIS) -> list[str]:
    """One view of one or more run directories (pure): ``heading`` (--watch's first line),
    then per directory its name and its table. With ``height`` (the terminal's rows) at most
    that many lines, the last saying how many were left out, so a redraw never scrolls."""
    lines = [] if heading is None else [heading if width is None else clip(heading, width, mark)]
    for i, (directory, rows) in enumerate(views):
        if i:
            lines.append("")
        title = f"{printable(directory)}:"
        lines.append(title if width is None else clip(title, width, mark))
        lines.extend(format_table(rows, width, mark).splitlines() if rows else ["(no monitor sockets)"])
    if height is not None and len(lines) > max(1, height):
        height = max(1, height)
        left = len(lines) - (height - 1)
        more = f"{mark} {left} more line(s): a taller window shows them, --json gives all"
        lines = [*lines[:max(0, height - 1)], more if width is None else clip(more, width, mark)]
    return lines


def to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [row_fields(r) for r in rows]
