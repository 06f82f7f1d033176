"""A roll call's store values are read totally: any bytes, any JSON, any signed body and any
sealed plaintext give the message or a typed refusal (StoreMessageError, EvidenceError for
one rank), never another exception; the sealing's key and nonces."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ft_monitor.launcher.incident.diagnosis import ANSWERED, EvidenceError, RankEvidence
from ft_monitor.launcher.incident.rollcall_wire import answer_key, encode_answer, read_answer, read_request, request_key
from ft_monitor.launcher.store.sealed import INFO, Sealer, SealError, aad
from ft_monitor.launcher.store.store_auth import RollCallAnswer, RollCallRequest, StoreChannel, StoreMessageError

SECRET = b"w" * 32
CHANNEL = StoreChannel(SECRET, "run-w")
SEALER = Sealer(SECRET)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**300, max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30)

EVIDENCE_FIELDS = ("rank", "host", "status", "local_rank", "pid", "phase", "iteration", "stack", "native", "fr",
                   "fr_note", "files", "took_s", "notes")
EVIDENCE = st.dictionaries(st.sampled_from(EVIDENCE_FIELDS) | st.text(max_size=8), JSON, max_size=10) \
    | st.fixed_dictionaries({"rank": st.integers(0, 8), "status": st.just(ANSWERED)},
                            optional={k: JSON for k in EVIDENCE_FIELDS[3:]})


def _read_answer(raw: Any, incident: int = 1, refused: list[str] | None = None) -> Any:
    out = refused if refused is not None else []
    return read_answer(CHANNEL, SEALER, raw, asker=0, incident=incident, group_rank=1, round=0, refused=out.append)


class _AnyBody:
    """A message of ``kind`` whose body is anything (signed as this job's launchers sign)."""

    def __init__(self, kind: str, body: Any) -> None:
        self.KIND = kind
        self._body = body

    def body(self) -> Any:
        return self._body


def _signed(key: str, kind: str, body: Any) -> bytes:
    """An authentic envelope (this job's key, this key and run) around ``body``."""
    return CHANNEL.encode(key, _AnyBody(kind, body))  # type: ignore[arg-type]


def _read_both(raw: bytes) -> None:
    """``raw`` read as a request and as an answer: a value or StoreMessageError, nothing else."""
    for read in (lambda: read_request(CHANNEL, raw, asker=0, round=0), lambda: _read_answer(raw)):
        try:
            read()
        except StoreMessageError:
            pass


@FAST
@given(st.binary(max_size=2048))
@example(b'{"mac": "\\u00e9"}')
@example(b"[" * 16384)
@example(b'{"v":1,"kind":"roll_call","mac":"\xc3\xa9"}')
def test_any_bytes_are_a_request_or_a_refusal(raw: bytes) -> None:
    _read_both(raw)


@FAST
@given(JSON)
@example({"mac": "\u00e9", "v": 1})
@example({"mac": "é" * 64, "v": 1, "kind": "roll_call_answer", "key": answer_key(0, 1, 1), "run": "run-w"})
def test_any_json_is_a_request_or_a_refusal(value: Any) -> None:
    raw = json.dumps(value, ensure_ascii=False).encode()
    _read_both(raw)


@FAST
@given(JSON)
@example({"incident": 1, "hung_rank": 0, "host": "a", "group_rank": 0, "budget_s": 1.0, "round": 10**400})
@example({"incident": 1, "host": "b", "group_rank": 1, "sealed": "!!!", "round": 0, "asker": 0})
@example({"incident": 1, "host": "b", "group_rank": 1, "sealed": "A" * 40, "round": 0, "asker": 0})
def test_any_signed_body_is_a_message_or_a_refusal(body: Any) -> None:
    try:
        read_request(CHANNEL, _signed(request_key(0), RollCallRequest.KIND, body), asker=0, round=0)
    except StoreMessageError:
        pass
    try:
        _read_answer(_signed(answer_key(0, 1, 1), RollCallAnswer.KIND, body))
    except StoreMessageError:
        pass


def _sealed_answer(plaintext: bytes) -> bytes:
    key = answer_key(0, 1, 1)
    binding = aad(key=key, run=CHANNEL.run_id, round=0, asker=0, incident=1, group_rank=1)
    return CHANNEL.encode(key, RollCallAnswer(1, "b", 1, SEALER.seal(plaintext, binding), 0, 0))


@FAST
@given(st.binary(max_size=1024) | st.lists(EVIDENCE, max_size=4).map(lambda v: json.dumps(v).encode()))
@example(b"[" * 100_000)
@example(json.dumps([{"rank": 1, "status": ANSWERED, "took_s": 10**400}]).encode())
def test_any_sealed_evidence_is_evidence_or_a_refusal(plaintext: bytes) -> None:
    refused: list[str] = []
    try:
        host, evidence = _read_answer(_sealed_answer(plaintext), refused=refused)
    except StoreMessageError:
        return
    assert host == "b" and all(isinstance(e, RankEvidence) for e in evidence)


@FAST
@given(EVIDENCE)
@example({"rank": 1, "status": ANSWERED, "took_s": 10**400})
@example({"rank": 1, "status": ANSWERED, "took_s": -(10**400)})
def test_any_json_is_a_ranks_evidence_or_a_refusal(value: Any) -> None:
    """diagnosis.RankEvidence.from_wire (a float(10**400) took_s raised OverflowError)."""
    try:
        ev = RankEvidence.from_wire(value)
    except EvidenceError:
        return
    assert RankEvidence.from_wire(json.loads(json.dumps(ev.to_wire()))) == ev


@FAST
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: base64.b64encode(b).decode()) | JSON)
def test_any_text_opens_or_is_refused(text: Any) -> None:
    try:
        SEALER.open(text, b"binding", 1024)
    except SealError:
        pass


def test_each_seal_has_a_fresh_nonce_and_the_key_is_not_the_secret() -> None:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    a, b = SEALER.seal(b"same", b"x"), SEALER.seal(b"same", b"x")
    assert a != b and base64.b64decode(a)[:12] != base64.b64decode(b)[:12]
    assert SEALER.open(a, b"x", 1024) == SEALER.open(b, b"x", 1024) == b"same"
    raw = base64.b64decode(a)
    with pytest.raises(InvalidTag):  # the key is derived from the secret, not the secret
        AESGCM(SECRET).decrypt(raw[:12], raw[12:], b"x")
    assert INFO.startswith(b"ft-launcher/roll-call-evidence")


def test_an_answer_round_trips_and_is_refused_for_any_other_binding() -> None:
    ev = [RankEvidence(2, "b", ANSWERED, pid=7, stack="s")]
    req = RollCallRequest(1, 3, "a", 0, 5.0, 0)
    key, raw = encode_answer(CHANNEL, SEALER, req, "b", 1, ev)
    assert key == answer_key(0, 1, 1) and _read_answer(raw) == ("b", ev)
    for other in ({"incident": 2}, {"asker": 2}, {"round": 1}, {"group_rank": 2}):
        args: dict[str, Any] = {"asker": 0, "incident": 1, "group_rank": 1, "round": 0, **other}
        with pytest.raises(StoreMessageError):
            read_answer(CHANNEL, SEALER, raw, refused=lambda why: None, **args)
    with pytest.raises(StoreMessageError):
        read_answer(StoreChannel(SECRET, "another-run"), SEALER, raw, asker=0, incident=1, group_rank=1, round=0,
                    refused=lambda why: None)
