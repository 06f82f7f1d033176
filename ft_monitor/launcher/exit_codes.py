"""ft-launcher's exit codes: distinct, documented (docs/launcher.md); and how a worker ended."""

import signal

SUCCESS = 0
"""Every worker finished successfully."""
WORKERS_FAILED = 1
"""Workers failed (crash or hang) and the restart budget (--max-restarts) is spent."""
LAUNCHER_ERROR = 2
"""Bad arguments or configuration, or the launcher itself failed."""
NO_PROGRESS = 3
"""The training iteration did not advance for max_no_progress_cycles consecutive attempts."""
SHUTDOWN_REQUESTED = 4
"""A rank asked to shut the workload down (WorkloadAction.ShutdownWorkload)."""
NODE_EXCLUDED = 5
"""A rank asked that this node leave the job (WorkloadAction.ExcludeThisNode)."""
STORE_UNREACHABLE = 6
"""The rendezvous store (etcd, or the c10d store's host) stopped answering after the workers
had started, or answered with a rendezvous state that cannot be parsed (rdzv/store_gone.py,
rdzv/etcd_state.py): the job is intact, requeue once the store is back (or cleaned)."""


def how(exitcode: int) -> str:
    """How a worker ended, from its exit code (negative: the signal that killed it)."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"
