"""What `STATUS` answers: the monitor's and its rank's state, built, sent and shown.

`build_status` is pure (it takes ``now``); `MonitorStatus.to_wire` is the map
sent in STATUS_REPLY (flat: the rank's fields sit beside the monitor's when a
rank is connected) and `from_wire` reads one back; `format_status` renders it
for `ft-monitor status`. The keys are spelled here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ft_client.errors import FtError
from ft_client.timeouts import Timeouts
from ft_monitor.core.policy import next_deadline
from ft_monitor.core.section_stats import RECENT, SectionStats, SectionStatsError
from ft_monitor.core.snapshot_budget import SETTING as SNAPSHOT_SETTING
from ft_monitor.core.snapshot_budget import size_text
from ft_monitor.core.state import Session

MAX_STATUS_SECTIONS = 50
"""Open sections listed in a STATUS reply (the rest are counted): the reply must fit a frame."""


class StatusError(FtError, ValueError):
    """A STATUS reply that does not have the fields this version sends."""


@dataclass(frozen=True, slots=True)
class OpenSectionStatus:
    name: str
    elapsed_s: float
    timeout_s: float | None
    warmup: bool


@dataclass(frozen=True, slots=True)
class DeadlineStatus:
    reason: str
    section: str | None
    in_s: float
    timeout_s: float


@dataclass(frozen=True, slots=True)
class HangSummary:
    rank: int
    pid: int
    message: str
    report: str


@dataclass(frozen=True, slots=True)
class ExitSummary:
    """The rank's process said it was exiting (EXITING: an uncaught exception)."""

    pid: int
    reason: str
    at: float
    """When, on the host's monotonic clock (comparable between the monitors of one node)."""

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "reason": self.reason, "at": self.at}

    @classmethod
    def from_wire(cls, d: Any) -> ExitSummary | None:
        """None for anything that is not one (an older monitor sends none)."""
        if not isinstance(d, dict):
            return None
        pid, reason, at = d.get("pid"), d.get("reason"), d.get("at")
        if isinstance(pid, bool) or not isinstance(pid, int) or not isinstance(reason, str) \
                or isinstance(at, bool) or not isinstance(at, (int, float)):
            return None
        return cls(pid, reason[:4096], float(at))


@dataclass(frozen=True, slots=True)
class InprocessRestart:
    """The rank's last in-process restart, as its REENTERED said."""

    iteration: int
    """The Wrapper iteration it re-entered."""
    reason: str
    fault_rank: int | None
    source: str
    times: dict[str, float]
    """Wall-clock end of each phase (ft_client.inprocess.timeline.PHASES) on this rank."""

    def to_wire(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "reason": self.reason, "fault_rank": self.fault_rank,
                "source": self.source, "times": dict(self.times)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> InprocessRestart:
        return cls(d["iteration"], d["reason"], d["fault_rank"], d["source"], dict(d["times"]))


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True, slots=True)
class SnapshotPair:
    """One kind's pair of snapshot buffers, as the monitor holds it."""

    capacity: int
    """Bytes per buffer."""
    buffers: int
    step: int | None = None
    """The newest complete step its buffers' headers name (None: none, or not read)."""

    def to_wire(self) -> dict[str, Any]:
        return {"bytes": self.capacity, "buffers": self.buffers, "step": self.step}

    @classmethod
    def from_wire(cls, d: Any) -> SnapshotPair | None:
        if not isinstance(d, dict) or not _whole(d.get("bytes")) or not _whole(d.get("buffers")):
            return None
        step = d.get("step")
        return cls(d["bytes"], d["buffers"], step if isinstance(step, int) and not isinstance(step, bool) else None)


def newest_complete_step(headers: Iterable[Mapping[str, Any]]) -> int | None:
    """The newest step among a pair's buffers whose header (ft_client.snapshot.format.describe's
    map) says complete; None when none does."""
    steps = [h["step"] for h in headers if isinstance(h, Mapping) and h.get("state") == "complete"
             and isinstance(h.get("step"), int) and not isinstance(h.get("step"), bool)]
    return max(steps, default=None)


