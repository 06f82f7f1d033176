"""A rendezvous store that went away: one line and an exit code of its own (issue 43).

When etcd stops mid-job, torch's agent meets it at its next look at the rendezvous (every
monitor tick) and the launcher ended with exit 2 and ``RendezvousConnectionError: The
connection to etcd has failed. See inner exception for details.`` (``etcd-v2``) or
``EtcdConnectionFailed: No more machines in the cluster`` (``etcd``), behind 8-30 lines of
python-etcd's and urllib3's retries and, under ``etcd``, torch's traceback of the failed
shutdown. Neither named the store nor the endpoint, and exit 2 tells a scheduler "fix the
command, do not requeue", while the job itself was fine.

`unreachable` tells such an error from any other (by the names of torch's and python-etcd's
connection errors anywhere in its chain: neither package need be importable here) and says
it in one line; `outcome` adds STORE_UNREACHABLE once the job had started (requeue when
the store is back) and LAUNCHER_ERROR before (the endpoint may be wrong). A store that
answers with a rendezvous state that cannot be parsed (`unparsable`: torch's ``etcd`` state
refused by etcd_state.py, naming its key, or torch's own RendezvousStateError) is a store
failure too, before or after the start: one line, STORE_UNREACHABLE (issue 49). `QuietClient`
holds back the lines that only repeat either: the store client's retries (shown at log level
DEBUG) and torch's report of the shutdown that failed for the same reason.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ft_monitor.core.server_log import printable
from ft_monitor.launcher import exit_codes

GONE = frozenset({"RendezvousConnectionError", "EtcdConnectionFailed"})
UNPARSABLE = frozenset({"EtcdStateError", "RendezvousStateError"})
"""A state in the store that cannot be parsed: etcd_state.py's (it names the key) and torch's
(its c10d and etcd-v2 backends: "The rendezvous state is corrupt")."""
"""Exceptions that mean the rendezvous store could not be reached: torch's, raised by its
c10d and etcd-v2 backends, and python-etcd's, which torch's ``etcd`` backend lets through."""
MAX_CHAIN = 16

CLIENT_LOGGERS = ("etcd.client", "etcd", "urllib3.connectionpool")
"""python-etcd's and urllib3's loggers: each failed request of the etcd client is logged there
(3 retries, "Request to server ... failed", "Machines cache is empty") before it raises."""
TORCH_LOGGERS = ("torch.distributed.elastic.rendezvous.etcd_rendezvous",
                 "torch.distributed.elastic.rendezvous.dynamic_rendezvous")
"""Where torch reports the failed shutdown of a rendezvous whose store is gone (``etcd``: a
traceback; ``etcd-v2``: one line)."""


def chain(error: BaseException) -> list[BaseException]:
    """``error`` and what it came from: ``__cause__``, ``__context__``, and the ``cause`` and
    ``reason`` python-etcd and urllib3 keep; each once, at most MAX_CHAIN."""
    out: list[BaseException] = []
    todo: list[object] = [error]
    while todo and len(out) < MAX_CHAIN:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or any(e is seen for seen in out):
            continue
        out.append(e)
        todo.extend((e.__cause__, e.__context__, getattr(e, "cause", None), getattr(e, "reason", None)))
    return out


def _named_gone(e: BaseException, names: frozenset[str] = GONE) -> bool:
    return any(c.__name__ in names for c in type(e).__mro__)


def is_gone(error: BaseException) -> bool:
    """Whether ``error`` says the rendezvous store could not be reached, or holds a state that cannot be parsed."""
    return any(_named_gone(e, GONE | UNPARSABLE) for e in chain(error))


def _line(e: BaseException) -> str:
    """The first line of ``e``'s message, without torch's pointer to its cause (at most 200 characters)."""
    lines = str(e).strip().splitlines()
    return (lines[0].split(". See inner exception", 1)[0] if lines else type(e).__name__)[:200]


def _reason(error: BaseException) -> str:
    """The deepest plain cause: the socket's error where there is one ("Connection refused"),
    else what the store client said (torch's generic "The connection to ... has failed. See
    inner exception for details.": that inner exception)."""
    found = chain(error)
    for e in reversed(found):
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
    for e in found:
        if _named_gone(e) and "See inner exception" in str(e) and e.__cause__ is not None \
                and not _named_gone(e.__cause__):
            return _line(e.__cause__)
    return _line(next(e for e in found if _named_gone(e)))


def unreachable(error: BaseException, backend: str, endpoint: str) -> str | None:
    """The one line for ``error`` when it says the store went away, else None."""
    if not any(_named_gone(e) for e in chain(error)):
        return None
    kind = "etcd" if backend.startswith("etcd") else backend
    return f"the rendezvous store ({kind} at {endpoint}, --rdzv-backend {backend}) is unreachable: {_reason(error)}"


def unparsable(error: BaseException, backend: str, endpoint: str) -> str | None:
    """The one line for ``error`` when it says the store holds a rendezvous state that cannot be
    parsed (the key and why, where etcd_state.py refused it; torch's reason and its cause's else)."""
    bad = next((e for e in chain(error) if _named_gone(e, UNPARSABLE)), None)
    if bad is None:
        return None
    kind = "etcd" if backend.startswith("etcd") else backend
    key, reason = getattr(bad, "key", None), getattr(bad, "reason", None)
    if not isinstance(key, str) or not isinstance(reason, str):
        cause = bad.__cause__
        key, reason = "", _line(bad) + (f" ({type(cause).__name__}: {_line(cause)})" if cause is not None else "")
    at = f" at {printable(key)}" if key else ""
    return f"the rendezvous store ({kind} at {endpoint}, --rdzv-backend {backend}) holds a rendezvous state that " \
           f"cannot be parsed{at}: {printable(reason)}"


def outcome(error: BaseException, backend: str, endpoint: str, started: bool) -> tuple[str, int] | None:
    """The line and the exit code for ``error`` when it says the store went away (else None):
    STORE_UNREACHABLE once workers had run (``started``: it went away mid-job), LAUNCHER_ERROR
    before (it never answered: the endpoint may be wrong). A state that cannot be parsed:
    STORE_UNREACHABLE either way (the store answered; what it holds was spoiled)."""
    bad = unparsable(error, backend, endpoint)
    if bad is not None:
        return bad, exit_codes.STORE_UNREACHABLE
    line = unreachable(error, backend, endpoint)
    if line is None:
        return None
    return line, exit_codes.STORE_UNREACHABLE if started else exit_codes.LAUNCHER_ERROR


def repeats_it(record: logging.LogRecord) -> bool:
    """Whether ``record`` (from one of TORCH_LOGGERS) only reports a store that went away:
    the launcher says that itself, once."""
    if record.exc_info and record.exc_info[1] is not None:
        return is_gone(record.exc_info[1])
    message = record.getMessage()
    return "failed to shutdown the rendezvous" in message and any(name in message for name in GONE | UNPARSABLE)


class QuietClient(logging.Filter):
    """On the store client's loggers: its records go to DEBUG (dropped unless ft-monitor logs
    at DEBUG); on torch's rendezvous loggers: those that `repeats_it` are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("torch."):
            return not repeats_it(record)
        if record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger("ft_monitor").isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def quiet_client(backend: str) -> Iterator[None]:
    """`QuietClient` on the loggers of the etcd backends' client while inside (other backends:
    nothing; their client logs nothing of this)."""
    loggers = [logging.getLogger(name) for name in (*CLIENT_LOGGERS, *TORCH_LOGGERS)] \
        if backend.startswith("etcd") else []
    quiet = QuietClient()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
