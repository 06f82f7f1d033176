"""The report's content, from the events and the evidence read (pure: no file, no clock).

`build` turns what report_input.py read into a `Model`: the attempts, one `Lane` per
rank (its progress samples, its hang or its wait, the group stop, its exit), the
restarts of both kinds with their phases, the incidents across every attempt and every
launcher, and each launcher's outcome and goodput.

The culprit of an incident is the rank the launcher's ``hang`` event names (the one
decision of decide.py: the roll call's evidence first, see docs/hang-handling.md); a
``hang`` event with ``victim_of`` (another node's rank that waited for it) is folded
into the culprit's incident. The waiting ranks are the diagnosis' ``verdict.waiting``,
the verdict line its ``verdict.line``; hang and restart counts are the launchers'
``job_end``. Nothing here judges a rank again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ft_monitor.launcher.exit_codes import how
from ft_monitor.launcher.telemetry.events import RESTART_PHASES
from ft_monitor.views.report_input import DiagnosisDoc, StackTop, reporter_of

Event = Mapping[str, Any]
MAX_LANES = 128
"""Rank lanes drawn; beyond it, the ranks of an incident and the first others up to it."""


@dataclass(frozen=True)
class Restart:
    mode: str
    """process or inprocess."""
    cause: str
    attempt: int
    """The attempt the ranks run in afterwards (a process restart starts a new one)."""
    rank: int | None
    host: str
    start: float
    """Wall clock the first phase starts (the detection, or the failure)."""
    phases: tuple[tuple[str, float], ...]
    """In the order of events.RESTART_PHASES[mode]; phases not measured are left out."""
    total: float | None
    lost_s: float | None
    redone: int | None


@dataclass(frozen=True)
class Incident:
    kind: str
    """hang or failure."""
    attempt: int
    rank: int | None
    host: str | None
    pid: int | None
    what: str
    node: int | None = None
    """The node rank of the launcher that recorded it."""
    section: str | None = None
    iteration: int | None = None
    onset: float | None = None
    detected: float | None = None
    action: str = ""
    """kill (the processes are restarted), inprocess, dump (the job runs on), or "" (a failure)."""
    verdict: str | None = None
    diagnosis: DiagnosisDoc | None = None
    diagnosis_path: str | None = None
    restart: Restart | None = None
    waited_on_other_nodes: tuple[int, ...] = ()
    """Ranks of other nodes whose monitors fired too, waiting for this one (their hang events)."""
    files: tuple[tuple[str, str], ...] = ()
    """(what, path as the events name it): stack dump, hang report, error file, diagnosis."""
    culprit_stack: StackTop | None = None
    waiting: tuple[int, ...] = ()
    waiting_stacks: tuple[StackTop, ...] = ()
    restarted_into: int | None = None
    """The attempt the processes were restarted into (a process restart, measured or not)."""

    @property
    def lost_s(self) -> float | None:
        """The time lost as the launcher counted it (its restart event); None where it did not."""
        return self.restart.lost_s if self.restart is not None else None


@dataclass
class Lane:
    rank: int
    host: str
    node: int | None = None
    ticks: list[tuple[float, int | None]] = field(default_factory=list)
    """(when the rank last made progress, its iteration then), one per progress sample."""
    hangs: list[tuple[float, float, str]] = field(default_factory=list)
    waits: list[tuple[float, float, str]] = field(default_factory=list)
    stops: list[tuple[float, float, str]] = field(default_factory=list)
    exits: list[tuple[float, str]] = field(default_factory=list)
    runs: list[tuple[float, float | None, str]] = field(default_factory=list)
    """Its process of each attempt: from the attempt's start to its end (None: still running)."""


@dataclass(frozen=True)
class Attempt:
    attempt: int
    start: float
    end: float | None
    state: str


@dataclass(frozen=True)
class LauncherView:
    host: str
    pid: int
    node_rank: int | None
    ranks: tuple[int, ...]
    end: Event | None
    """Its job_end event (None: it had not ended)."""
    goodput: Event | None
    """job_end, else its last stats event."""


@dataclass
class Model:
    t0: float
    t1: float
    run_ids: list[str]
    attempts: list[Attempt]
    lanes: list[Lane]
    lanes_left_out: int
    restarts: list[Restart]
    incidents: list[Incident]
    launchers: list[LauncherView]
    step_stats: dict[str, Any]
    """rank -> its last stats entry (sections), over every launcher."""
    slow_ranks: list[int]

    @property
    def ended(self) -> bool:
        return bool(self.launchers) and all(la.end is not None for la in self.launchers)


