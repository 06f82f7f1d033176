"""The launcher's messages to the other nodes' launchers, through the rendezvous store:
each node's hang record (exchanged so that decide.first_hang can name the node that hung
first) and a workload shutdown (published, then acknowledged by the others). Every value is
signed with the job's key (store_auth: the job secret, or the key the launchers agreed on through
the rendezvous, agreed_key.py); without one these features are off (main.py says so at start),
and a value that does not check out is ignored (logged once per value)."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from ft_monitor.launcher.incident.decide import read_hang_record
from ft_monitor.launcher.incident.rollcall_wire import ASKERS_KEY, BELL_KEY, request_key
from ft_monitor.launcher.stop_signal import reraise_stop
from ft_monitor.launcher.store.agreed_key import KEY as AGREED_KEY
from ft_monitor.launcher.store.step_exchange import STEP_TIMES_INDEX_KEY, STEP_TIMES_KEY
from ft_monitor.launcher.store.store_auth import (
    CrashRecord,
    HangRecord,
    ShutdownRequest,
    StoreChannel,
    StoreMessageError,
)
from ft_monitor.launcher.store.store_board import Board, first_sight

log = logging.getLogger("ft_monitor.launcher")

CRASH_KEY = "ft_launcher/crash/{}"
"""A node's crash record of the round, by its group rank (crash.py; read by the other nodes)."""
CRASH_INDEX_KEY = "ft_launcher/crash_index"
CRASH_COUNT_KEY = "ft_launcher/crash_count"
SHUTDOWN_KEY = "ft_launcher/shutdown"
SHUTDOWN_ACK_KEY = "ft_launcher/shutdown_ack/{}"
"""A node's acknowledgement of the shutdown request, by its group rank: the requester waits until
one ``check`` of the others' keys says all are there (a counter, which anyone could spoil, is
not needed: issue 38)."""
HANG_KEY = "ft_launcher/hang/{}"
HANG_INDEX_KEY = "ft_launcher/hang_index"
HANG_COUNT_KEY = "ft_launcher/hang_count"
HANG_POLL = 0.05
"""Seconds between looks at the hang board within the attribution window."""
STORE_POLL_INTERVAL = 1.0
CRASH_WAIT = 2.0
"""Seconds a node whose failed ranks all lost a peer waits for the crash record of the node
where the root was (that node sees its rank die and decides at about the same time)."""
ATTRIBUTION_WINDOW = 0.5
"""Seconds a launcher waits, on several nodes, for the other nodes' hang reports of the
same rendezvous round: ranks waiting in a collective for a hung rank on another node
time out too, and only the earliest onset is the hung rank."""


def crash_board(nodes: int) -> Board:
    """Where the nodes' crash records of a round are listed (store_board.py)."""
    return Board(CRASH_INDEX_KEY, CRASH_COUNT_KEY, CRASH_KEY.format, nodes)


def hang_board(nodes: int) -> Board:
    """Where the nodes' hang records of a round are listed (store_board.py)."""
    return Board(HANG_INDEX_KEY, HANG_COUNT_KEY, HANG_KEY.format, nodes)


TORCH_NODE_KEYS = ("torchelastic/role_info/{}", "torchelastic/assigned_ranks/{}")
"""The keys torch's agent writes per node in every round (`_assign_worker_ranks`), read by
no one once the round is over."""
TORCH_ROUND_KEYS = ("MASTER_ADDR", "MASTER_PORT")
"""The round's keys torch's rendezvous handler writes from its rank 0 (RendezvousStoreInfo.build)."""


