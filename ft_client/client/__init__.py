"""The room of `RankMonitorClient`, the SDK's one class a training script holds.

``from ft_client.client import RankMonitorClient`` (or ``from ft_client import
RankMonitorClient``) loads it. The class is made of parts, each a module here:

- `monitor`: the class itself and the workload-control request to the launcher;
- `progress`: the hot path (heartbeats, sections, the iteration);
- `link`: the connection's lifecycle (handshake, loss, reconnection, forks, shutdown);
- `learning`: the timeouts in force, learning them, the state dict;
- `restart`: the in-process restart gate (RESTARTING, REENTERED);
- `state`: the fields the parts share;
- `control`: the control connection (ABORT, FR_DUMP), a thread of its own;
- `flight_recorder`: writing the rank's Flight Recorder trace when asked;
- `stackdump`: the faulthandler registration for the monitor's dump signal;
- `exiting`: telling the monitor the process is on its way out;
- `error_file`: the raising rank's error.json, as torch's ``@record`` writes it.

Why the parts are mixins of one class and not collaborators is said in `state`.

May import: the hall (``ft_client.errors``, ``env``, ``timeouts``, ``session_info``, ``logs``,
...), ``ft_client.wire``, ``ft_client.record``, ``ft_client.learning``, ``ft_client.startup``
and ``ft_client.inprocess`` (its events). Nothing below imports this room back. Importing the
package loads nothing: the class is loaded on first use, so the launcher can take a constant
from `flight_recorder` without the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ft_client.client.link import EXITING_LOCK_WAIT as EXITING_LOCK_WAIT
    from ft_client.client.link import RECONNECT_INTERVAL as RECONNECT_INTERVAL
    from ft_client.client.link import RECONNECT_MAX_INTERVAL as RECONNECT_MAX_INTERVAL
    from ft_client.client.link import REFUSAL_POLL as REFUSAL_POLL
    from ft_client.client.monitor import RankMonitorClient as RankMonitorClient
    from ft_client.client.state import CONNECT_TIMEOUT as CONNECT_TIMEOUT
    from ft_client.client.state import ITERATION_REPORT_INTERVAL as ITERATION_REPORT_INTERVAL
    from ft_client.client.state import ConnState as ConnState

_HOMES = {
    # each public name, and the part that defines it
    "RankMonitorClient": "monitor", "ConnState": "state", "CONNECT_TIMEOUT": "state",
    "ITERATION_REPORT_INTERVAL": "state", "REFUSAL_POLL": "link", "RECONNECT_INTERVAL": "link",
    "RECONNECT_MAX_INTERVAL": "link", "EXITING_LOCK_WAIT": "link",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ft_client.client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ft_client.client.{home}"), name)