def _key(e: Event) -> tuple[str, int]:
    return (str(e["host"]), int(e["launcher_pid"]))


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _restart(e: Event, start: float | None) -> Restart:
    mode = str(e["mode"])
    phases_in = e["phases"]
    order = RESTART_PHASES.get(mode, ())
    names = [*order, *sorted(k for k in phases_in if k not in order and k != "total")]
    phases = tuple((n, float(v)) for n in names for v in [_num(phases_in.get(n))] if v is not None and v >= 0)
    total = _num(phases_in.get("total"))
    if start is None:
        start = float(e["time"]) - (total if total is not None and total >= 0 else sum(d for _, d in phases))
    return Restart(mode, str(e["cause"]), int(e["attempt"]), _int(e.get("rank")), str(e["host"]), start, phases,
                   total, _num(e.get("lost_s")), _int(e.get("redone_iterations")))


def _restart_groups(events: Sequence[Event]) -> list[list[Event]]:
    """The restart events of one restart of the job: every launcher records its own (each
    node times its own); the k-th of (mode, attempt) of each launcher is one restart."""
    seen: dict[tuple[str, int, tuple[str, int]], int] = {}
    groups: dict[tuple[str, int, int], list[Event]] = {}
    for e in events:
        if e["kind"] != "restart":
            continue
        k = (str(e["mode"]), int(e["attempt"]), _key(e))
        n = seen[k] = seen.get(k, -1) + 1
        groups.setdefault((str(e["mode"]), int(e["attempt"]), n), []).append(e)
    return list(groups.values())


def build(events: Sequence[Event], diagnoses: Mapping[str, DiagnosisDoc] | None = None,
          stacks: Mapping[str, StackTop] | None = None) -> Model:
    diagnoses = diagnoses or {}
    stacks = stacks or {}
    times = [float(e["time"]) for e in events]
    for e in events:
        for k in ("onset_time", "began"):
            v = _num(e.get(k))
            if v is not None and v > 0:
                times.append(v)
    t0, t1 = min(times), max(times)

    launchers: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        la = launchers.setdefault(_key(e), {"node_rank": None, "ranks": set(), "end": None, "goodput": None})
        if e["kind"] == "attempt_start":
            la["node_rank"] = e.get("node_rank")
            la["ranks"].update(int(r) for r in e["ranks"])
        elif e["kind"] == "job_end":
            la["end"] = la["goodput"] = e
        elif e["kind"] == "stats" and la["end"] is None:
            la["goodput"] = e
    views = [LauncherView(h, p, _int(v["node_rank"]), tuple(sorted(v["ranks"])), v["end"], v["goodput"])
             for (h, p), v in sorted(launchers.items(), key=lambda kv: (kv[1]["node_rank"] is None,
                                                                        kv[1]["node_rank"] or 0, kv[0]))]

    attempts: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "attempt_start":
            a = attempts.setdefault(int(e["attempt"]), {"start": float(e["time"]), "end": None, "states": []})
            a["start"] = min(a["start"], float(e["time"]))
        elif e["kind"] == "attempt_end":
            a = attempts.setdefault(int(e["attempt"]), {"start": float(e["time"]), "end": None, "states": []})
            a["end"] = max(a["end"] or 0.0, float(e["time"]))
            a["states"].append(str(e["state"]))
    attempt_list = [Attempt(n, v["start"], v["end"],
                            ("SUCCEEDED" if v["states"] and all(s == "SUCCEEDED" for s in v["states"])
                             else next((s for s in v["states"] if s != "SUCCEEDED"), "RUNNING")))
                    for n, v in sorted(attempts.items())]

    nodes = {k: _int(v["node_rank"]) for k, v in launchers.items()}
    incidents, restarts = _incidents(events, diagnoses, stacks, nodes)
    lanes, left_out = _lanes(events, incidents, nodes)
    step_stats: dict[str, Any] = {}
    for e in events:
        if e["kind"] == "stats":
            step_stats.update(e["ranks"])
    slow = sorted({int(e["rank"]) for e in events if e["kind"] == "slow_rank"})
    run_ids = sorted({str(e["run_id"]) for e in events if e["kind"] == "attempt_start"})
    return Model(t0, t1, run_ids, attempt_list, lanes, left_out, restarts, incidents, views, step_stats, slow)