@dataclass(frozen=True, slots=True)
class SnapshotsStatus:
    """The snapshot memory the monitor holds (docs/protocol.md, "Snapshots (role snapshot)")."""

    held: int
    """Bytes of every memory file held, all kinds."""
    limit: int
    """snapshot_max_bytes (0: snapshots off)."""
    own: SnapshotPair | None = None
    peer: SnapshotPair | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"held": self.held, "limit": self.limit,
                "own": None if self.own is None else self.own.to_wire(),
                "peer": None if self.peer is None else self.peer.to_wire()}

    @classmethod
    def from_wire(cls, d: Any) -> SnapshotsStatus | None:
        """None for anything that is not one (an older monitor sends none)."""
        if not isinstance(d, dict) or not _whole(d.get("held")) or not _whole(d.get("limit")):
            return None
        return cls(d["held"], d["limit"], SnapshotPair.from_wire(d.get("own")), SnapshotPair.from_wire(d.get("peer")))

    def describe(self) -> str:
        """One line for `ft-monitor status`."""
        if self.limit == 0 and not self.held:
            return f"snapshots: off ({SNAPSHOT_SETTING} is 0)"
        pairs = [f"{p.buffers} x {size_text(p.capacity)} {kind}" + (f" (step {p.step})" if p.step is not None else "")
                 for kind, p in (("own", self.own), ("peer", self.peer)) if p is not None and p.buffers]
        if not pairs:
            return "snapshots: none held"
        return f"snapshots: {', '.join(pairs)}, {size_text(self.held)} held of {size_text(self.limit)}"


@dataclass(frozen=True, slots=True)
class RankStatus:
    rank: int
    pid: int
    phase: str
    session_age_s: float
    heartbeats: int
    since_last_heartbeat_s: float | None
    open_sections: tuple[OpenSectionStatus, ...]
    open_sections_not_listed: int
    ignored_messages: int
    out_of_section_s: float | None
    steps_started: int
    iteration: int | None
    events: int
    next_deadline: DeadlineStatus | None
    since_last_progress_s: float | None = None
    """Since the last heartbeat or section open/close."""
    steps_closed: int = 0
    iteration_base: int | None = None
    progress: str | None = None
    """How the rank reports progress: "record" (shared memory) or "socket"; None from an
    older monitor."""

    @property
    def iteration_now(self) -> int | None:
        """The rank's iteration now (the session's start plus the steps it closed; as
        `policy.iteration_now`), the last report while the start is not known, None before one."""
        return self.iteration if self.iteration_base is None else self.iteration_base + self.steps_closed


