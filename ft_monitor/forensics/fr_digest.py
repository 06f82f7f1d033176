"""Flight Recorder traces, read (pure): torch's JSON dump -> what each process group did last.

A rank's Flight Recorder (torch.distributed, on when ``TORCH_FR_BUFFER_SIZE`` > 0 in its
environment; ft-launcher sets it from ``flight_recorder_entries``) keeps the last N
collectives it enqueued. ``torch._C._distributed_c10d._dump_fr_trace_json()`` returns
it as JSON (the rank writes it when its monitor asks: ft_client/client/flight_recorder.py).
What torch 2.13 writes on gloo, checked on the real thing:

* ``pg_status``: per process group id (``"0"`` is the default group), the sequence
  numbers of the last collective enqueued, started (-1: gloo does not record it) and
  completed, as strings;
* ``entries``: one per collective, with ``pg_id``, ``process_group`` ([id, description]),
  ``collective_seq_id``, ``profiling_name`` (``"gloo:all_reduce"``), ``retired``,
  ``time_created_ns``, sizes and dtypes; no stack traces (the JSON dump has none);
* ``pg_config`` names the groups' ranks only partly on gloo (one entry keyed ``""``),
  which is where torch's bundled analyzer fails with a KeyError: nothing here relies on it;
* with the recorder off, only the version and empty maps: no ``entries`` at all.

`digest()` turns one trace into a `FrDigest`: per group, the last enqueued and completed
sequence numbers and the collectives not completed yet (bounded), never raising on a
missing or odd field (it is noted instead). The digest, not the trace, is what travels
between nodes and what diagnosis.py compares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_PENDING = 8
"""Collectives not yet completed kept per group (the oldest ones: the first is the one waited on)."""
MAX_GROUPS = 256


def _seq(v: Any) -> int | None:
    """A sequence number as torch writes it (a string or an int); None when unusable."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.lstrip("-").isdigit() and len(v) < 20:
        return int(v)
    return None


def op_name(profiling_name: Any) -> str:
    """``"gloo:all_reduce"`` -> ``"all_reduce"`` (the backend prefix dropped)."""
    if not isinstance(profiling_name, str) or not profiling_name:
        return "collective"
    return profiling_name.split(":", 1)[-1][:64]


@dataclass(frozen=True)
class Collective:
    seq: int
    op: str
    created_ns: int | None = None
    sizes: list[Any] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "created_ns": self.created_ns, "sizes": self.sizes}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Collective:
        seq = _seq(d.get("seq"))
        created = d.get("created_ns")
        sizes = d.get("sizes")
        return cls(seq if seq is not None else -1, op_name(d.get("op")),
                   created if isinstance(created, int) and not isinstance(created, bool) else None,
                   sizes if isinstance(sizes, list) else [])


@dataclass(frozen=True)
class PgDigest:
    """One process group as one rank saw it."""

    pg: str
    """The group's id in the rank's process ("0": the default group)."""
    desc: str
    last_enqueued: int
    last_completed: int
    pending: list[Collective] = field(default_factory=list)
    """Enqueued, not completed, oldest first (at most MAX_PENDING)."""
    last_op: str | None = None
    """The op of the last collective enqueued (when still in the buffer)."""

    def op_at(self, seq: int) -> str | None:
        for c in self.pending:
            if c.seq == seq:
                return c.op
        return self.last_op if seq == self.last_enqueued else None

    def to_wire(self) -> dict[str, Any]:
        return {"pg": self.pg, "desc": self.desc, "last_enqueued": self.last_enqueued,
                "last_completed": self.last_completed, "pending": [c.to_wire() for c in self.pending],
                "last_op": self.last_op}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PgDigest:
        pending = d.get("pending")
        last_op = d.get("last_op")
        return cls(str(d.get("pg", "?"))[:64], str(d.get("desc", ""))[:128], _seq(d.get("last_enqueued")) or -1,
                   _seq(d.get("last_completed")) or -1,
                   [Collective.from_wire(c) for c in pending[:MAX_PENDING] if isinstance(c, Mapping)]
                   if isinstance(pending, list) else [],
                   op_name(last_op) if isinstance(last_op, str) else None)