def _incidents(events: Sequence[Event], diagnoses: Mapping[str, DiagnosisDoc], stacks: Mapping[str, StackTop],
               nodes: Mapping[tuple[str, int], int | None]) -> tuple[list[Incident], list[Restart]]:
    hangs = [e for e in events if e["kind"] == "hang"]
    diag_events = [e for e in events if e["kind"] == "diagnosis"]
    groups = _restart_groups(events)
    claimed: dict[int, Restart] = {}

    def restart_for(h: Event | None, mode: str, attempt: int, cause: str | None = "hang") -> Restart | None:
        """The restart that followed: of the hang ``h`` (its node's record of it), or of a failure."""
        for i, g in enumerate(groups):
            if i in claimed or str(g[0]["mode"]) != mode or int(g[0]["attempt"]) != attempt:
                continue
            if h is not None and cause is not None and str(g[0]["cause"]) != cause:
                continue
            if h is not None and any(float(e["time"]) < float(h["time"]) - 1e-6 for e in g) and mode == "inprocess":
                continue
            own = next((e for e in g if h is not None and _key(e) == _key(h)), g[0])
            start = _num(h.get("detected_time")) if h is not None else None
            claimed[i] = _restart(own, start if start else None)
            return claimed[i]
        return None

    out: list[Incident] = []
    primary: dict[tuple[int, int], Event] = {}
    victims: dict[tuple[int, int], list[Event]] = {}
    order: list[tuple[int, int]] = []
    for h in hangs:
        culprit = h["victim_of"] if _int(h.get("victim_of")) is not None else h["rank"]
        key = (int(h["attempt"]), int(culprit))
        if key not in primary and key not in victims:
            order.append(key)
        if _int(h.get("victim_of")) is None and key not in primary:
            primary[key] = h
        else:
            victims.setdefault(key, []).append(h)
    for key in order:
        attempt, rank = key
        hang_ev = primary.get(key)
        others = victims.get(key, [])
        d_event = next((d for d in diag_events if int(d["attempt"]) == attempt and int(d["rank"]) == rank), None) \
            or next((d for d in diag_events if int(d["attempt"]) == attempt and rank in d["behind"]), None)
        doc = diagnoses.get(d_event["path"]) if d_event is not None else None
        base = hang_ev if hang_ev is not None else others[0]
        action = str(base["action"])
        mode = "inprocess" if action == "inprocess" else "process"
        restart = None
        if action != "dump":
            restart = restart_for(base, mode, attempt if mode == "inprocess" else attempt + 1)
        if restart is None and action == "inprocess":  # never back in place: the fallback, a process restart
            restart = restart_for(base, "process", attempt + 1, cause=None)
        node = None
        if hang_ev is None:  # only other nodes' ranks that waited for it reported: the culprit is theirs
            what = f"hung (decided from the roll call; rank {_waiting_rank(base)} on {base['host']} waited for it)"
            host = pid = None
        else:
            what, host, pid = str(hang_ev["message"]), str(hang_ev["host"]), int(hang_ev["pid"])
            node = nodes.get(_key(hang_ev))
        files = tuple((label, str(base[k])) for label, k in (("stack dump", "stack_dump"), ("hang report", "report"),
                                                             ("error file", "error_file"))
                      if hang_ev is not None and base.get(k))
        if d_event is not None:
            files = (("diagnosis", str(d_event["path"])), *files)
        culprit_stack = doc.stacks.get(rank) if doc is not None else None
        if culprit_stack is None and hang_ev is not None and hang_ev.get("stack_dump"):
            culprit_stack = stacks.get(str(hang_ev["stack_dump"]))
        waiting = doc.waiting if doc is not None else ()
        waiting_stacks = tuple(doc.stacks[r] for r in waiting if r in doc.stacks) if doc is not None else ()
        reporter = reporter_of(hang_ev) if hang_ev is not None else {}
        reporter_rank = _int(reporter.get("rank"))
        if reporter_rank is not None:  # a waiting rank's monitor fired first: its evidence is this incident's
            who = f"rank {reporter_rank}, which waited for it and reported first"
            files += tuple((f"{label} ({who})", str(reporter[k])) for label, k in
                           (("stack dump", "stack_dump"), ("hang report", "report")) if reporter.get(k))
            top = stacks.get(str(reporter.get("stack_dump")))
            if doc is None:
                waiting = (reporter_rank,)
                waiting_stacks = (top,) if top is not None else ()
        out.append(Incident(
            kind="hang", attempt=attempt, rank=rank, host=host, pid=pid, what=what, node=node,
            section=base.get("section") if hang_ev is not None else None,
            iteration=_int(base.get("iteration")) if hang_ev is not None else None,
            onset=_num(base.get("onset_time")) or None, detected=_num(base.get("detected_time")) or None,
            action=action, verdict=doc.verdict if doc is not None else (
                str(d_event["verdict"]) if d_event is not None else None),
            diagnosis=doc, diagnosis_path=str(d_event["path"]) if d_event is not None else None,
            restart=restart, waited_on_other_nodes=tuple(sorted({_waiting_rank(v) for v in others})), files=files,
            culprit_stack=culprit_stack, waiting=waiting, waiting_stacks=waiting_stacks))
    hung = {(i.attempt, i.rank) for i in out}
    for d in diag_events:  # a roll call with no hang event: on_hang dump, the job ran on
        if (int(d["attempt"]), int(d["rank"])) in hung:
            continue
        hung.add((int(d["attempt"]), int(d["rank"])))
        doc = diagnoses.get(d["path"])
        out.append(Incident(
            kind="hang", attempt=int(d["attempt"]), rank=int(d["rank"]), host=str(d["host"]), pid=None,
            what="hung", action=str(d["action"]), verdict=doc.verdict if doc else str(d["verdict"]), diagnosis=doc,
            diagnosis_path=str(d["path"]), files=(("diagnosis", str(d["path"])),),
            culprit_stack=doc.stacks.get(int(d["rank"])) if doc else None, waiting=doc.waiting if doc else (),
            detected=float(d["time"]),
            waiting_stacks=tuple(doc.stacks[r] for r in doc.waiting if r in doc.stacks) if doc else ()))
    failed_attempts = {i.attempt for i in out if i.action in ("kill", "inprocess")}
    ends = [e for e in events if e["kind"] == "attempt_end" and e["state"] != "SUCCEEDED"]
    for e in ends:
        attempt = int(e["attempt"])
        if attempt in failed_attempts:
            continue
        failed_attempts.add(attempt)
        restart = restart_for(None, "process", attempt + 1, cause=None)
        verdict = _crash_verdict(e)
        if verdict is not None:  # the launcher's decision (crash.py): the root, and who failed because of it
            root, root_pid, root_what = verdict
            out.append(Incident(kind="failure", attempt=attempt, rank=root, host=str(e["host"]), pid=root_pid,
                                what=root_what, detected=float(e["time"]), restart=restart))
            continue
        f_rank = restart.rank if restart is not None else None
        failures = [f for x in ends if int(x["attempt"]) == attempt for f in x["failures"] if isinstance(f, dict)]
        first = next((f for f in failures if f.get("rank") == f_rank), failures[0] if failures else None)
        if first is not None and f_rank is None:
            f_rank = _int(first.get("rank"))
        code = _int(first.get("exitcode")) if first is not None else None
        what = (how(code) if code is not None else f"the attempt ended {e['state']}")
        message = str(first.get("message") or "").strip().splitlines()[0][:300] if first and first.get("message") \
            else ""
        out.append(Incident(kind="failure", attempt=attempt, rank=f_rank, host=str(e["host"]), pid=None,
                            what=what + (f": {message}" if message else ""), detected=float(e["time"]),
                            restart=restart))
    restarts = [claimed.get(i) or _restart(g[0], None) for i, g in enumerate(groups)]
    started = {int(e["attempt"]) for e in events if e["kind"] == "attempt_start"}
    out = [replace(i, restarted_into=i.attempt + 1) if i.attempt + 1 in started and i.action != "dump"
           and not (i.restart is not None and i.restart.mode == "inprocess") else i for i in out]
    out.sort(key=lambda i: (i.attempt, i.onset or i.detected or 0.0))
    restarts.sort(key=lambda r: r.start)
    return out, restarts