@dataclass(frozen=True, slots=True)
class MonitorStatus:
    monitor_pid: int
    socket: str
    uptime_s: float
    sessions: int
    hangs_detected: int
    iteration_high: int | None
    timeouts: dict[str, Any]
    """`Timeouts.to_wire()` of the timeouts in force."""
    rank: RankStatus | None
    last_hang: HangSummary | None
    last_restart: InprocessRestart | None = None
    section_stats: SectionStats = field(default_factory=SectionStats)
    """How long the rank's sections took, over the daemon's life (section_stats.py)."""
    last_iteration: int | None = None
    """The rank's iteration when its latest session ended (None before one ended, and from
    an older monitor): a rank that is gone is reported at its real last iteration, not at
    the last one a poll saw while it was connected."""
    last_exit: ExitSummary | None = None
    """The latest session's process said it was exiting, and why (None otherwise): the launcher
    orders the workers that failed together by it (the rank that raised first)."""
    last_gone: ExitSummary | None = None
    """The latest session's process went (its connection closed) without a GOODBYE: its pid,
    how (``reason``) and when (None otherwise): the root of a crash is the rank whose process
    went first among those that never raised (ft_monitor/launcher/incident/crash.py)."""
    first_progress: ExitSummary | None = None
    """When the connected session's process (else the latest ended one's) first sent a heartbeat
    or opened a step: its pid, ``reason`` "first progress", ``at`` on the host's monotonic clock
    (None before any did). Kept after the session ends, so the launcher times a restart's first
    step from it even when its monitor loop, slowed by a slow store, looks only after the ranks
    already finished (restarts.py)."""
    snapshots: SnapshotsStatus | None = None
    """The snapshot memory the monitor holds (None from an older monitor)."""

    @property
    def connected(self) -> bool:
        return self.rank is not None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "monitor_pid": self.monitor_pid,
            "socket": self.socket,
            "uptime_s": self.uptime_s,
            "sessions": self.sessions,
            "hangs_detected": self.hangs_detected,
            "iteration_high": self.iteration_high,
            "timeouts": self.timeouts,
            "connected": self.connected,
            "section_stats": self.section_stats.to_wire(),
            "last_iteration": self.last_iteration,
            "last_exit": None if self.last_exit is None else self.last_exit.to_wire(),
            "last_gone": None if self.last_gone is None else self.last_gone.to_wire(),
            "first_progress": None if self.first_progress is None else self.first_progress.to_wire(),
            "snapshots": None if self.snapshots is None else self.snapshots.to_wire(),
        }
        r = self.rank
        if r is not None:
            out.update({
                "rank": r.rank, "pid": r.pid, "phase": r.phase, "session_age_s": r.session_age_s,
                "heartbeats": r.heartbeats, "since_last_heartbeat_s": r.since_last_heartbeat_s,
                "open_sections": [{"name": s.name, "elapsed_s": s.elapsed_s, "timeout_s": s.timeout_s,
                                   "warmup": s.warmup} for s in r.open_sections],
                "open_sections_not_listed": r.open_sections_not_listed,
                "ignored_messages": r.ignored_messages,
                "out_of_section_s": r.out_of_section_s,
                "steps_started": r.steps_started,
                "iteration": r.iteration,
                "events": r.events,
                "since_last_progress_s": r.since_last_progress_s,
                "steps_closed": r.steps_closed,
                "iteration_base": r.iteration_base,
                "progress": r.progress,
                "next_deadline": None if r.next_deadline is None else {
                    "reason": r.next_deadline.reason, "section": r.next_deadline.section,
                    "in_s": r.next_deadline.in_s, "timeout_s": r.next_deadline.timeout_s},
            })
        if self.last_hang is not None:
            h = self.last_hang
            out["last_hang"] = {"rank": h.rank, "pid": h.pid, "message": h.message, "report": h.report}
        if self.last_restart is not None:
            out["last_restart"] = self.last_restart.to_wire()
        return out

    @classmethod
    def from_wire(cls, st: Mapping[str, Any]) -> MonitorStatus:
        try:
            rank = None
            if st["connected"]:
                nd = st.get("next_deadline")
                rank = RankStatus(
                    rank=st["rank"], pid=st["pid"], phase=st["phase"], session_age_s=st["session_age_s"],
                    heartbeats=st["heartbeats"], since_last_heartbeat_s=st["since_last_heartbeat_s"],
                    open_sections=tuple(OpenSectionStatus(s["name"], s["elapsed_s"], s["timeout_s"],
                                                          bool(s.get("warmup", False)))
                                        for s in st["open_sections"]),
                    open_sections_not_listed=st.get("open_sections_not_listed", 0),
                    ignored_messages=st.get("ignored_messages", 0),
                    out_of_section_s=st.get("out_of_section_s"),
                    steps_started=st.get("steps_started", 0),
                    iteration=st.get("iteration"),
                    events=st.get("events", 0),
                    next_deadline=None if not nd else DeadlineStatus(nd["reason"], nd.get("section"), nd["in_s"],
                                                                     nd["timeout_s"]),
                    since_last_progress_s=st.get("since_last_progress_s"),
                    steps_closed=st.get("steps_closed", 0),
                    iteration_base=st.get("iteration_base"),
                    progress=st.get("progress"),
                )
            h = st.get("last_hang")
            lr = st.get("last_restart")
            return cls(
                monitor_pid=st["monitor_pid"], socket=st["socket"], uptime_s=st["uptime_s"],
                sessions=st["sessions"], hangs_detected=st["hangs_detected"],
                iteration_high=st.get("iteration_high"), timeouts=dict(st["timeouts"]), rank=rank,
                last_hang=None if h is None else HangSummary(h["rank"], h["pid"], h["message"], h["report"]),
                last_restart=None if lr is None else InprocessRestart.from_wire(lr),
                section_stats=SectionStats.from_wire(st.get("section_stats")),
                last_iteration=st.get("last_iteration"),
                last_exit=ExitSummary.from_wire(st.get("last_exit")),
                last_gone=ExitSummary.from_wire(st.get("last_gone")),
                first_progress=ExitSummary.from_wire(st.get("first_progress")),
                snapshots=SnapshotsStatus.from_wire(st.get("snapshots")),
            )
        except SectionStatsError as e:
            raise StatusError(str(e)) from e
        except (KeyError, TypeError) as e:
            raise StatusError(f"status reply without the field(s) this version sends: {e}") from e


def build_status(*, now: float, monitor_pid: int, socket: str, started_at: float, sessions: int,
                 timeouts: Timeouts, iteration_high: int | None, session: Session | None,
                 hangs: Iterable[HangSummary], last_restart: InprocessRestart | None = None,
                 section_stats: SectionStats | None = None, progress: str | None = None,
                 last_iteration: int | None = None, last_exit: ExitSummary | None = None,
                 last_gone: ExitSummary | None = None, snapshots: SnapshotsStatus | None = None,
                 first_progress: ExitSummary | None = None) -> MonitorStatus:
    """The status at ``now`` (pure); ``progress``: how the connected rank reports it."""
    hangs = list(hangs)
    rank = None
    s = session
    if s is not None:
        d = next_deadline(s)
        rank = RankStatus(
            rank=s.rank, pid=s.pid, phase=s.phase.value, session_age_s=now - s.started_at,
            heartbeats=s.heartbeats,
            since_last_heartbeat_s=None if s.last_heartbeat is None else now - s.last_heartbeat,
            open_sections=tuple(OpenSectionStatus(sec.name, now - sec.opened_at, sec.timeout, sec.warmup)
                                for sec in list(s.open_sections.values())[:MAX_STATUS_SECTIONS]),
            open_sections_not_listed=max(0, len(s.open_sections) - MAX_STATUS_SECTIONS),
            ignored_messages=s.errors,
            out_of_section_s=None if s.out_of_section_since is None else now - s.out_of_section_since,
            steps_started=s.steps_started, iteration=s.iteration, events=s.events,
            next_deadline=None if d is None else DeadlineStatus(d.reason.value, d.section, d.at - now, d.timeout),
            since_last_progress_s=None if s.last_progress is None else now - s.last_progress,
            steps_closed=s.steps_closed, iteration_base=s.iteration_base, progress=progress,
        )
    return MonitorStatus(
        monitor_pid=monitor_pid, socket=socket, uptime_s=now - started_at, sessions=sessions,
        hangs_detected=len(hangs), iteration_high=iteration_high, timeouts=timeouts.to_wire(), rank=rank,
        last_hang=hangs[-1] if hangs else None, last_restart=last_restart,
        section_stats=section_stats or SectionStats(),
        last_iteration=last_iteration, last_exit=last_exit, last_gone=last_gone, snapshots=snapshots,
        first_progress=(ExitSummary(s.pid, FIRST_PROGRESS, s.trained_at) if s is not None and s.trained_at is not None
                        else first_progress),
    )


