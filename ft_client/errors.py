"""The one exception family of ft_client and ft_monitor.

Every exception either package raises derives from `FtError`, so ``except
FtError`` catches anything of ours and nothing else. Each class keeps the
builtin base that callers caught before (``ValueError`` for bad values,
``OSError`` for unsafe files, ...), so existing handlers still work::

    FtError
    ├── RankMonitorClientError          the client cannot do what was asked
    │   ├── MonitorClosedError          ... because the connection was closed on our side
    │   │                                   (never initialized, shut down, a forked child)
    │   ├── MonitorBrokenError          ... because the monitor went away or stopped answering
    │   ├── NotEnoughDataError          learned timeouts asked for before enough was observed
    │   ├── WorkloadActionError         a name that is not a workload action
    │   └── SessionInfoError            the monitor's handshake broke the rules
    ├── TransportError                  one connection failed (TransportClosedError, TransportBrokenError)
    ├── ProtocolError                   a frame or message broke the wire protocol
    ├── TimeoutsCalcError               TimeoutsCalc (the reference's calculator API) refused a call
    │   └── TimeoutsCalcNotReadyError   ... not enough observed (also a NotEnoughDataError)
    ├── TimeoutsError, StateDictError   a timeouts map, a request to learn timeouts (safety factor,
    │                                   sections) or a checkpointed state is invalid
    ├── UnsafeFileError                 a path others could tamper with
    ├── StoreMessageError               a store value that is not an authentic message of this job (signed.py)
    ├── SecretError                     the job secret or a job key cannot be used (jobkey.py)
    ├── NoFlightRecorderError           this process has no Flight Recorder trace to write
    ├── MemorySnapshotError             an in-memory snapshot cannot be saved or restored
    │   └── SnapshotFormatError         ... bytes that are not a complete snapshot (snapshot/format.py)
    └── ft_monitor's: ConfigError, SettingsError, UsageError, ListenerError, SessionError,
        NoticeError, StatusError, ReportError, SealError (a StoreMessageError), MonitorStartError,
        HttpRequestError, MetricsServerError, SnapshotError, EvidenceError, PreloadError
        (--ft-preload names no module), TemplateError (the worker template cannot serve)
        and its TemplateRefused (it refused a request, saying why)

Closed and broken are types (as trio's ClosedResourceError and
BrokenResourceError are), not fields; the cause is kept (``raise ... from e``).
"""

from __future__ import annotations


class FtError(Exception):
    """The base of every exception ft_client and ft_monitor raise."""


class RankMonitorClientError(FtError):
    """The client cannot do what was asked: not connected, bad use, monitor gone."""


class MonitorClosedError(RankMonitorClientError):
    """The connection to the monitor was closed on this side: not initialized yet, shut
    down, or this process is a fork of the rank. Calling init_workload_monitoring()
    (in the rank) is the way on."""


class MonitorBrokenError(RankMonitorClientError):
    """The monitor went away or stopped answering (raised with ``on_monitor_lost: raise``,
    and by requests that need an answer)."""


class MemorySnapshotError(FtError, RuntimeError):
    """An in-memory snapshot (ft_client.snapshot) cannot be saved or restored; the message
    says why (the monitor refused the memory, a value a snapshot cannot hold, ...)."""
