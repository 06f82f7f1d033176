"""Worker-side helper shared by the ingest and stalled benchmarks: count events sent.

The client decides which events go on the wire (heartbeats, monitored sections,
periodic iteration reports...). To check that the daemon lost none, the worker
counts every event frame handed to the transport, whatever the client chose to
send, by wrapping `Transport.send_event` in the worker process only. The wrapper
costs one Python call per event; figure 1 (client_cost) does not use it.
"""

from __future__ import annotations

from typing import Any


class EventCounter:
    def __init__(self) -> None:
        self.sent = 0

    def install(self) -> EventCounter:
        from ft_client.wire import transport
        real = transport.Transport.send_event
        counter = self

        def send_event(self: Any, frame: bytes) -> None:
            real(self, frame)
            counter.sent += 1

        transport.Transport.send_event = send_event  # type: ignore[method-assign]
        return self
