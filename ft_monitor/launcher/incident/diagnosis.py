"""The diagnosis of a hang (pure): every rank's evidence in, a verdict naming who is behind out.

The roll call (rollcall.py) gathers one `RankEvidence` per rank of the job: its stack
(faulthandler), maybe its native stack (py-spy), a digest of its Flight Recorder trace
(fr_digest.py), or why any of these is missing. `diagnose()` compares them and returns a
`Diagnosis`: the verdict line for the launcher's log and summary, and the
``diagnosis.json`` document (schema `SCHEMA`, version `VERSION`, in docs/hang-handling.md).

How the verdict is reached, strongest evidence first:

1. **Flight Recorder, a mismatch**: in some process group, some ranks enqueued collective
   #N and wait for it to complete while others never enqueued it: "rank 1 never entered
   all_reduce #5 on the default group (train.py:43 in write_metrics); ranks 0,2,3 wait in
   all_reduce #5". The default group is preferred, else the group whose collective has
   waited longest.
2. **Flight Recorder, all traced ranks waiting**: every rank with a trace waits in #N; the
   ranks without a trace (the hung one first: one that holds the GIL cannot write it) are
   the suspects: "rank 1 did not reach all_reduce #5 ... (no Flight Recorder trace: ...)".
3. **Stacks**: ranks whose main thread is inside torch.distributed (or autograd's
   backward) wait; a rank outside is behind.
4. Otherwise the monitor's own verdict on the hung rank.

Nothing here reads a file, a clock or the store; the agent hands everything in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ft_client.errors import FtError
from ft_monitor.forensics import stacks
from ft_monitor.forensics.fr_digest import FrDigest

SCHEMA = "ft-monitor/diagnosis"
VERSION = 1
MAX_STACK_CHARS = 32 * 1024
"""Per rank, of its stack dump (the end is kept: the dump's last thread is the main one)."""
MAX_NATIVE_CHARS = 32 * 1024
MAX_NOTES = 16
MAX_TEXT = 4096

ANSWERED = "answered"
NO_ANSWER = "no answer"
NOT_RUNNING = "not running"
NOT_CONNECTED = "not connected"
STATUSES = (ANSWERED, NO_ANSWER, NOT_RUNNING, NOT_CONNECTED)


class EvidenceError(FtError, ValueError):
    """Another node's evidence for a rank that does not follow the rules (it is ignored)."""


def _opt_int(d: Mapping[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**62:
        raise EvidenceError(f"field {key} must be a whole number >= 0")
    return v


def _opt_text(d: Mapping[str, Any], key: str, limit: int = MAX_TEXT) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise EvidenceError(f"field {key} must be text")
    return v[-limit:]


@dataclass(frozen=True)
class RankEvidence:
    """What the roll call learned of one rank (sent between nodes through the store)."""

    rank: int
    host: str
    status: str
    """answered, no answer (its monitor did not reply in time), not running (its process had
    exited), not connected (its monitor had no rank)."""
    local_rank: int | None = None
    pid: int | None = None
    phase: str | None = None
    iteration: int | None = None
    stack: str | None = None
    """faulthandler's dump text (the end, at most MAX_STACK_CHARS)."""
    native: str | None = None
    fr: FrDigest | None = None
    fr_note: str | None = None
    """Why there is no Flight Recorder digest (off, no answer, unreadable)."""
    files: dict[str, str] = field(default_factory=dict)
    """stack_dump, flight_recorder, native_stack: the files on the rank's node."""
    took_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def main_thread(self) -> stacks.Thread | None:
        return stacks.main_thread(stacks.parse(self.stack)) if self.stack else None

    def working_thread(self) -> stacks.Thread | None:
        """The main thread, or the async checkpoint save it waits for (`stacks.working_thread`)."""
        return stacks.working_thread(stacks.parse(self.stack)) if self.stack else None

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "status": self.status, "local_rank": self.local_rank,
                "pid": self.pid, "phase": self.phase, "iteration": self.iteration, "stack": self.stack,
                "native": self.native, "fr": None if self.fr is None else self.fr.to_wire(), "fr_note": self.fr_note,
                "files": dict(self.files), "took_s": self.took_s, "notes": list(self.notes)}

    @classmethod
    def from_wire(cls, d: Any) -> RankEvidence:
        if not isinstance(d, Mapping):
            raise EvidenceError("rank evidence must be a map")
        rank = _opt_int(d, "rank")
        status = d.get("status")
        if rank is None or status not in STATUSES:
            raise EvidenceError("rank evidence needs a rank and a known status")
        fr = d.get("fr")
        files = d.get("files")
        notes = d.get("notes")
        took = d.get("took_s")
        return cls(
            rank=rank, host=_opt_text(d, "host", 255) or "?", status=status, local_rank=_opt_int(d, "local_rank"),
            pid=_opt_int(d, "pid"), phase=_opt_text(d, "phase", 32), iteration=_opt_int(d, "iteration"),
            stack=_opt_text(d, "stack", MAX_STACK_CHARS), native=_opt_text(d, "native", MAX_NATIVE_CHARS),
            fr=FrDigest.from_wire(fr) if isinstance(fr, Mapping) else None, fr_note=_opt_text(d, "fr_note"),
            files={str(k)[:64]: str(v)[:MAX_TEXT] for k, v in list(files.items())[:8]}
            if isinstance(files, Mapping) else {},
            took_s=float(took) if isinstance(took, (int, float)) and not isinstance(took, bool)
            and 0 <= took < 1e9 else None,
            notes=[str(n)[:MAX_TEXT] for n in notes[:MAX_NOTES]] if isinstance(notes, list) else [],
        )


@dataclass(frozen=True)
class HungRank:
    """The monitor's verdict that started the incident (from its hang notice)."""

    rank: int
    host: str
    pid: int
    message: str
    reason: str
    section: str | None = None
    iteration: int | None = None
    detected_time: float | None = None
    report: str | None = None


@dataclass(frozen=True)
class GroupView:
    """One process group across the ranks that have a trace of it."""

    pg: str
    desc: str
    seq: int
    """The collective in question: the first that some rank never enqueued (else the last enqueued)."""
    op: str | None
    waiting: list[int]
    """Enqueued ``seq`` and not completed it."""
    behind: list[int]
    """Never enqueued ``seq``."""
    ranks: dict[int, tuple[int, int]]
    """rank -> (last enqueued, last completed)."""
    waited_since_ns: int | None

    @property
    def mismatch(self) -> bool:
        return bool(self.waiting and self.behind)

    def name(self) -> str:
        if self.pg == "0":
            return "the default group"
        extra = f" ({self.desc})" if self.desc and self.desc not in ("undefined", "default_pg") else ""
        return f"group {self.pg}{extra}"

    def to_json(self) -> dict[str, Any]:
        return {"pg": self.pg, "desc": self.desc, "name": self.name(), "seq": self.seq, "op": self.op,
                "waiting": self.waiting, "behind": self.behind, "waited_since_ns": self.waited_since_ns,
                "ranks": {str(r): {"last_enqueued": e, "last_completed": c}
                          for r, (e, c) in sorted(self.ranks.items())}}


@dataclass(frozen=True)
class Verdict:
    line: str
    basis: str
    """flight_recorder, flight_recorder+stacks, stacks, or monitor."""
    behind: list[int]
    waiting: list[int]
    group: str | None = None
    op: str | None = None
    seq: int | None = None
    where: str | None = None
    """The first rank behind: its innermost frame of user code."""

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "basis": self.basis, "behind": self.behind, "waiting": self.waiting,
                "process_group": self.group, "op": self.op, "seq": self.seq, "where": self.where}


@dataclass(frozen=True)
class RollCallFacts:
    """How the roll call went (timing and coverage), for the document."""

    incident: int
    timeout_s: float
    started_time: float
    duration_s: float
    flight_recorder: bool
    nodes_asked: list[str] = field(default_factory=list)
    nodes_answered: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"incident": self.incident, "timeout_s": self.timeout_s, "started_time": self.started_time,
                "duration_s": round(self.duration_s, 6), "flight_recorder": self.flight_recorder,
                "nodes_asked": self.nodes_asked, "nodes_answered": self.nodes_answered}


