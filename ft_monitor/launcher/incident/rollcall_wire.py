"""A roll call's messages in the rendezvous store: the keys, what binds each value, and the
readers, which are total (any bytes give the message or a `StoreMessageError`).

Keys (under torch's per-round prefix of the rendezvous store):

* ``ft_launcher/roll_call/request/<A>``: node A's latest request (`RollCallRequest`,
  signed), overwritten by its next one. Every node has its own, so two nodes' requests
  never collide, and no shared counter decides which incident a node looks at: the
  incident is in the signed request.
* ``ft_launcher/roll_call/answer/<A>/<I>/<G>``: node G's answer to node A's incident I
  (`RollCallAnswer`, signed; its evidence sealed: sealed.py).
* ``ft_launcher/roll_call/askers``: the group ranks that stored a request, appended after
  it is stored, and ``ft_launcher/roll_call/bell``: a counter each asking node adds 1 to
  after that (store_board.py: the requests' board). Only hints of where and when to look:
  a node polls the bell, and reads the askers' index when it moved and at least every
  `SCAN_INTERVAL` seconds, so a forged or withheld ring delays nothing beyond that;
  what it reads there is the signed request, checked as ever.
* ``ft_launcher/roll_call/answered/<A>/<I>`` and ``.../answered_count/<A>/<I>``: the
  answers' board of node A's incident I (the answering nodes, and a counter): node A
  polls the counter, and reads only the answers listed since its last look. A deletes
  the answers it read, this board and its request when its roll call ends.

What binds each value: the signature covers the store key and the rendezvous run id
(store_auth.StoreChannel); the body names the round, and the answer also the asker and
incident, each checked against what the reader expects; the ciphertext's associated
data repeats all of them. A value copied to another key, round, incident or job is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from ft_client.errors import FtError
from ft_monitor.launcher.incident.diagnosis import EvidenceError, RankEvidence
from ft_monitor.launcher.store.sealed import Sealer, aad
from ft_monitor.launcher.store.store_auth import (
    MAX_ROLL_CALL_RANKS,
    RollCallAnswer,
    RollCallRequest,
    StoreChannel,
    StoreMessageError,
)
from ft_monitor.launcher.store.store_board import Board

REQUEST_KEY = "ft_launcher/roll_call/request/{}"
ANSWER_KEY = "ft_launcher/roll_call/answer/{}/{}/{}"
BELL_KEY = "ft_launcher/roll_call/bell"
ASKERS_KEY = "ft_launcher/roll_call/askers"
ANSWERED_KEY = "ft_launcher/roll_call/answered/{}/{}"
ANSWERED_COUNT_KEY = "ft_launcher/roll_call/answered_count/{}/{}"
VERDICT_KEY = "ft_launcher/roll_call/verdict/{}/{}"
"""The asking node's verdict of its incident, for the nodes that answered (asker, incident)."""
SCAN_INTERVAL = 1.0
"""Seconds between full reads of the other nodes' request keys, whatever the bell says."""
MAX_EVIDENCE_BYTES = 8 * 1024 * 1024
"""The sealed evidence of one node's ranks, decrypted."""

M = TypeVar("M", RollCallRequest, RollCallAnswer)


def request_key(asker: int) -> str:
    return REQUEST_KEY.format(asker)


def answer_key(asker: int, incident: int, group_rank: int) -> str:
    return ANSWER_KEY.format(asker, incident, group_rank)


def requests_board(nodes: int) -> Board:
    """Where the asking nodes of a round are listed (the bell is its counter)."""
    return Board(ASKERS_KEY, BELL_KEY, request_key, nodes)


def answers_board(asker: int, incident: int, nodes: int) -> Board:
    """Where the answers to node ``asker``'s ``incident`` are listed and counted."""
    return Board(ANSWERED_KEY.format(asker, incident), ANSWERED_COUNT_KEY.format(asker, incident),
                 lambda g: answer_key(asker, incident, g), nodes)


def _decode(channel: StoreChannel, key: str, raw: Any, kind: type[M]) -> M:
    """channel.decode, with nothing but StoreMessageError escaping (a signature that is not
    ASCII text, JSON nested too deep: whatever the envelope's parser does not refuse itself)."""
    if not isinstance(raw, (bytes, bytearray)):
        raise StoreMessageError("not a byte string")
    try:
        return channel.decode(key, bytes(raw), kind)
    except FtError:
        raise
    except Exception as e:  # noqa: BLE001 - an untrusted value never ends the roll call
        raise StoreMessageError(f"unreadable ({type(e).__name__})") from e


def read_request(channel: StoreChannel, raw: Any, *, asker: int, round: int) -> RollCallRequest:
    """Node ``asker``'s request, valid only for this ``round``."""
    request = _decode(channel, request_key(asker), raw, RollCallRequest)
    if request.group_rank != asker:
        raise StoreMessageError(f"a request of node {request.group_rank} in node {asker}'s key")
    if request.round != round:
        raise StoreMessageError(f"a request of rendezvous round {request.round}, not of this round {round} "
                                "(replayed)")
    return request


def _binding(channel: StoreChannel, key: str, round: int, asker: int, incident: int, group_rank: int) -> bytes:
    return aad(key=key, run=channel.run_id, round=round, asker=asker, incident=incident, group_rank=group_rank)


def encode_answer(channel: StoreChannel, sealer: Sealer, request: RollCallRequest, host: str, group_rank: int,
                  evidence: list[RankEvidence]) -> tuple[str, bytes]:
    """(key, value) of this node's answer to ``request``."""
    key = answer_key(request.group_rank, request.incident, group_rank)
    plaintext = json.dumps([e.to_wire() for e in evidence], separators=(",", ":")).encode()
    sealed = sealer.seal(plaintext, _binding(channel, key, request.round, request.group_rank, request.incident,
                                             group_rank))
    answer = RollCallAnswer(request.incident, host, group_rank, sealed, request.round, request.group_rank)
    return key, channel.encode(key, answer)


def read_answer(channel: StoreChannel, sealer: Sealer, raw: Any, *, asker: int, incident: int, group_rank: int,
                round: int, refused: Callable[[str], None]) -> tuple[str, list[RankEvidence]]:
    """(host, its ranks' evidence) of node ``group_rank``'s answer to ``asker``'s ``incident``
    in ``round``; a rank whose evidence breaks the rules is left out and said to ``refused``."""
    key = answer_key(asker, incident, group_rank)
    answer = _decode(channel, key, raw, RollCallAnswer)
    if (answer.round, answer.asker, answer.incident, answer.group_rank) != (round, asker, incident, group_rank):
        raise StoreMessageError(f"an answer to node {answer.asker}'s incident {answer.incident} of round "
                                f"{answer.round} from node {answer.group_rank}, not to node {asker}'s incident "
                                f"{incident} of round {round} from node {group_rank} (replayed)")
    plaintext = sealer.open(answer.sealed, _binding(channel, key, round, asker, incident, group_rank),
                            MAX_EVIDENCE_BYTES * 4 // 3 + 4)
    try:
        items = json.loads(plaintext)
    except (ValueError, RecursionError) as e:
        raise StoreMessageError("sealed evidence is not JSON") from e
    if not isinstance(items, list) or len(items) > MAX_ROLL_CALL_RANKS:
        raise StoreMessageError(f"sealed evidence must be a list of at most {MAX_ROLL_CALL_RANKS} ranks")
    evidence = []
    for item in items:
        try:
            evidence.append(RankEvidence.from_wire(item))
        except EvidenceError as e:
            refused(f"a rank in {answer.host}'s roll call answer: {e}")
    return answer.host, evidence
