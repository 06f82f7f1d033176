"""The roll call of a hang: every rank of the job dumped, once per incident, within a bound.

On the first hang verdict of an incident, the launcher of the node that owns it (the node
of the rank that hung first, decide.first_hang) asks:

* each of its own monitors, in parallel, for a snapshot of its rank (DUMP_REQUEST: the
  stack dump, py-spy's native stacks with ``native_stacks``, then with
  ``flight_recorder_entries`` the rank's Flight Recorder trace; rank_snapshot.py), and
  reads the files they name;
* every other node, through the rendezvous store (a signed `RollCallRequest` at its own
  key, naming the round and its incident); each other launcher does the same with its
  monitors and stores its ranks' evidence (a signed `RollCallAnswer`: stacks and Flight
  Recorder digests, not the raw traces, sealed with AES-GCM under the job's key). Keys,
  bindings and readers: rollcall_wire.py; the sealing: sealed.py.

Everything is bounded by ``roll_call_timeout``, counted from the verdict's arrival at
the launcher: a monitor or node that has not answered by then is listed as such, and
the kill goes on. `RollCaller` performs these effects; what they mean is diagnosis.py's
(pure), and the agent (agent.py) decides when to call them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_client import wire
from ft_client.client.flight_recorder import ERROR_KEY
from ft_client.safefiles import read_bounded, read_span, write_json_atomic
from ft_client.wire.transport import TransportError, connect
from ft_monitor.core.server_log import printable
from ft_monitor.core.snapshot import FR_NOTE, STARTING, MonitorSnapshot, SnapshotError
from ft_monitor.forensics.fr_digest import digest
from ft_monitor.launcher.incident.diagnosis import (
    ANSWERED,
    MAX_NATIVE_CHARS,
    MAX_STACK_CHARS,
    NO_ANSWER,
    NOT_CONNECTED,
    NOT_RUNNING,
    Diagnosis,
    HungRank,
    RankEvidence,
    RollCallFacts,
    diagnose,
)
from ft_monitor.launcher.incident.rollcall_wire import (
    SCAN_INTERVAL,
    VERDICT_KEY,
    answer_key,
    answers_board,
    encode_answer,
    read_answer,
    read_request,
    request_key,
    requests_board,
)
from ft_monitor.launcher.stop_signal import reraise_stop
from ft_monitor.launcher.store.sealed import Sealer
from ft_monitor.launcher.store.store_auth import RollCallRequest, RollCallVerdict, StoreChannel, StoreMessageError
from ft_monitor.launcher.store.store_board import Board, existing, read_all
from ft_monitor.processes import procinfo

log = logging.getLogger("ft_monitor.launcher")

POLL_INTERVAL = 0.25
"""Seconds between this node's looks for another node's roll call request (and for answers)."""
MARGIN = 0.2
"""Seconds of the bound kept for reading the monitors' files and storing the answer."""
MAX_FR_BYTES = 64 * 1024 * 1024
"""A Flight Recorder trace larger than this is not read (about 130,000 entries)."""
DIAGNOSIS_FILE = "diagnosis.json"


@dataclass(frozen=True)
class Rank:
    """One rank of this node's current attempt."""

    global_rank: int
    local_rank: int
    pid: int


def _fr_evidence(snap: MonitorSnapshot, asked: bool) -> tuple[Any, str | None]:
    """(FrDigest or None, why there is none)."""
    if snap.flight_recorder is None:
        if not asked:
            return None, "Flight Recorder off (flight_recorder_entries is 0)"
        why = next((n for n in snap.notes if n.startswith(FR_NOTE)), "no trace written")
        return None, why.removeprefix(FR_NOTE).strip()
    try:
        text = read_bounded(snap.flight_recorder, MAX_FR_BYTES + 1)
        if len(text) > MAX_FR_BYTES:
            return None, f"trace larger than {MAX_FR_BYTES} bytes: not read"
        data = json.loads(text)
    except (OSError, ValueError) as e:
        return None, f"unreadable trace {snap.flight_recorder}: {e}"
    if isinstance(data, dict) and ERROR_KEY in data:
        return None, f"the rank wrote no trace: {str(data[ERROR_KEY])[:300]}"
    fr = digest(data)
    if not fr.recording:
        return None, fr.problems[0] if fr.problems else "no entries"
    return fr, None