@dataclass(frozen=True)
class Diagnosis:
    verdict: Verdict
    groups: list[GroupView]
    evidence: list[RankEvidence]
    missing_ranks: list[int]
    hung: HungRank
    roll_call: RollCallFacts
    attempt: int | None = None

    def document(self, written_time: float) -> dict[str, Any]:
        """diagnosis.json (schema in docs/hang-handling.md)."""
        ranks = []
        for ev in sorted(self.evidence, key=lambda e: e.rank):
            main = ev.main_thread()
            ranks.append({
                "rank": ev.rank, "local_rank": ev.local_rank, "host": ev.host, "pid": ev.pid, "status": ev.status,
                "phase": ev.phase, "iteration": ev.iteration, "took_s": ev.took_s,
                "where": stacks.where(main), "innermost": stacks.innermost(main),
                "in_collective": stacks.in_collective(main) if main is not None else None,
                "stack": ev.stack, "native_stack": ev.native,
                "flight_recorder": None if ev.fr is None else ev.fr.to_wire(), "flight_recorder_note": ev.fr_note,
                "files": ev.files, "notes": ev.notes,
            })
        reported = {"rank": self.hung.rank, "host": self.hung.host, "pid": self.hung.pid,
                    "reason": self.hung.reason, "section": self.hung.section, "message": self.hung.message,
                    "iteration": self.hung.iteration, "detected_time": self.hung.detected_time,
                    "report": self.hung.report}
        return {
            "schema": SCHEMA, "version": VERSION, "attempt": self.attempt, "written_time": written_time,
            **self._hung(reported),
            "verdict": self.verdict.to_json(),
            "roll_call": self.roll_call.to_json(),
            "process_groups": [g.to_json() for g in self.groups],
            "ranks": ranks,
            "missing_ranks": self.missing_ranks,
        }

    def culprit(self) -> int:
        """The rank the incident names: the first the evidence puts behind, else the one whose
        monitor fired (a verdict on the monitor's word alone)."""
        v = self.verdict
        return v.behind[0] if v.basis != "monitor" and v.behind else self.hung.rank

    def _hung(self, reported: dict[str, Any]) -> dict[str, Any]:
        """``hung``: the culprit, decided once (`culprit`); where another rank's monitor fired
        first (it waited for the culprit), what it reported is ``reported_by``."""
        rank = self.culprit()
        if rank == self.hung.rank:
            return {"hung": reported, "reported_by": None}
        ev = next((e for e in self.evidence if e.rank == rank), None)
        hung = {"rank": rank, "host": None if ev is None else ev.host, "pid": None if ev is None else ev.pid,
                "reason": "roll call", "section": None, "message": self.verdict.line,
                "iteration": None if ev is None else ev.iteration, "detected_time": self.hung.detected_time,
                "report": None}
        return {"hung": hung, "reported_by": reported}