_ROOT_PREFIX = re.compile(r"rank (\d+) \(pid (\d+)\) ")


def _crash_verdict(e: Event) -> tuple[int | None, int | None, str] | None:
    """An attempt_end's crash verdict (its root, and how it and the ranks that failed because of
    it ended): rank, pid and the words after "Rank N"; None for an event without one."""
    root, how_ = _int(e.get("root")), e.get("how")
    if e.get("root_seen") is False and isinstance(how_, str) and how_:  # the root was not on this node
        return None, None, f"the root is on another node or unknown; every rank that failed here lost a peer: {how_}"
    if root is None or not isinstance(how_, str) or not how_:
        return None
    m = _ROOT_PREFIX.match(how_)
    what = how_[m.end():] if m else how_
    pid = int(m.group(2)) if m else None
    victims = e.get("victims_how")
    if isinstance(victims, str) and victims:
        what += f"; failed because of it: {victims[:300]}"
    return root, pid, what


def _lanes(events: Sequence[Event], incidents: Sequence[Incident],
           nodes: Mapping[tuple[str, int], int | None]) -> tuple[list[Lane], int]:
    lanes: dict[int, Lane] = {}
    members: dict[tuple[str, int, int], list[int]] = {}
    for e in events:
        if e["kind"] == "attempt_start":
            rs = sorted(int(r) for r in e["ranks"])
            members[(*_key(e), int(e["attempt"]))] = rs
            for r in rs:
                lanes.setdefault(r, Lane(r, str(e["host"]), nodes.get(_key(e))))
                lanes[r].runs.append((float(e["time"]), None, f"rank {r}, pid {e['ranks'][str(r)].get('pid')}, "
                                                              f"attempt {e['attempt']}"))
        elif e["kind"] == "progress":
            for r, entry in e["ranks"].items():
                lane = lanes.setdefault(int(r), Lane(int(r), str(e["host"])))
                t, it = _num(entry.get("last_progress")), _int(entry.get("iteration"))
                if t is None:
                    continue
                if lane.ticks and lane.ticks[-1][1] == it and (it is not None or abs(lane.ticks[-1][0] - t) < 1e-3):
                    continue  # no progress since the last sample (its time differs only by the polls' clocks)
                lane.ticks.append((t, it))
        elif e["kind"] == "kill":
            for r in members.get((*_key(e), int(e["attempt"])), []):
                lanes[r].stops.append((float(e["began"]), float(e["ended"]),
                                       f"rank {r}: workers stopped ({e['cause']}, {e['signal']}) in "
                                       f"{float(e['duration_s']):.2f} s"))
        elif e["kind"] == "attempt_end":
            for r in members.get((*_key(e), int(e["attempt"])), []):
                if lanes[r].runs and lanes[r].runs[-1][1] is None:
                    lanes[r].runs[-1] = (lanes[r].runs[-1][0], float(e["time"]), lanes[r].runs[-1][2])
            for f in e["failures"]:
                fr = _int(f.get("rank")) if isinstance(f, dict) else None
                code = _int(f.get("exitcode")) if isinstance(f, dict) else None
                if fr is not None and fr in lanes:
                    lanes[fr].exits.append((float(e["time"]), f"rank {fr} "
                                            f"{how(code) if code is not None else 'failed'} (attempt {e['attempt']})"))
    for inc in incidents:
        if inc.rank is None or inc.kind != "hang":
            continue
        lane = lanes.setdefault(inc.rank, Lane(inc.rank, inc.host or "?"))
        end = inc.detected or inc.onset
        if inc.onset is not None and end is not None:
            lane.hangs.append((inc.onset, end, f"rank {inc.rank} hung: {inc.what}"))
        for r in inc.waiting:
            w = lanes.get(r)
            if w is None or end is None:
                continue
            before = [t for t, _ in w.ticks if t <= end]
            if before:
                w.waits.append((before[-1], end, f"rank {r} waits for rank {inc.rank} (last progress, detection)"))
    ordered = [lanes[r] for r in sorted(lanes)]
    if len(ordered) <= MAX_LANES:
        return ordered, 0
    keep = {r for i in incidents for r in (i.rank, *i.waiting[:8]) if r is not None}
    chosen = [ln for ln in ordered if ln.rank in keep]
    for ln in ordered:
        if len(chosen) >= MAX_LANES:
            break
        if ln.rank not in keep:
            chosen.append(ln)
    chosen.sort(key=lambda ln: ln.rank)
    return chosen, len(ordered) - len(chosen)


def _waiting_rank(e: Event) -> int:
    """The rank that waited, of a hang event whose culprit is on another node: its ``waiting``
    (the event names the culprit as ``rank``), or, in an older event, its ``rank``."""
    w = e.get("waiting")
    if isinstance(w, dict) and isinstance(w.get("rank"), int):
        return int(w["rank"])
    return int(e["rank"])