class NodeMessages:
    """One agent's side of the messages between nodes (``job_secret`` None: none are sent)."""

    def __init__(self, job_secret: bytes | None) -> None:
        self.job_secret = job_secret
        """The key of the round joined last: the job secret, or the agreed key (the agent sets it)."""
        self._store_checked = 0.0
        self._bad_store_values: set[bytes] = set()
        self.round: int | None = None
        """The rendezvous round joined last (the agent's), every message's binding."""

    def channel(self, wg: WorkerGroup) -> StoreChannel | None:
        """Signing for launcher messages in the store; None without a key (the start line said why)."""
        if self.job_secret is None:
            return None
        return StoreChannel(self.job_secret, wg.spec.rdzv_handler.get_run_id(), self.round)

    def _store_message(self, channel: StoreChannel, key: str, raw: bytes,
                       kind: type[HangRecord] | type[ShutdownRequest]) -> HangRecord | ShutdownRequest | None:
        try:
            return channel.decode(key, raw, kind)
        except StoreMessageError as e:
            self._warn_bad_store_value(key, raw, kind.KIND, e)
            return None

    def _warn_bad_store_value(self, key: str, raw: bytes, kind: str, error: Exception) -> None:
        """One warning per distinct bad value (at most 100 remembered, by digest)."""
        if first_sight(self._bad_store_values, raw):
            log.warning("ft-launcher: ignored a %s message in the rendezvous store at %s: %s", kind, key,
                        str(error))  # the text, not the error: its traceback holds the store

    def exchange_hang_records(self, wg: WorkerGroup, channel: StoreChannel | None,
                              mine: HangRecord) -> dict[str, bytes]:
        """Publish this node's hang in the rendezvous store (keys are per round) and return the
        values the other nodes stored within ATTRIBUTION_WINDOW, by key (decide.first_hang picks).

        Through a `store_board.Board`: one ``add(count, 0)`` per look, and only the records
        published since the last look are read (one ``multi_get``), never a ``check`` per node."""
        store = wg.store
        values: dict[str, bytes] = {}
        if store is None or wg.group_world_size <= 1 or channel is None:
            return values
        try:
            board = hang_board(wg.group_world_size)
            key = HANG_KEY.format(wg.group_rank)
            board.publish(store, wg.group_rank, channel.encode(key, mine))
            end = time.monotonic() + ATTRIBUTION_WINDOW
            pending = {g for g in range(wg.group_world_size) if g != wg.group_rank}
            while pending and time.monotonic() < end:
                for g, raw in sorted(board.look(store, pending).items()):
                    key = HANG_KEY.format(g)
                    values.pop(key, None)
                    values[key] = raw  # in order of the last read
                    record = read_hang_record(channel, key, raw)
                    if isinstance(record, HangRecord):  # a forged value stays pending: the real one may follow
                        pending.discard(g)
                    else:
                        self._warn_bad_store_value(key, raw, HangRecord.KIND, record)
                if pending:
                    time.sleep(max(0.0, min(HANG_POLL, end - time.monotonic())))
        except Exception as e:  # noqa: BLE001 - attribution is best effort
            reraise_stop(e)
            log.warning("ft-launcher: could not compare hangs with other nodes: %s", e)
        return values

    def leave_round(self, store: Any, group_rank: int | None, written: Iterable[str] = ()) -> int:
        """After the next round of a rendezvous whose rounds have their own store prefix
        (torch's c10d/dynamic one: rounds.rounds_apart) completed, so that every node has left the
        previous round and nobody reads its keys again: delete this node's keys of the previous round, its hang
        and crash records, step times, roll call request and the answers it ``written``; node 0 also the
        round's shared boards (hang index and counter, the askers' index and the bell, the
        step times' index, the round's agreed key: agreed_key.py). Torch's
        own keys of the round go too (the rank assignment's per node, and the master address
        of node 0), which nothing reads again either. Without this every restart left ~4 keys
        per node in the store for the rest of the job. The number of store operations."""
        if store is None or group_rank is None:
            return 0
        keys = [HANG_KEY.format(group_rank), CRASH_KEY.format(group_rank), STEP_TIMES_KEY.format(group_rank),
                request_key(group_rank), *written,
                *(k.format(group_rank) for k in TORCH_NODE_KEYS)]
        if group_rank == 0:
            keys += [HANG_INDEX_KEY, HANG_COUNT_KEY, CRASH_INDEX_KEY, CRASH_COUNT_KEY, ASKERS_KEY, BELL_KEY,
                     STEP_TIMES_INDEX_KEY, AGREED_KEY, *TORCH_ROUND_KEYS]
        try:
            for key in keys:
                store.delete_key(key)
        except Exception as e:  # noqa: BLE001 - the store may be gone; tidying is best effort
            reraise_stop(e)
            log.debug("ft-launcher: could not delete the previous round's keys: %s", e)
        return len(keys)

    def publish_crash(self, wg: WorkerGroup, record: CrashRecord, round_: int) -> None:
        """Tell the other nodes which rank here was the root of this round's failure."""
        store = wg.store
        channel = self.channel(wg)
        if store is None or channel is None or wg.group_world_size <= 1:
            return
        key = CRASH_KEY.format(wg.group_rank)
        try:
            value = channel.encode(key, record, {"round": round_})
            crash_board(wg.group_world_size).publish(store, wg.group_rank, value)
        except Exception as e:  # noqa: BLE001 - the other nodes then name their own first victim
            reraise_stop(e)
            log.warning("ft-launcher: could not tell the other nodes the root of the failure: %s", e)

    def crash_elsewhere(self, wg: WorkerGroup, round_: int, wait: float = 0.0) -> CrashRecord | None:
        """Another node's crash record of round ``round_``, waiting up to ``wait`` s for one
        (the lowest group rank's where several are there); None when there is none, or no
        secret. A value that does not check out (forged, another round's) is ignored, logged."""
        store = wg.store
        channel = self.channel(wg)
        if store is None or channel is None or wg.group_world_size <= 1:
            return None
        board = crash_board(wg.group_world_size)
        others = [g for g in range(wg.group_world_size) if g != wg.group_rank]
        end = time.monotonic() + wait
        try:
            while True:
                for g, raw in sorted(board.look(store, others, force=True).items()):
                    key = CRASH_KEY.format(g)
                    try:
                        return channel.decode(key, raw, CrashRecord, {"round": round_})
                    except StoreMessageError as e:
                        self._warn_bad_store_value(key, raw, CrashRecord.KIND, e)
                if time.monotonic() >= end:
                    return None
                time.sleep(HANG_POLL)
        except Exception as e:  # noqa: BLE001 - the store host may be gone
            reraise_stop(e)
            return None

    def publish_shutdown(self, wg: WorkerGroup, reason: str, rank: int | None) -> None:
        """Tell the other nodes to stop (a workload shutdown), and wait (bounded) until they saw it."""
        store = wg.store
        channel = self.channel(wg)
        if store is None or channel is None or wg.group_world_size <= 1:
            return
        try:
            store.set(SHUTDOWN_KEY, channel.encode(SHUTDOWN_KEY, ShutdownRequest(reason, rank, socket.gethostname())))
            acks = [SHUTDOWN_ACK_KEY.format(g) for g in range(wg.group_world_size) if g != wg.group_rank]
            end = time.monotonic() + 10.0
            while acks and time.monotonic() < end and not store.check(acks):
                time.sleep(0.05)  # the store outlives this node only while we wait for the others to see it
        except Exception as e:  # noqa: BLE001 - the store may be gone; this node stops regardless
            reraise_stop(e)
            log.warning("ft-launcher: could not publish the shutdown to other nodes: %s", e)

    def shared_shutdown(self, wg: WorkerGroup) -> ShutdownRequest | None:
        """Another node's shutdown request, acknowledged (polled at most every STORE_POLL_INTERVAL)."""
        now = time.monotonic()
        if wg.store is None or wg.group_world_size <= 1 or now - self._store_checked < STORE_POLL_INTERVAL:
            return None
        self._store_checked = now
        channel = self.channel(wg)
        if channel is None:
            return None
        try:
            if not wg.store.check([SHUTDOWN_KEY]):
                return None
            request = self._store_message(channel, SHUTDOWN_KEY, wg.store.get(SHUTDOWN_KEY), ShutdownRequest)
            if not isinstance(request, ShutdownRequest):
                return None
            wg.store.set(SHUTDOWN_ACK_KEY.format(wg.group_rank), b"1")
        except Exception as e:  # noqa: BLE001 - the store host may be gone
            reraise_stop(e)
            return None
        return request