def _ranks(rs: Iterable[int]) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ",".join(map(str, rs))


def _wait(rs: list[int]) -> str:
    return f"{_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'}"


def group_views(evidence: Iterable[RankEvidence]) -> list[GroupView]:
    """Per process group, which ranks wait in which collective and which never entered it."""
    traces: dict[int, FrDigest] = {e.rank: e.fr for e in evidence if e.fr is not None and e.fr.recording}
    keys = sorted({k for fr in traces.values() for k in fr.groups}, key=lambda k: (len(k), k))
    views = []
    for key in keys:
        members = {r: fr.groups[key] for r, fr in traces.items() if key in fr.groups}
        top = max(g.last_enqueued for g in members.values())
        short = [g.last_enqueued for g in members.values() if g.last_enqueued < top]
        seq = min(short) + 1 if short else top
        waiting = sorted(r for r, g in members.items() if g.last_enqueued >= seq and g.last_completed < seq)
        behind = sorted(r for r, g in members.items() if g.last_enqueued < seq)
        op = next((g.op_at(seq) for r, g in sorted(members.items()) if g.op_at(seq) is not None), None)
        since = [c.created_ns for g in members.values() for c in g.pending if c.seq == seq and c.created_ns]
        desc = next((g.desc for g in members.values() if g.desc), "")
        views.append(GroupView(key, desc, seq, op, waiting, behind,
                               {r: (g.last_enqueued, g.last_completed) for r, g in members.items()},
                               min(since) if since else None))
    return views


def _where(by_rank: Mapping[int, RankEvidence], rank: int) -> str | None:
    """Where the rank is: its main thread's user's innermost frame, or, where the main thread
    waits for an async checkpoint save, the save's; and where it waits for one, that it waits
    for a data-loader worker (the worker is the one that hangs)."""
    ev = by_rank.get(rank)
    if ev is None:
        return None
    threads = stacks.parse(ev.stack) if ev.stack else []
    thread = stacks.working_thread(threads)
    where, data = stacks.where(thread), stacks.waits_for_data(thread)
    if thread is not stacks.main_thread(threads):  # the async checkpoint save the main thread waits for
        return "its async checkpoint save" + (f" at {where}" if where else "")
    if data is None:
        return where
    return f"waiting for a data-loader worker at {data}" + (f", from {where}" if where else "")


