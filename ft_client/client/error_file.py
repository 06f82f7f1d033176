"""The raising rank's own error.json, written as torch's ``@record`` would have written it.

torch's launcher learns what a worker raised only from the error file the worker writes
(``$TORCHELASTIC_ERROR_FILE``), and a worker writes one only where its entry point is wrapped
in ``torch.distributed.elastic.multiprocessing.errors.record``. Most scripts are not (Lightning
and the Trainer scripts users run are not either): the exception's type, message and
traceback then never reached error.json, torch's failure table or ft-launcher's outputs,
and ft-launcher wrote one saying the rank "did not raise".

`write_uncaught` is called by the client's ``sys.excepthook`` (`exiting`): where the file is
not there yet (a script with ``@record`` wrote it already, and it is left alone), it writes
torch's format: ``{"message": {"message": "Type: text", "extraInfo": {"py_callstack":
traceback, "timestamp": seconds}}}``. Written whole to a fresh name beside it (created
exclusively, no symlink followed: `ft_client.safefiles.open_new`), then linked into place,
which never replaces what is there: torch reads the file as soon as the rank is gone, and a
rank that torch stops while it writes leaves no file rather than half of one (half of one
ends torch's launch with a JSONDecodeError). Only by the process that installed the hook,
never by a child it forked; never raises (the process is on its way out).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from types import TracebackType

from ft_client import env

MAX_CALLSTACK = 64 * 1024
"""The traceback's last characters kept (the launcher reads error files bounded as much)."""


def error_data(kind: type[BaseException], value: BaseException, tb: TracebackType | None,
               now: float) -> dict[str, object]:
    """torch's error-file content for an exception (``now``: the wall clock, seconds)."""
    text = "".join(traceback.format_exception(kind, value, tb))
    return {"message": {"message": f"{kind.__name__}: {value}",
                        "extraInfo": {"py_callstack": text[-MAX_CALLSTACK:], "timestamp": str(int(now))}}}


def write_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None,
                   owner_pid: int) -> str | None:
    """Write the exception to ``$TORCHELASTIC_ERROR_FILE`` unless something is there already;
    the path written, else None. Only in ``owner_pid`` (a forked child's exception is not the rank's)."""
    path = os.environ.get(env.ERROR_FILE)
    if not path or os.getpid() != owner_pid or issubclass(kind, (KeyboardInterrupt, SystemExit)):
        return None
    from ft_client.safefiles import open_new

    if os.path.lexists(path):  # @record wrote it already, or something is planted there: left alone
        return None
    body = json.dumps(error_data(kind, value, tb, time.time())).encode()
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        fd = open_new(tmp)
    except OSError:  # no folder, or not ours
        return None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.link(tmp, path)  # whole or not at all: torch reads it the moment the rank is gone (a file
        # created, then written, was read empty when torch stopped the rank between the two); never
        # replaces what is there (@record's, or a link planted since)
    except Exception:  # noqa: BLE001 - the process is exiting: the traceback printed next matters more
        return None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return path