@dataclass(frozen=True)
class FrDigest:
    recording: bool
    """False when the rank's recorder is off (its trace has no entries at all)."""
    version: str | None = None
    groups: dict[str, PgDigest] = field(default_factory=dict)
    entries: int = 0
    problems: list[str] = field(default_factory=list)
    """What could not be read (a field missing or odd); the rest is still used."""

    def to_wire(self) -> dict[str, Any]:
        return {"recording": self.recording, "version": self.version, "entries": self.entries,
                "groups": {k: g.to_wire() for k, g in self.groups.items()}, "problems": self.problems}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> FrDigest:
        groups = d.get("groups")
        version = d.get("version")
        problems = d.get("problems")
        entries = d.get("entries")
        return cls(
            d.get("recording") is True,
            version if isinstance(version, str) else None,
            {str(k)[:64]: PgDigest.from_wire(g) for k, g in list(groups.items())[:MAX_GROUPS] if isinstance(g, Mapping)}
            if isinstance(groups, Mapping) else {},
            entries if isinstance(entries, int) and not isinstance(entries, bool) else 0,
            [str(p)[:200] for p in problems[:16]] if isinstance(problems, list) else [],
        )


def _collective(e: Mapping[str, Any]) -> Collective:
    created = e.get("time_created_ns")
    sizes = e.get("input_sizes")
    return Collective(_seq(e.get("collective_seq_id")) or 0, op_name(e.get("profiling_name")),
                      created if isinstance(created, int) and not isinstance(created, bool) else None,
                      sizes[:8] if isinstance(sizes, list) else [])


def digest(trace: Any) -> FrDigest:
    """What one rank's Flight Recorder trace (torch's JSON dump, parsed) says, per group."""
    if not isinstance(trace, Mapping):
        return FrDigest(False, problems=["the trace is not a JSON object"])
    version = trace.get("version")
    version = version if isinstance(version, str) else None
    entries = trace.get("entries")
    if not isinstance(entries, list):
        return FrDigest(False, version, problems=["no entries: the recorder is off in this process "
                                                   "(TORCH_FR_BUFFER_SIZE unset or 0)"])
    problems: list[str] = []
    status = trace.get("pg_status")
    if not isinstance(status, Mapping):
        problems.append("no pg_status")
        status = {}
    per_pg: dict[str, list[Mapping[str, Any]]] = {}
    descs: dict[str, str] = {}
    for e in entries:
        if not isinstance(e, Mapping):
            continue
        pg = e.get("pg_id")
        key = str(pg) if isinstance(pg, (int, str)) and not isinstance(pg, bool) else None
        named = e.get("process_group")
        if key is None and isinstance(named, list) and named:
            key = str(named[0])
        if key is None:
            continue
        per_pg.setdefault(key, []).append(e)
        if isinstance(named, list) and len(named) > 1 and isinstance(named[1], str):
            descs.setdefault(key, named[1])
    groups: dict[str, PgDigest] = {}
    for key in list(dict.fromkeys([*map(str, status), *per_pg]))[:MAX_GROUPS]:
        st = status.get(key)
        ents = sorted((e for e in per_pg.get(key, []) if _seq(e.get("collective_seq_id")) is not None),
                      key=lambda e: _seq(e.get("collective_seq_id")) or 0)
        collectives = [e for e in ents if not e.get("is_p2p")]
        enq = _seq(st.get("last_enqueued_collective")) if isinstance(st, Mapping) else None
        done = _seq(st.get("last_completed_collective")) if isinstance(st, Mapping) else None
        if enq is None:
            enq = max((_seq(e.get("collective_seq_id")) or -1 for e in collectives), default=-1)
            problems.append(f"group {key}: no last_enqueued_collective; taken from the entries")
        if done is None:
            done = max((_seq(e.get("collective_seq_id")) or -1 for e in collectives if e.get("retired") is True),
                       default=-1)
            problems.append(f"group {key}: no last_completed_collective; taken from the entries")
        pending = [_collective(e) for e in collectives if (_seq(e.get("collective_seq_id")) or 0) > done][:MAX_PENDING]
        last = next((e for e in reversed(collectives) if _seq(e.get("collective_seq_id")) == enq), None)
        groups[key] = PgDigest(key, descs.get(key, ""), enq, done, pending,
                               op_name(last.get("profiling_name")) if last is not None else None)
    return FrDigest(True, version, groups, len(entries), problems)
