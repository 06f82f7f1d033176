"""Launcher-to-launcher messages in the rendezvous store, authenticated with the job's secret.

torch's c10d TCPStore has no authentication: anyone who can reach its port can
read and write any key. ft-launcher nodes use it to tell each other of a workload
shutdown, of hangs (which node's rank hung first) and, in a hang's roll call, to ask
for and send every rank's stacks and Flight Recorder digest. So every such message is
signed with HMAC-SHA256 under a per-job secret that only the job's user can read,
and bound to the store key and the rendezvous run id it was written for; a
message that is unsigned, forged, malformed, or copied from another key or job is
logged and ignored. Without a secret, the key the launchers agreed on through the rendezvous
store signs them instead (agreed_key.py: static and c10d; under etcd they are off).

The secret comes from ``--ft-job-secret-file FILE`` (or ``$FT_JOB_SECRET_FILE``):
a file of this user's that no one else can read; or from ``$FT_JOB_SECRET``
itself (a process's environment is readable only by its user). It must be the
same on every node of the job: docs/launcher.md shows how to provision it under
Slurm and Kubernetes. Workers never see it (it is removed from their environment).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

from ft_client.store.jobkey import (
    MAX_SECRET_BYTES,
    MIN_SECRET_BYTES,
    SECRET_ENV,
    SECRET_FILE_ENV,
    SecretError,
    load_job_secret,
)
from ft_client.store.signed import FORMAT_VERSION, MAX_MESSAGE_BYTES, Signer, StoreMessageError
from ft_client.store.signed import rank_field as _rank

__all__ = ["CrashRecord", "FORMAT_VERSION", "MAX_MESSAGE_BYTES", "MAX_SECRET_BYTES", "MIN_SECRET_BYTES",
           "SECRET_ENV", "SECRET_FILE_ENV", "HangRecord", "Message", "RollCallAnswer", "RollCallRequest",
           "RollCallVerdict", "SecretError", "ShutdownRequest", "StepTimes", "StoreChannel", "StoreMessageError",
           "load_job_secret"]

MAX_TEXT = 4096


def _text(body: Mapping[str, Any], key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise StoreMessageError(f"field {key} must be text of at most {MAX_TEXT} characters")
    return v


@dataclass(frozen=True, slots=True)
class ShutdownRequest:
    """A rank asked to shut the whole workload down (WorkloadAction.ShutdownWorkload)."""

    reason: str
    rank: int | None
    host: str

    KIND = "shutdown"

    def body(self) -> dict[str, Any]:
        return {"reason": self.reason, "rank": self.rank, "host": self.host}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ShutdownRequest:
        return cls(_text(body, "reason"), _rank(body, "rank", optional=True), _text(body, "host"))


@dataclass(frozen=True, slots=True)
class HangRecord:
    """One node's hang in a rendezvous round, for finding which rank hung first."""

    rank: int
    onset_time: float
    message: str
    host: str

    KIND = "hang"

    def body(self) -> dict[str, Any]:
        return {"rank": self.rank, "onset_time": self.onset_time, "message": self.message, "host": self.host}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> HangRecord:
        onset = body.get("onset_time")
        if isinstance(onset, bool) or not isinstance(onset, (int, float)) or not math.isfinite(onset) or onset < 0:
            raise StoreMessageError("field onset_time must be a finite number of seconds >= 0")
        return cls(_rank(body, "rank"), float(onset), _text(body, "message"), _text(body, "host"))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class RollCallVerdict:
    """The verdict of a roll call, published by the node that took it for the nodes that
    answered (rollcall.py): one incident, one culprit, on every node. Stored at
    ``ft_launcher/roll_call/verdict/<asker>/<incident>``, signed bound to the round."""

    incident: int
    culprit: int | None
    """The rank the evidence puts behind the others; None when the verdict rests on the
    monitor's word alone (then each node keeps its own decision)."""
    host: str
    """The culprit's host (the asker's when unknown)."""
    pid: int | None
    line: str
    """The verdict line."""
    diagnosis: str
    """Where the asking node wrote diagnosis.json (on its host)."""

    KIND = "roll_call_verdict"

    def body(self) -> dict[str, Any]:
        return {"incident": self.incident, "culprit": self.culprit, "host": self.host, "pid": self.pid,
                "line": self.line, "diagnosis": self.diagnosis}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RollCallVerdict:
        return cls(_rank(body, "incident"), _rank(body, "culprit", optional=True),  # type: ignore[arg-type]
                   _text(body, "host"), _rank(body, "pid", optional=True), _text(body, "line"),
                   _text(body, "diagnosis"))


