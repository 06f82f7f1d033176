"""A job key agreed through the rendezvous store, for a multi-node job without a job secret.

Every launcher message between nodes (store_auth.py: which rank hung first, the root of a
crash, the roll call and its verdict, a workload shutdown, the slow-rank step times) is
signed, and the roll call's evidence sealed, with a key every node of the job holds. A job
secret (``$FT_JOB_SECRET_FILE``, ``--ft-job-secret-file``, ``$FT_JOB_SECRET``) is that key
when one is given. Without one, under torch's ``static`` and ``c10d`` rendezvous, the
launchers agree on a random key through the rendezvous store itself: each one, once it has
joined a round, offers a fresh random key at `KEY` with one ``compare_set`` (expected:
absent), which only the first offer wins; every launcher uses what that call returns.

That places in the store the trust torch already places in it: its rendezvous state is a
pickle that every launcher loads, so whoever can write the store can already run code in
every launcher; a forged verdict is less than that. With etcd (``etcd``, ``etcd-v2``) the
store can sit behind TLS client certificates while being readable by others, and there the
secret is the only thing between a reader of the store and forged verdicts: no key is agreed,
and the cross-node facts need a secret (docs/launcher.md, "The job secret").

Where the key lives: in the store the rendezvous hands the agent, which is per run id
(static: ``<run id>/``; c10d: ``torch.rendezvous.<run id>.<round>/``). Under c10d every round
agrees its own key, so a node that replaced a dead one, or a launcher restarted into a later
round, takes part in the agreement of the round it joins; under static the one store lives
as long as node 0's launcher, and a launcher that rejoins reads the key the others use.

`parse_key` is total: whatever the store holds at `KEY`, it returns a 32-byte key or raises
`AgreedKeyError` (a value someone else put there is refused, never guessed at).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from ft_client.errors import FtError
from ft_monitor.launcher.stop_signal import reraise_stop

log = logging.getLogger("ft_monitor.launcher")

KEY = "ft_launcher/job_key"
"""The store key the launchers agree at (under the rendezvous' own per-run prefix)."""
PREFIX = b"ft-launcher-job-key/v1:"
KEY_BYTES = 32
AGREEING_BACKENDS = frozenset({"static", "c10d"})
"""torch's rendezvous backends whose store is already a trust boundary (a pickle of their
state is loaded from it): the launchers agree on a key there without a secret."""
_HEX = frozenset(b"0123456789abcdef")


class AgreedKeyError(FtError, ValueError):
    """The value at the agreement's store key is not a key a launcher offered."""


def agrees(backend: object) -> bool:
    """Whether the launchers of a rendezvous ``backend`` (torch's name) agree on a key without a secret."""
    return isinstance(backend, str) and backend in AGREEING_BACKENDS


def encode_key(key: bytes) -> bytes:
    """The store value that offers ``key``."""
    if len(key) != KEY_BYTES:
        raise AgreedKeyError(f"an agreed key has {KEY_BYTES} bytes, not {len(key)}")
    return PREFIX + key.hex().encode()


def parse_key(raw: object) -> bytes:
    """The key a store value offers; AgreedKeyError (and nothing else) for anything but
    `PREFIX` and 64 lowercase hex digits."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise AgreedKeyError(f"the value at {KEY} is a {type(raw).__name__}, not bytes")
    value = bytes(raw)
    digits = value[len(PREFIX):]
    if not value.startswith(PREFIX) or len(digits) != 2 * KEY_BYTES or not set(digits) <= _HEX:
        raise AgreedKeyError(f"the value at {KEY} ({len(value)} bytes) is not {PREFIX.decode()} and "
                             f"{2 * KEY_BYTES} hex digits: not a key a launcher offered")
    return bytes.fromhex(digits.decode("ascii"))


def agree(store: Any, make: Callable[[int], bytes] = secrets.token_bytes) -> bytes:
    """The job key of this round's ``store``: this launcher's fresh offer if it is the first,
    else the one already there. AgreedKeyError where the store holds something else; the
    store's own errors (it is gone, it timed out) are the caller's."""
    offer = encode_key(make(KEY_BYTES))
    return parse_key(store.compare_set(KEY, b"", offer))


def round_key(handler: Any, store: Any, round_: int | None) -> bytes | None:
    """The job key of the rendezvous round just joined (torch's ``handler`` and the round's
    ``store``), for a launcher without a job secret: agreed where the backend `agrees`; None
    (the cross-node facts off this round, said in a warning where the store spoiled it) else."""
    try:
        backend = handler.get_backend()
    except Exception as e:  # noqa: BLE001 - a handler that cannot say agrees on nothing
        reraise_stop(e)
        return None
    if not agrees(backend) or store is None:
        return None
    try:
        return agree(store)
    except AgreedKeyError as e:  # logged as text: e's traceback holds the store (its connection)
        log.warning("ft-launcher: no job key in rendezvous round %s: %s; which rank hung or crashed first, the roll "
                    "call and a shutdown are not shared across nodes in this round (a job secret does not depend on "
                    "the store: docs/launcher.md, \"The job secret\")", round_, str(e))
    except Exception as e:  # noqa: BLE001 - the store may be gone: the round fails on its own then
        reraise_stop(e)
        log.warning("ft-launcher: could not agree on a job key through the rendezvous store: %s", str(e))
    return None


def start_line(backend: str, nodes: str) -> tuple[bool, str]:
    """The one line ft-launcher logs at start for a job of several nodes without a job secret
    (``nodes``: its --nnodes): (a warning, the text)."""
    how = "FT_JOB_SECRET_FILE=/path/to/a/0600/file on every node (or --ft-job-secret-file, or FT_JOB_SECRET)"
    if agrees(backend):
        return False, (f"ft-launcher: no job secret: the launchers agree on a job key through the {backend} "
                       f"rendezvous store (the trust torch's rendezvous already places in it), so which rank hung "
                       f"or crashed first, the roll call and a shutdown are shared across the {nodes} nodes; "
                       f"anyone who can write that store could forge them, as they can torch's own rendezvous "
                       f"state (docs/launcher.md, \"The job secret\"); to sign with a secret of your own: {how}")
    return True, (f"ft-launcher: no job secret under the {backend} rendezvous: which rank hung or crashed first, the "
                  f"roll call and a shutdown are not shared across nodes (each node names what it saw), and the "
                  f"in-process restart's store records are not authenticated, since a reader of the {backend} store "
                  f"could forge them; give every node the same secret: {how}")
