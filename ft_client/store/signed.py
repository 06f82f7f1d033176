"""Signed JSON envelopes for values in a torch.distributed store, and their total parser.

torch's TCPStore has no authentication: anyone who reaches its port can read and write
any key. So every value ft writes there that changes an outcome is an envelope::

    {"v": 1, "kind": K, "key": STORE KEY, "run": RUN ID, <binding fields>, "body": {...},
     "mac": hex HMAC-SHA256 over the canonical JSON of everything else}

signed with a key only the job's processes hold, and bound to the store key it was
written at, the job's run id and any further fields the caller names (a rendezvous
round, an attempt, an iteration, an incident), so that a value copied to another key,
run, attempt or iteration is refused. `Signer.open` is total: whatever the bytes, it
returns the body of an authentic envelope or raises `StoreMessageError`, nothing else.

Used by ft-launcher's messages (ft_monitor/launcher/store/store_auth.py) and the in-process
Wrapper's records (ft_client/inprocess/store.py); stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Any

from ft_client.errors import FtError

FORMAT_VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024
"""Default bound on a stored value (a kind may allow more)."""
RESERVED = frozenset({"v", "kind", "key", "run", "body", "mac"})
"""Envelope fields a binding may not name."""
_MAC = re.compile(r"[0-9a-f]{64}")


class StoreMessageError(FtError, ValueError):
    """A store value that is not an authentic, well-formed message of this job."""


def canonical(obj: Any) -> bytes:
    """The one byte form of a JSON value that is signed (sorted keys, no spaces, ASCII)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def derive_key(secret: bytes, purpose: str, run_id: str) -> bytes:
    """A key for one purpose of one job run: HMAC-SHA256(secret, "purpose|run id"). Whoever
    holds it can sign that purpose's messages of that run only, and cannot recover the secret."""
    return hmac.new(secret, f"{purpose}|{run_id}".encode(), hashlib.sha256).digest()


class Signer:
    """Seals and opens envelopes under ``key`` for one job run (``run_id``)."""

    def __init__(self, key: bytes, run_id: str) -> None:
        self._key = key
        self.run_id = run_id

    def mac(self, envelope: Mapping[str, Any]) -> str:
        return hmac.new(self._key, canonical(envelope), hashlib.sha256).hexdigest()

    def seal(self, kind: str, key: str, body: Mapping[str, Any], bind: Mapping[str, Any] | None = None) -> bytes:
        """The signed value of ``body`` as a ``kind`` message for store key ``key``."""
        bind = dict(bind or {})
        if RESERVED & bind.keys():
            raise StoreMessageError(f"binding fields may not be named {sorted(RESERVED & bind.keys())}")
        envelope = {**bind, "v": FORMAT_VERSION, "kind": kind, "key": key, "run": self.run_id, "body": body}
        return canonical({**envelope, "mac": self.mac(envelope)})

    def open(self, kind: str, key: str, raw: object, bind: Mapping[str, Any] | None = None,
             limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
        """The body of the ``kind`` message stored at ``key``; raises StoreMessageError (and
        nothing else, whatever ``raw`` holds) unless it is authentic, of that kind, and
        written for this key, run and binding."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise StoreMessageError(f"a {type(raw).__name__}, not bytes")
        raw = bytes(raw)
        if len(raw) > limit:
            raise StoreMessageError(f"{len(raw)} bytes, more than {limit}")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise StoreMessageError("not JSON" if not isinstance(e, RecursionError) else "not JSON (nested too deep)"
                                    ) from None
        if not isinstance(data, dict) or not isinstance(data.get("mac"), str):
            raise StoreMessageError("not signed")
        mac = data.pop("mac")
        if not _MAC.fullmatch(mac):
            raise StoreMessageError("not signed (the mac is not 64 hex digits)")
        try:
            expected = self.mac(data)
        except (ValueError, RecursionError):  # cannot happen for what json.loads returned; kept total anyway
            raise StoreMessageError("not signable") from None
        if not hmac.compare_digest(mac.encode("ascii"), expected.encode("ascii")):
            raise StoreMessageError("bad signature (not written with this job's key)")
        if data.get("v") != FORMAT_VERSION or data.get("kind") != kind:
            raise StoreMessageError(f"not a version-{FORMAT_VERSION} {kind} message")
        if data.get("key") != key or data.get("run") != self.run_id:
            raise StoreMessageError("written for another key or rendezvous run (replayed)")
        for field, value in (bind or {}).items():
            if field not in data or data[field] != value or type(data[field]) is not type(value):
                raise StoreMessageError(f"written for another {field} (replayed)")
        body = data.get("body")
        if not isinstance(body, dict):
            raise StoreMessageError("body must be a map")
        return body


def rank_field(body: Mapping[str, Any], name: str, *, optional: bool = False) -> int | None:
    """``body[name]`` as a rank (a whole number >= 0, not a bool), or None where ``optional``
    and absent; StoreMessageError otherwise."""
    v = body.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**31:
        raise StoreMessageError(f"field {name} must be a rank (a whole number >= 0)")
    return v