@dataclass(frozen=True, slots=True)
class CrashRecord:
    """The root of one node's failed attempt (crash.py), for the nodes whose ranks failed
    only because of it, or were restarted with it; signed bound to its rendezvous round."""

    rank: int
    how: str
    host: str

    KIND = "crash"

    def body(self) -> dict[str, Any]:
        return {"rank": self.rank, "how": self.how, "host": self.host}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> CrashRecord:
        return cls(_rank(body, "rank"), _text(body, "how"), _text(body, "host"))  # type: ignore[arg-type]


MAX_STEP_TIME_RANKS = 1024
"""Ranks one node may report in a StepTimes message (its local ranks)."""


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One node's per-rank median section times, for finding slow ranks (slow_ranks.py)."""

    section: str
    medians: dict[int, float]
    """global rank -> median seconds of its recent durations of ``section``."""
    host: str

    KIND = "step_times"

    def body(self) -> dict[str, Any]:
        return {"section": self.section, "medians": {str(r): v for r, v in self.medians.items()}, "host": self.host}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> StepTimes:
        medians = body.get("medians")
        if not isinstance(medians, dict) or len(medians) > MAX_STEP_TIME_RANKS:
            raise StoreMessageError(f"field medians must be a map of at most {MAX_STEP_TIME_RANKS} ranks")
        out: dict[int, float] = {}
        for key, value in medians.items():
            if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 10:
                raise StoreMessageError("field medians must be keyed by rank")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise StoreMessageError("field medians must hold finite numbers of seconds >= 0")
            out[int(key)] = float(value)
        return cls(_text(body, "section"), out, _text(body, "host"))


@dataclass(frozen=True, slots=True)
class RollCallRequest:
    """The node that owns a hang's verdict asks every other node to dump its ranks (rollcall.py).

    Stored at the asking node's own key (``ft_launcher/roll_call/request/<group_rank>``);
    ``incident`` and ``round`` are what binds it: an answering node takes it once, only in
    ``round``, and only when ``incident`` is newer than the asker's last one it answered."""

    incident: int
    """The asking node's roll call number in this round (1, 2, ...)."""
    hung_rank: int
    host: str
    group_rank: int
    """The asking node's rank in the rendezvous (so it is not asked to answer itself)."""
    budget_s: float
    """Seconds the asking node waits for the answers, counted from its request."""
    round: int = 0
    """The rendezvous round it was asked in (a request copied into another round is refused)."""

    KIND = "roll_call"

    def body(self) -> dict[str, Any]:
        return {"incident": self.incident, "hung_rank": self.hung_rank, "host": self.host,
                "group_rank": self.group_rank, "budget_s": self.budget_s, "round": self.round}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RollCallRequest:
        budget = body.get("budget_s")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 3600:
            raise StoreMessageError("field budget_s must be a number of seconds > 0")
        return cls(_rank(body, "incident"), _rank(body, "hung_rank"), _text(body, "host"),  # type: ignore[arg-type]
                   _rank(body, "group_rank"), float(budget), _rank(body, "round"))  # type: ignore[arg-type]


MAX_ROLL_CALL_RANKS = 1024


