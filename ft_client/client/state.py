"""What a `RankMonitorClient` holds: its fields and their first values, written once for the
parts the client is made of (`link`, `progress`, `learning`, `restart`), which read and
write them as the one object they make up.

The calls one part makes into another are declared here for the type checker only; at run
time a client's methods are looked up on its class, as in one class.

Why `progress`, `link` and `restart` are mixins of one class, and `learning`'s state is a
collaborator (`ft_client.learning.learner.Learner`): not speed. A call through a collaborator
costs what a call into a mixin does (`bench/run.py --only client_cost`, rows "a locked store
through a mixin / a collaborator": 0.19 and 0.19-0.20 us, the same lock and store). It is what
the parts share. The three mixins read and write one state under one lock, on every call:
a progress call takes the lock, reads the connection's state and transport (`link`'s), the
open sections and the record (its own, which `link` replaces at each handshake and
`restart` resets at each re-entry) and the restart under way (`restart`'s), and reports a
loss back to `link`. As collaborators each would hold the others, and the lock, the transport
and the record would be passed around or read through each other: the same sharing, behind
more names. The learning's state (observations agreed, the monitor's factor and floor, a
checkpoint's timeouts) is its own: nothing on the hot path reads it, so it lives in the
learner, which the client calls under its lock; the recorder the hot path feeds stays here
(`_calc`), one attribute away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Literal

from ft_client import env, record
from ft_client.client.stackdump import StackDumper
from ft_client.errors import RankMonitorClientError
from ft_client.learning.calc import TimeoutsRecorder
from ft_client.learning.learner import Learner
from ft_client.timeouts import Timeouts

if TYPE_CHECKING:
    from ft_client.client.control import ControlLink
    from ft_client.inprocess import events
    from ft_client.wire.transport import Transport, TransportError

CONNECT_TIMEOUT = 10.0
ITERATION_REPORT_INTERVAL = 0.2
"""Seconds between iteration reports to the monitor (the launcher's progress tracking)."""
UNSENT = -1
"""`_open` route of a section the monitor was not told about."""
SOCKET = -2
"""`_open` route of a section reported over the socket; a route >= 0 is a record slot (as the
index of its SEQ word, `record.slot_word`)."""


class ConnState(Enum):
    NOT_INITIALIZED = "not initialized"
    CONNECTED = "connected"
    LOST = "lost"
    SHUT_DOWN = "shut down"
    FORKED_CHILD = "forked child"


class ClientState:
    """The fields of one client, shared by its parts (mixins of `RankMonitorClient`)."""

    def __init__(self, socket_path: str | None, clock: Callable[[], float]) -> None:
        try:
            rank = env.rank_from_env()
        except ValueError as e:
            raise RankMonitorClientError(str(e)) from e
        self._socket_path = socket_path
        self._clock = clock
        self._mono = clock is time.monotonic
        """The clock is the default: one monotonic_ns() read serves the record and the learning."""
        self._lock = threading.RLock()
        self._state = ConnState.NOT_INITIALIZED
        self._transport: Transport | None = None
        self._lost_reason: str | None = None
        self._lost_cause: TransportError | None = None
        """What broke the connection (the cause of MonitorBrokenError raised while LOST)."""
        self._request_timeout = CONNECT_TIMEOUT
        self._reconnector: threading.Thread | None = None
        self._stop_reconnecting = threading.Event()
        self._forked_warned = False
        self._timeouts = Timeouts()
        self._ipc: frozenset[str] = frozenset()
        self._open: dict[str, int] = {}
        """Open section -> how the monitor was told: UNSENT, SOCKET or its record slot."""
        self._record: record.RecordWriter | None = None
        """The progress record, while connected to a monitor that handed one over."""
        self._slots: dict[str, int] = {}
        """Section -> its slot in the current record (registered with SECTION_SLOT), as the
        index of the slot's SEQ word (`record.slot_word`): what the hot path stores at."""
        self._open_frames: dict[str, bytes] = {}
        self._close_frames: dict[str, bytes] = {}
        self._sync_sections = False
        self._raise_on_lost = False
        self._dumper = StackDumper()
        self._calc = TimeoutsRecorder()
        """What the hot path feeds on every progress call (made anew at each handshake by the
        learner, and held here so that it is one attribute away)."""
        self._learner = Learner()
        """The learning's collaborator: observations agreed, the monitor's factor and floor, a
        checkpoint's timeouts."""
        self._num_warmup_iters: int | None = None
        self._iteration = 0  # completed `step` sections, across runs (kept in state_dict)
        self._iteration_sent_at = -ITERATION_REPORT_INTERVAL
        self._path = ""
        self._control: ControlLink | None = None
        self._restart: events.Restart | Literal[True] | None = None  # True: unwinding; a Restart: re-entering
        """In-process restart under way: True between the Wrapper's abort and its re-entry
        (progress calls then report nothing: the rank is unwinding); the `events.Restart`
        after re-entry until the first progress call reports it (REENTERED); else None."""
        self.rank = rank

    _restart_hook: events.RestartListener
    """Set by `RankMonitorClient` (a `restart.RestartHook`)."""

    if TYPE_CHECKING:  # one part's calls into another; defined there
        @property
        def is_initialized(self) -> bool: ...

        # link
        def _event(self, t: Transport, frame: bytes) -> None: ...
        def _confirm(self) -> None: ...
        def _not_connected(self) -> Transport | None: ...
        def _not_connected_error(self) -> RankMonitorClientError: ...
        def _lost(self, e: TransportError, raising: bool = True) -> None: ...

        # progress
        def _register_slot(self, name: str) -> int | None: ...

        # learning
        def set_timeouts(self, timeouts: Timeouts) -> Timeouts: ...
        def _set_timeouts(self, timeouts: Timeouts) -> None: ...

        # restart
        def _restart_gate(self, t: Transport | None) -> bool: ...
