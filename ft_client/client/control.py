"""The rank's control connection: where its monitor pushes ABORT (in-process restart)
and FR_DUMP (the roll call of a hang: write the Flight Recorder trace).

Opened beside the rank's main connection when the monitor's config says
``on_hang: inprocess`` or turns the Flight Recorder on (``flight_recorder_entries``).
A daemon thread blocks on it (the training thread never reads it) and hands each ABORT
to the in-process `Wrapper` running in this process through `ft_client.inprocess.events`;
the Wrapper spreads the fault to every rank through the torch.distributed store. An
FR_DUMP is answered by writing the trace (flight_recorder.py). Nothing here imports torch.
"""

from __future__ import annotations

import threading

from ft_client import logs, wire
from ft_client.client import flight_recorder
from ft_client.inprocess import events
from ft_client.wire.transport import Transport, TransportError, connect

log = logs.logger("ft_client")


class ControlLink:
    def __init__(self, path: str, rank: int, timeout: float) -> None:
        self.rank = rank
        self._transport: Transport = connect(path, timeout, wire.Role.CONTROL, rank, {})[0]
        self._thread = threading.Thread(target=self._run, name="ft-client-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t = self._transport
        while True:
            try:
                msg = t.receive()
            except TransportError:
                return
            if isinstance(msg, wire.Abort):
                fault = events.Fault(reason=msg.reason, rank=msg.hung_rank, iteration=msg.iteration, source="monitor")
                log.warning("rank %d: the monitor asks for an in-process restart: %s", self.rank, msg.reason)
                if not events.report_fault(fault):
                    log.error("rank %d: no ft_client.inprocess.Wrapper runs in this process to restart it; the "
                              "monitor stops the rank after inprocess_restart_timeout", self.rank)
            elif isinstance(msg, wire.FrDump):
                try:
                    why = flight_recorder.write_trace(msg.path)
                except OSError as e:
                    log.warning("rank %d: cannot write the Flight Recorder trace to %s: %s", self.rank, msg.path, e)
                else:
                    if why is not None:
                        log.info("rank %d: no Flight Recorder trace to write: %s", self.rank, why)
            else:
                log.warning("rank %d: unexpected %s on the control connection; ignored", self.rank,
                            type(msg).__name__)

    def close(self) -> None:
        self._transport.close()
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def abandon(self) -> None:
        """In a forked child: drop the connection without a word (the parent keeps its own)."""
        self._transport.abandon()