def evidence_from(rank: Rank, host: str, snap: MonitorSnapshot | None, why: str | None,
                  flight_recorder: bool) -> RankEvidence:
    """What one monitor's answer (or its silence) says of its rank, the files it names read."""
    if snap is None:
        status = NO_ANSWER if procinfo.running(rank.pid) else NOT_RUNNING
        return RankEvidence(rank.global_rank, host, status, rank.local_rank, rank.pid,
                            notes=[why or "no answer"] if status == NO_ANSWER else
                            ["its process had exited before the roll call"])
    if (not snap.connected and snap.phase != STARTING) or snap.pid != rank.pid:
        running = procinfo.running(rank.pid)
        return RankEvidence(rank.global_rank, host, NOT_CONNECTED if running else NOT_RUNNING, rank.local_rank,
                            rank.pid, notes=[*snap.notes, "the worker is running but not connected to its monitor"
                                             if running else "its process had exited before the roll call"])
    if not snap.alive:
        return RankEvidence(rank.global_rank, host, NOT_RUNNING, rank.local_rank, rank.pid, snap.phase,
                            snap.iteration, notes=list(snap.notes))
    files: dict[str, str] = {}
    stack = native = None
    notes = list(snap.notes)
    if snap.stack_captured and snap.stack_dump:
        files["stack_dump"] = snap.stack_dump
        try:
            stack = read_span(snap.stack_dump, snap.stack_from, snap.stack_to, MAX_STACK_CHARS)
        except OSError as e:
            notes.append(f"cannot read the stack dump {snap.stack_dump}: {e}")
    if snap.native_stack:
        files["native_stack"] = snap.native_stack
        try:
            native = read_bounded(snap.native_stack, MAX_NATIVE_CHARS)
        except OSError as e:
            notes.append(f"cannot read the native stacks {snap.native_stack}: {e}")
    fr, fr_note = _fr_evidence(snap, flight_recorder)
    if snap.flight_recorder:
        files["flight_recorder"] = snap.flight_recorder
    return RankEvidence(rank.global_rank, host, ANSWERED, rank.local_rank, rank.pid, snap.phase, snap.iteration,
                        stack, native, fr, fr_note, files, snap.took_s, notes)


def ask_monitor(path: str, rank: Rank, incident: int, budget: float,
                flight_recorder: bool) -> tuple[MonitorSnapshot | None, str | None]:
    """One monitor's snapshot of its rank (DUMP_REQUEST), or why there is none."""
    try:
        t, _ = connect(path, budget + MARGIN, wire.Role.LAUNCHER, rank.global_rank)
    except (TransportError, OSError) as e:
        return None, f"its monitor did not answer: {e}"
    try:
        reply = t.request(wire.DumpRequest(incident, max(0.0, budget), flight_recorder))
    except TransportError as e:
        return None, f"its monitor did not answer within {budget + MARGIN:.1f}s: {e}"
    finally:
        t.close()
    if not isinstance(reply, wire.DumpReply):
        return None, f"its monitor refused: {reply}"
    try:
        return MonitorSnapshot.from_wire(reply.snapshot), None
    except SnapshotError as e:
        return None, f"its monitor answered nonsense: {e}"


