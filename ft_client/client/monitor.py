"""RankMonitorClient: what a training process calls to report progress.

The API follows nvidia-resiliency-ext's ``RankMonitorClient`` so its users can
switch by changing an import. The client never harms training: events are one
non-blocking send, requests are bounded by a timeout, and if the monitor goes
away the client logs one warning and carries on (or raises, if the monitor's
config says ``on_monitor_lost: raise``). Thread-safe.

What is sent: heartbeats always; a section's open/close only when the monitor
can act on it (`ft_client.timeouts.section_needs_ipc`); sections not listed in
rank_section_timeouts cost no IPC at all.

Where the monitor hands over a progress record (a shared-memory page, see
`ft_client.record`), progress is a few stores into it, with no syscall: each
monitored section is registered once over the socket (SECTION_SLOT) and then
opens and closes in its slot (a close by `end_section` also counts the section
and adds its time, so the monitor counts every step however seldom it reads);
heartbeats and the iteration are stored too. The
socket carries the rest (and every progress report where there is no record, or
the monitor's config says ``progress_record: false``). Either way, while an
in-process restart unwinds nothing is reported, and the first progress after
re-entry sends REENTERED over the socket before it is stored; re-entry starts a
new epoch of the record, so the sections abandoned while unwinding read as closed.

The connection is in one of the states of `ConnState`::

    NOT_INITIALIZED --init_workload_monitoring()--> CONNECTED
    CONNECTED --monitor gone (send/request failed)--> LOST --reconnected--> CONNECTED
    CONNECTED | LOST --shutdown_workload_monitoring()--> SHUT_DOWN --init...--> CONNECTED
    any --os.fork(), in the child--> FORKED_CHILD

While LOST, a background thread (never the training thread) tries the monitor's
socket again with a growing interval; progress calls return at once meanwhile.
In a forked child (a data-loader worker) the client is detached: it sends nothing
and every progress call does nothing, so a child can neither keep a dead or hung
rank's session alive nor speak for it.

The client is made of parts, each a module of this room (``ft_client/client/``, listed in
its ``__init__``): `progress` the hot path, `link` the connection's lifecycle, `learning` the
timeouts and the state dict, `restart` the in-process restart gate, and `state` the fields
they share (which says why the parts are mixins of this one class).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ft_client import env, wire
from ft_client.client.learning import ClientLearning
from ft_client.client.link import ClientLink, track_forks
from ft_client.client.progress import ClientProgress
from ft_client.client.restart import ClientRestart, RestartHook
from ft_client.client.state import CONNECT_TIMEOUT
from ft_client.errors import RankMonitorClientError
from ft_client.wire.transport import TransportError, connect
from ft_client.workload import CONFIGURATION_ERROR, WorkloadAction, WorkloadControlRequest

__all__ = ["RankMonitorClient"]

MAX_CONTROL_REASON = 4000
"""Characters of a reason sent to the launcher (it refuses more than 4096)."""


class RankMonitorClient(ClientProgress, ClientLearning, ClientRestart, ClientLink):
    """Client of one rank's monitor daemon.

    ``socket_path`` defaults to ``$FT_RANK_MONITOR_IPC_SOCKET``; ``clock`` (monotonic
    seconds) is injectable for tests.
    """

    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"
    """The key of nvidia-resiliency-ext's state dict, under its name: code that reads that entry
    (its tests, its client) finds it in the file the Lightning classes under its names write."""

    def __init__(self, socket_path: str | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(socket_path, clock)
        self._restart_hook = RestartHook(self)
        track_forks(self)

    # -- workload control ------------------------------------------------------
    def send_workload_control_request(
        self, req: WorkloadControlRequest | WorkloadAction | str, description: str = ""
    ) -> None:
        """Ask ft-launcher to act now: Continue, ExcludeThisNode or ShutdownWorkload.

        Goes straight to the launcher ($FT_LAUNCHER_IPC_SOCKET), request/reply;
        returns once the launcher has accepted it.
        """
        if isinstance(req, WorkloadControlRequest):
            action, description = req.action, req.description or description
        else:
            action = WorkloadAction.parse(req)
        ask_launcher(self.rank, action.value, description)


def ask_launcher(rank: int, action: str, description: str) -> None:
    """One request to ft-launcher ($FT_LAUNCHER_IPC_SOCKET) for ``rank``, answered before this
    returns; a refusal or no launcher raises `RankMonitorClientError`."""
    path = os.environ.get(env.LAUNCHER_SOCKET)
    if not path:
        raise RankMonitorClientError(
            f"no launcher socket: {env.LAUNCHER_SOCKET} is not set (run under ft-launcher to use workload control)"
        )
    try:
        t, _ = connect(path, CONNECT_TIMEOUT, wire.Role.RANK, rank)
    except (TransportError, OSError) as e:
        raise RankMonitorClientError(f"cannot reach the launcher at {path}: {e}") from e
    try:
        reply = t.request(wire.Control(action, description))
    except TransportError as e:
        raise RankMonitorClientError(f"launcher did not accept {action}: {e}") from e
    finally:
        t.close()
    if not isinstance(reply, wire.Ack):
        raise RankMonitorClientError(f"launcher refused {action}: {reply}")


def configuration_error(rank: int, reason: str) -> None:
    """Tell ft-launcher (where it started this rank) that the job's configuration cannot work:
    it stops the job at once, without a restart (`CONFIGURATION_ERROR`). Never raises; the
    caller raises its own error next."""
    if not os.environ.get(env.LAUNCHER_SOCKET):
        return
    try:
        ask_launcher(rank, CONFIGURATION_ERROR, reason[:MAX_CONTROL_REASON])
    except RankMonitorClientError:
        pass