FIRST_PROGRESS = "first progress"
"""`MonitorStatus.first_progress`'s reason."""


PROGRESS_WORDS = {"record": "shared-memory record", "socket": "socket"}


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def _secs3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def format_status(status: MonitorStatus | Mapping[str, Any]) -> str:
    """Human-readable status (pure)."""
    st = status if isinstance(status, MonitorStatus) else MonitorStatus.from_wire(status)
    t = st.timeouts
    learned = set(t.get("learned", []))

    def tv(key: str, value: float | None) -> str:
        return ("off" if value is None else f"{value:g}s") + (" (learned)" if key in learned else "")

    lines = [f"monitor pid {st.monitor_pid} on {st.socket}, up {_secs(st.uptime_s)}, "
             f"{st.sessions} session(s), {st.hangs_detected} hang(s) detected"]
    r = st.rank
    if r is None:
        lines.append("rank: not connected" + (f" (its last session ended at iteration {st.last_iteration})"
                                             if st.last_iteration is not None else ""))
    else:
        lines.append(f"rank {r.rank} pid {r.pid} ({r.phase}), connected {_secs(r.session_age_s)} ago, "
                     f"{r.heartbeats} heartbeat(s), last {_secs(r.since_last_heartbeat_s)} ago"
                     + (f", iteration {r.iteration_now}" if r.iteration_now is not None else "")
                     + (f", progress through the {PROGRESS_WORDS.get(r.progress, r.progress)}" if r.progress else ""))
        if r.open_sections:
            for sec in r.open_sections:
                lines.append(f"  section {sec.name!r} open {_secs(sec.elapsed_s)}, timeout "
                             f"{'off' if sec.timeout_s is None else _secs(sec.timeout_s)}"
                             + (" (warm-up)" if sec.warmup else ""))
        else:
            lines.append(f"  no section open (for {_secs(r.out_of_section_s)})")
        if r.open_sections_not_listed:
            lines.append(f"  ... and {r.open_sections_not_listed} more open section(s)")
        if r.ignored_messages:
            lines.append(f"  {r.ignored_messages} message(s) ignored as out of place (see the monitor log)")
        nd = r.next_deadline
        if nd:
            what = nd.reason + (f" {nd.section!r}" if nd.section else "")
            lines.append(f"  next deadline: {what} in {_secs(nd.in_s)}")
    lines.append("timeouts in force:")
    lines.append(f"  initial heartbeat {tv('initial_rank_heartbeat_timeout', t['initial_rank_heartbeat_timeout'])}, "
                 f"heartbeat {tv('rank_heartbeat_timeout', t['rank_heartbeat_timeout'])}, "
                 f"out of section {tv('rank_out_of_section_timeout', t['rank_out_of_section_timeout'])}")
    for name, value in sorted(t["rank_section_timeouts"].items()):
        lines.append(f"  section {name!r}: {tv('section:' + name, value)}")
    timed = st.section_stats.sections
    if timed:
        lines.append("section times (median of the last %d, count): " % RECENT + ", ".join(
            f"{name!r} {_secs3(h.median_recent())} x{h.count}" for name, h in sorted(timed.items())))
    if st.snapshots is not None:
        lines.append(st.snapshots.describe())
    if st.last_hang is not None:
        h = st.last_hang
        lines.append(f"last hang: rank {h.rank} pid {h.pid}: {h.message} (report {h.report})")
    if st.last_restart is not None:
        lr = st.last_restart
        lines.append(f"last in-process restart: iteration {lr.iteration}, after: {lr.reason}")
    return "\n".join(lines)