@dataclass(frozen=True, slots=True)
class RollCallAnswer:
    """One node's ranks, as its roll call found them, for one request (``asker``, ``round``,
    ``incident``). The evidence (diagnosis.RankEvidence in wire form: stacks, native stacks,
    Flight Recorder digests, pids, paths) is ``sealed`` (sealed.py: AES-GCM under the job's
    key, bound to the same fields and the store key): the store shows who answered, not what."""

    incident: int
    host: str
    group_rank: int
    sealed: str
    """base64 of nonce + ciphertext + tag of the JSON list of the ranks' evidence."""
    round: int = 0
    asker: int = 0
    """The group rank of the node whose request this answers."""

    KIND = "roll_call_answer"
    MAX_BYTES = 12 * 1024 * 1024
    """Stacks travel in it (at most 32 KiB per rank, and native ones as much again), in base64."""

    def body(self) -> dict[str, Any]:
        return {"incident": self.incident, "host": self.host, "group_rank": self.group_rank,
                "sealed": self.sealed, "round": self.round, "asker": self.asker}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RollCallAnswer:
        sealed = body.get("sealed")
        if not isinstance(sealed, str):
            raise StoreMessageError("field sealed must be text (the evidence, encrypted)")
        return cls(_rank(body, "incident"), _text(body, "host"), _rank(body, "group_rank"),  # type: ignore[arg-type]
                   sealed, _rank(body, "round"), _rank(body, "asker"))  # type: ignore[arg-type]


Message = ShutdownRequest | HangRecord | StepTimes | RollCallRequest | RollCallAnswer | CrashRecord | RollCallVerdict


class StoreChannel:
    """Signs and checks launcher messages for one job (secret) and rendezvous run (run_id),
    through ft_client.store.signed (the envelope, the HMAC and its total parser). ``bind``: further
    fields a message is bound to (a round, an incident), checked on decode."""

    def __init__(self, secret: bytes, run_id: str, round: int | None = None) -> None:
        """``round``: the rendezvous round every message is bound to besides (c10d keeps the run
        id across rounds, so a value signed in one round would check out in the next: a node's
        hang record of round 0 copied into round 1 named the wrong culprit there)."""
        self._signer = Signer(secret, run_id)
        self.run_id = run_id
        self.round = round

    def _mac(self, envelope: Mapping[str, Any]) -> str:
        return self._signer.mac(envelope)

    def _bind(self, bind: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if self.round is None:
            return bind
        return {"round": self.round, **(bind or {})}

    def encode(self, key: str, message: Message, bind: Mapping[str, Any] | None = None) -> bytes:
        return self._signer.seal(message.KIND, key, message.body(), self._bind(bind))

    @overload
    def decode(self, key: str, raw: bytes, kind: type[StepTimes],
               bind: Mapping[str, Any] | None = None) -> StepTimes: ...

    @overload
    def decode(self, key: str, raw: bytes, kind: type[RollCallRequest],
               bind: Mapping[str, Any] | None = None) -> RollCallRequest: ...

    @overload
    def decode(self, key: str, raw: bytes, kind: type[RollCallAnswer],
               bind: Mapping[str, Any] | None = None) -> RollCallAnswer: ...

    @overload
    def decode(self, key: str, raw: bytes, kind: type[CrashRecord],
               bind: Mapping[str, Any] | None = None) -> CrashRecord: ...

    @overload
    def decode(self, key: str, raw: bytes, kind: type[RollCallVerdict],
               bind: Mapping[str, Any] | None = None) -> RollCallVerdict: ...

    @overload
    def decode(self, key: str, raw: bytes, kind: type[ShutdownRequest] | type[HangRecord],
               bind: Mapping[str, Any] | None = None) -> ShutdownRequest | HangRecord: ...

    def decode(self, key: str, raw: bytes, kind: type[ShutdownRequest] | type[HangRecord] | type[StepTimes]
               | type[RollCallRequest] | type[RollCallAnswer] | type[CrashRecord] | type[RollCallVerdict],
               bind: Mapping[str, Any] | None = None) -> Message:
        """The message stored at ``key``; raises StoreMessageError (and nothing else, whatever
        ``raw`` holds) unless it is authentic, of the expected kind, written for this key, run
        and ``bind``, and well-formed."""
        body = self._signer.open(kind.KIND, key, raw, self._bind(bind), getattr(kind, "MAX_BYTES", MAX_MESSAGE_BYTES))
        return kind.from_body(body)
