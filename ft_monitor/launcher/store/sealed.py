"""Evidence sealed for the rendezvous store: AES-256-GCM under a key derived from the job secret.

torch's TCPStore is readable by anyone who reaches its port. A roll call's answers carry
every rank's stacks, native stacks, Flight Recorder digests, pids and file paths, so
they cross the store encrypted, not only signed (store_auth.py signs; this module hides).

* The key: HKDF-SHA256 over the job secret, info ``INFO`` (this purpose only; the
  signing key of store_auth.py is the secret itself, so the two never coincide).
* Each value: a fresh random 96-bit nonce, then AES-GCM's ciphertext and tag, in base64.
* The associated data: what the value is bound to (its store key, the rendezvous run id,
  round, asking node and incident: `aad`), so a ciphertext copied anywhere else, or
  altered by one bit, does not open.

`Sealer.open` is total: any text gives the plaintext or a `SealError`.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ft_monitor.launcher.store.store_auth import StoreMessageError

INFO = b"ft-launcher/roll-call-evidence/aes-256-gcm/v1"
NONCE_BYTES = 12
TAG_BYTES = 16


class SealError(StoreMessageError):
    """A sealed value that does not open under this job's key for what it claims to be."""


def aad(**binding: Any) -> bytes:
    """The associated data: the binding's fields, canonical JSON (sorted keys, ASCII)."""
    return json.dumps(binding, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class Sealer:
    """Seals and opens values for one job (its secret)."""

    def __init__(self, secret: bytes) -> None:
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO).derive(secret)
        self._aead = AESGCM(key)

    def seal(self, plaintext: bytes, associated: bytes) -> str:
        nonce = os.urandom(NONCE_BYTES)
        return base64.b64encode(nonce + self._aead.encrypt(nonce, plaintext, associated)).decode("ascii")

    def open(self, text: object, associated: bytes, limit: int) -> bytes:
        """The plaintext of ``text``; SealError unless it is this job's ciphertext for ``associated``."""
        if not isinstance(text, str) or len(text) > limit:
            raise SealError(f"sealed evidence must be text of at most {limit} characters")
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError) as e:
            raise SealError("sealed evidence is not base64") from e
        if len(raw) < NONCE_BYTES + TAG_BYTES:
            raise SealError("sealed evidence too short")
        try:
            return self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], associated)
        except InvalidTag as e:
            raise SealError("sealed evidence does not open (another job's key, another binding, or altered)") from e