def _why_no_trace(ev: RankEvidence | None) -> str:
    if ev is None:
        return "its node did not answer"
    if ev.status != ANSWERED:
        return ev.status
    return ev.fr_note or "none written"


def _group_order(g: GroupView) -> tuple[bool, int, int, str]:
    """Which group a verdict names first: the default group, then the one waited on longest,
    then by name."""
    return (g.pg != "0", g.waited_since_ns or 2**63, len(g.pg), g.pg)


def verdict(hung: HungRank, evidence: list[RankEvidence], groups: list[GroupView]) -> Verdict:
    by_rank = {e.rank: e for e in evidence}
    mismatches = [g for g in groups if g.mismatch]
    if mismatches:
        g = min(mismatches, key=_group_order)
        behind = sorted(g.behind, key=lambda r: (r != hung.rank, r))
        first = behind[0]
        where = _where(by_rank, first)
        op = g.op or "collective"
        line = (f"{_ranks(behind)} never entered {op} #{g.seq} on {g.name()}" + (f" ({where})" if where else "")
                + f"; {_wait(g.waiting)} in {op} #{g.seq}")
        untraced = sorted(r for r in by_rank if r not in g.ranks and r not in behind)
        if untraced:
            line += f"; no Flight Recorder trace from {_ranks(untraced)}"
        return Verdict(line, "flight_recorder", behind, g.waiting, g.pg, g.op, g.seq, where)
    stuck = [g for g in groups if g.waiting]
    traced = {r for g in groups for r in g.ranks}
    untraced = sorted(r for r in by_rank if r not in traced)
    if hung.rank not in by_rank and hung.rank not in traced:
        untraced = sorted({*untraced, hung.rank})
    if stuck and untraced:
        g = min(stuck, key=_group_order)
        suspects = [hung.rank] if hung.rank in untraced else untraced
        where = _where(by_rank, suspects[0])
        op = g.op or "collective"
        why = _why_no_trace(by_rank.get(suspects[0]))
        line = (f"{_ranks(suspects)} did not reach {op} #{g.seq} on {g.name()} (no Flight Recorder trace: {why}"
                + (f"; {where}" if where else "") + f"); {_wait(g.waiting)} in {op} #{g.seq}")
        return Verdict(line, "flight_recorder+stacks", suspects, g.waiting, g.pg, g.op, g.seq, where)
    with_stack = {r: e.working_thread() for r, e in by_rank.items() if e.stack}
    waiting = sorted(r for r, t in with_stack.items() if stacks.in_collective(t))
    outside = sorted((r for r, t in with_stack.items() if not stacks.in_collective(t)),
                     key=lambda r: (r != hung.rank, r))
    if waiting and outside:
        where = _where(by_rank, outside[0])
        call = stacks.collective_call(with_stack[waiting[0]]) or "torch.distributed"
        wait_where = _where(by_rank, waiting[0])
        line = (f"{_ranks(outside)} {'is' if len(outside) == 1 else 'are'} not in a collective"
                + (f" ({where})" if where else "") + f"; {_wait(waiting)} in {call}"
                + (f" ({wait_where})" if wait_where else ""))
        return Verdict(line, "stacks", outside, waiting, where=where, op=call)
    where = _where(by_rank, hung.rank)
    line = f"rank {hung.rank} hung: {hung.message}" + (f" ({where})" if where else "")
    if len(by_rank) <= 1:
        line += "; no other rank's evidence to compare"
    return Verdict(line, "monitor", [hung.rank], [], where=where)


def diagnose(hung: HungRank, evidence: list[RankEvidence], roll_call: RollCallFacts, *,
             world_size: int | None = None, attempt: int | None = None) -> Diagnosis:
    groups = group_views(evidence)
    seen = {e.rank for e in evidence}
    missing = sorted(set(range(world_size)) - seen) if world_size else []
    return Diagnosis(verdict(hung, evidence, groups), groups, sorted(evidence, key=lambda e: e.rank), missing, hung,
                     roll_call, attempt)
