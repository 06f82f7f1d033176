"""The in-process restart's exceptions: `RestartInterrupt`, which unwinds the training
function for a restart (control flow, not an error), and the `InProcessError` family,
raised when the in-process restart cannot go on (the process exits and the
process-level restart takes over)."""

from __future__ import annotations

from ft_client.errors import FtError


class RestartInterrupt(BaseException):  # noqa: N818 - named for what it does, like KeyboardInterrupt
    """Raised in the main thread to leave the training function for an in-process restart.
    A BaseException on purpose: ``except Exception`` in user code must not swallow it."""


class InProcessError(FtError):
    """The in-process restart cannot go on; the process should exit (the launcher restarts it)."""


class HealthCheckError(InProcessError):
    """The ``health_check`` hook failed after a fault."""


class RestartLimitError(InProcessError):
    """``max_iterations`` in-process restarts were used."""


class BarrierTimeoutError(InProcessError, TimeoutError):
    """Not every rank reached the restart barrier within ``barrier_timeout`` (one died?)."""


class DistributedInitializedError(InProcessError, ValueError):
    """torch.distributed was initialised before the wrapped call (a ValueError, as the reference raises)."""


class HookError(InProcessError, TypeError):
    """A hook given to the `Wrapper` or to `Compose` is not callable (a TypeError, as the
    reference's type checks raise)."""