@dataclass
class RollCaller:
    socket_of: Callable[[int], Path]
    """local rank -> its monitor's socket."""
    host: str
    timeout: float
    """roll_call_timeout."""
    flight_recorder: bool
    clock: Callable[[], float] = time.monotonic
    sealer: Sealer | None = None
    """Seals this node's answers and opens the others' (the job secret's; None: no roll call across nodes)."""
    incidents: int = 0
    """Roll calls started here in this rendezvous round (the incident number, in this node's request)."""
    round: int = 0
    """The rendezvous round: every request and answer names it, and one of another round is refused."""
    answered: dict[int, int] = field(default_factory=dict)
    """Asking node -> the last of its incidents this node answered (this round)."""
    answered_at: float | None = None
    """When (``clock``) this node last answered another node's roll call."""
    last_started: float | None = None
    """Wall clock of the last roll call this node started or answered (on_hang: dump groups
    later notices with it, and ignores the other nodes' hang records from before it)."""
    written: list[str] = field(default_factory=list)
    """The answers and verdicts this node stored in this round (their keys: deleted when the round ends)."""
    last_answer: tuple[int, int] | None = None
    """(asking node, incident) of the roll call this node last answered (this round)."""
    last_evidence: dict[int, RankEvidence] = field(default_factory=dict)
    """Global rank -> what this node's ranks gave for the roll call it last answered."""
    _polled: float = field(default=-1e18)
    _scanned: float = field(default=-1e18)
    _requests: Board | None = None
    _seen: dict[int, bytes] = field(default_factory=dict)
    """Asking node -> the value of its request key last read (answered, or refused and said once)."""

    # -- this node's monitors ---------------------------------------------------------
    def local(self, ranks: list[Rank], incident: int, budget: float) -> list[RankEvidence]:
        """Ask every local monitor at once; whoever has not answered within ``budget`` is listed so."""
        results: dict[int, tuple[MonitorSnapshot | None, str | None]] = {}
        budget = max(0.0, budget - MARGIN)

        def ask(r: Rank) -> None:
            results[r.global_rank] = ask_monitor(str(self.socket_of(r.local_rank)), r, incident, budget,
                                                 self.flight_recorder)

        threads = [threading.Thread(target=ask, args=(r,), name=f"ft-roll-call-{r.local_rank}", daemon=True)
                   for r in ranks]
        for t in threads:
            t.start()
        end = self.clock() + budget + MARGIN
        for t in threads:
            t.join(max(0.0, end - self.clock()))
        out = []
        for r in ranks:
            snap, why = results.get(r.global_rank, (None, f"its monitor did not answer within {budget + MARGIN:.1f}s"))
            out.append(evidence_from(r, self.host, snap, why, self.flight_recorder))
        return out

    # -- the node that owns the verdict -----------------------------------------------
    def run(self, hung: HungRank, ranks: list[Rank], *, store: Any, channel: StoreChannel | None, group_rank: int,
            group_world_size: int, world_size: int | None, attempt: int | None) -> Diagnosis:
        """The whole roll call: ask the other nodes, dump this node's ranks, collect, diagnose."""
        started = time.time()
        t0 = self.clock()
        deadline = t0 + self.timeout
        others = [g for g in range(group_world_size) if g != group_rank] \
            if store is not None and channel is not None and self.sealer is not None else []
        self.incidents += 1
        incident = self.incidents
        asked: list[str] = []
        if others:
            assert channel is not None
            try:
                key = request_key(group_rank)
                requests_board(group_world_size).publish(store, group_rank, channel.encode(
                    key, RollCallRequest(incident, hung.rank, self.host, group_rank, self.timeout, self.round)))
                asked = [f"node {g}" for g in others]
            except Exception as e:  # noqa: BLE001 - the store may be gone; this node's ranks still count
                reraise_stop(e)
                log.warning("ft-launcher: could not ask the other nodes for their ranks' stacks: %s", e)
                others = []
        evidence = self.local(ranks, incident, deadline - self.clock())
        answered = [self.host]
        if others:
            board = answers_board(group_rank, incident, group_world_size)
            try:
                remote, hosts = self._collect(store, channel, board, group_rank, incident, others, deadline)
            finally:
                self._tidy(store, board, group_rank, incident, others)
            evidence += remote
            answered += hosts
        self.last_started = started
        facts = RollCallFacts(incident, self.timeout, started, self.clock() - t0, self.flight_recorder,
                              [self.host, *asked], answered)
        return diagnose(hung, evidence, facts, world_size=world_size, attempt=attempt)

    def _collect(self, store: Any, channel: StoreChannel | None, board: Board, group_rank: int, incident: int,
                 others: list[int], deadline: float) -> tuple[list[RankEvidence], list[str]]:
        """Every other node's answer until ``deadline``, read from the answers' board (one
        ``add`` per look; an answer only once it is listed); one that is refused (forged,
        replayed, altered) is said once and waited for further: the others' are collected
        all the same. At the deadline the nodes still missing are looked at once at their
        own keys (an answer whose listing failed, or a value planted there: said)."""
        assert channel is not None and self.sealer is not None
        sealer = self.sealer
        pending = set(others)
        evidence: list[RankEvidence] = []
        hosts: list[str] = []
        warned: set[tuple[int, str]] = set()  # a forged value is read again when the board moves: said once

        def refuse(g: int, why: str) -> None:
            if (g, why) not in warned:
                warned.add((g, why))
                log.warning("ft-launcher: ignored a roll call answer in the rendezvous store at %s: %s",
                            answer_key(group_rank, incident, g), printable(why))

        def take(found: dict[int, bytes]) -> None:
            for g, raw in sorted(found.items()):
                try:
                    host, ranks = read_answer(channel, sealer, raw, asker=group_rank, incident=incident,
                                              group_rank=g, round=self.round, refused=_ignored_rank)
                except StoreMessageError as e:
                    refuse(g, str(e))
                    continue
                pending.discard(g)
                hosts.append(host)
                evidence.extend(ranks)

        try:
            while pending and self.clock() < deadline:
                take(board.look(store, pending))
                if pending:
                    time.sleep(min(0.05, max(0.0, deadline - self.clock())))
            if pending:
                keys = existing(store, [answer_key(group_rank, incident, g) for g in sorted(pending)])
                by_key = {answer_key(group_rank, incident, g): g for g in pending}
                take({by_key[k]: raw for k, raw in zip(keys, read_all(store, keys), strict=True)})
        except Exception as e:  # noqa: BLE001 - the store may be gone
            reraise_stop(e)
            log.warning("ft-launcher: could not read the other nodes' roll call answers: %s", e)
        return evidence, hosts

    def _tidy(self, store: Any, board: Board, group_rank: int, incident: int, others: list[int]) -> None:
        """The roll call is over: its answers, their board and this node's request leave the store
        (an answer stored after this is its writer's to delete, when the round ends)."""
        with contextlib.suppress(Exception):  # the store may be gone
            for key in existing(store, [answer_key(group_rank, incident, g) for g in others]):
                store.delete_key(key)
            board.clear(store)
            store.delete_key(request_key(group_rank))

    # -- the other nodes ----------------------------------------------------------------
    def new_round(self, round: int) -> None:
        """A new rendezvous round (``round``: its number, the same on every node): what was
        answered and asked starts afresh, and only this round's messages are taken."""
        self.round = round
        self.answered = {}
        self.answered_at = None
        self.incidents = 0
        self.last_answer = None
        self.last_evidence = {}
        self._seen = {}
        self._requests = None
        self._scanned = -1e18
        self.written = []

    def publish_verdict(self, store: Any, channel: StoreChannel | None, group_rank: int,
                        verdict: RollCallVerdict) -> None:
        """The verdict of this node's roll call, for the nodes that answered it: every node then
        names the same culprit (hangs.py)."""
        if store is None or channel is None:
            return
        key = VERDICT_KEY.format(group_rank, verdict.incident)
        try:
            store.set(key, channel.encode(key, verdict, {"round": self.round}))
            self.written.append(key)
        except Exception as e:  # noqa: BLE001 - the other nodes then keep their own decision
            reraise_stop(e)
            log.warning("ft-launcher: could not tell the other nodes the roll call's verdict: %s", e)

    def verdict_answered(self, store: Any, channel: StoreChannel | None, wait: float) -> RollCallVerdict | None:
        """The verdict of the roll call this node last answered, waiting up to ``wait`` s for the
        asking node to publish it; None when there is none in time, or it does not check out."""
        if store is None or channel is None or self.last_answer is None:
            return None
        asker, incident = self.last_answer
        key = VERDICT_KEY.format(asker, incident)
        end = self.clock() + wait
        try:
            while not store.check([key]):
                if self.clock() >= end:
                    return None
                time.sleep(POLL_INTERVAL)
            raw = store.get(key)
        except Exception as e:  # noqa: BLE001 - the store host may be gone
            reraise_stop(e)
            return None
        try:
            verdict = channel.decode(key, raw, RollCallVerdict, {"round": self.round})
        except StoreMessageError as e:
            log.warning("ft-launcher: ignored a roll call verdict in the rendezvous store at %s: %s", key,
                        printable(str(e)))
            return None
        return verdict if verdict.incident == incident else None

    def answer_pending(self, ranks: list[Rank], *, store: Any, channel: StoreChannel | None, group_rank: int,
                       group_world_size: int, wait: float = 0.0) -> bool:
        """Answer another node's roll call if one is waiting (looking at most every POLL_INTERVAL,
        or for up to ``wait`` seconds); True when one was answered."""
        if store is None or channel is None or self.sealer is None:
            return False
        end = self.clock() + wait
        while True:
            now = self.clock()
            if now - self._polled >= POLL_INTERVAL or wait:
                self._polled = now
                request = self._pending_request(store, channel, group_rank, group_world_size, force=bool(wait))
                if request is not None:
                    self._answer(request, ranks, store, channel, group_rank, group_world_size)
                    return True
            if self.clock() >= end:
                return False
            time.sleep(min(0.05, max(0.0, end - self.clock())))

    def _pending_request(self, store: Any, channel: StoreChannel, group_rank: int, group_world_size: int,
                         force: bool) -> RollCallRequest | None:
        """The first other node's request this node has not answered yet, from the requests'
        board (rollcall_wire.requests_board): read when the bell rang, every SCAN_INTERVAL,
        or always with ``force``; one store operation per look while nobody asks."""
        if self._requests is None or self._requests.nodes != group_world_size:
            self._requests = requests_board(group_world_size)
        now = self.clock()
        scan = force or now - self._scanned >= SCAN_INTERVAL
        try:
            found = self._requests.look(store, (g for g in range(group_world_size) if g != group_rank), force=scan)
        except Exception as e:  # noqa: BLE001 - the store host may be gone
            reraise_stop(e)
            return None
        if scan:
            self._scanned = now
        for asker, raw in sorted(found.items()):
            key = request_key(asker)
            if self._seen.get(asker) == raw:
                continue  # answered, or refused and said
            self._seen[asker] = raw
            try:
                request = read_request(channel, raw, asker=asker, round=self.round)
            except StoreMessageError as e:
                log.warning("ft-launcher: ignored a roll call request in the rendezvous store at %s: %s", key,
                            printable(str(e)))
                continue
            if request.incident <= self.answered.get(asker, 0):
                log.warning("ft-launcher: ignored a roll call request in the rendezvous store at %s: incident %d of "
                            "node %d, answered already (replayed)", key, request.incident, asker)
                continue
            return request
        return None

    def answered_recently(self) -> bool:
        """This node's ranks were dumped for another node's roll call within the last bound
        (a victim's own notice that arrives after it needs no second answer)."""
        return self.answered_at is not None and self.clock() - self.answered_at < self.timeout + 2 * POLL_INTERVAL

    def _answer(self, request: RollCallRequest, ranks: list[Rank], store: Any, channel: StoreChannel,
                group_rank: int, group_world_size: int) -> None:
        assert self.sealer is not None
        self.answered[request.group_rank] = request.incident
        self.last_answer = (request.group_rank, request.incident)
        self.answered_at = self.clock()
        self.last_started = time.time()
        budget = max(0.2, request.budget_s - 2 * POLL_INTERVAL - MARGIN)
        log.warning("ft-launcher: roll call %d from %s (rank %d's monitor reported a hang): dumping this node's "
                    "%d rank(s)",
                    request.incident, printable(request.host), request.hung_rank, len(ranks))
        evidence = self.local(ranks, request.incident, budget)
        self.last_evidence = {e.rank: e for e in evidence}
        try:
            key, value = encode_answer(channel, self.sealer, request, self.host, group_rank, evidence)
            self.written.append(key)
            answers_board(request.group_rank, request.incident, group_world_size).publish(store, group_rank, value)
        except Exception as e:  # noqa: BLE001
            reraise_stop(e)
            log.warning("ft-launcher: could not store this node's roll call answer: %s", e)


def _ignored_rank(why: str) -> None:
    log.warning("ft-launcher: ignored %s", printable(why))


def diagnosis_path(attempt_dir: Path) -> Path:
    """``diagnosis.json`` in the attempt's log directory, ``diagnosis-N.json`` for later incidents."""
    path = attempt_dir / DIAGNOSIS_FILE
    n = 1
    while path.exists():
        n += 1
        path = attempt_dir / f"diagnosis-{n}.json"
    return path


def write_diagnosis(diagnosis: Diagnosis, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, diagnosis.document(time.time()))
