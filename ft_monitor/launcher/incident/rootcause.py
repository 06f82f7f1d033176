"""A torchelastic error.json for a rank stopped because it hung, or for a crash's root.

torch's `ChildFailedError` names as root cause the failure with the earliest
timestamp. Ranks that waited in a collective for the hung one fail later, so an
error file whose timestamp is the hang onset (the hung rank's last progress)
makes the report at the end of a failed job name the hung rank. The traceback
shown for it is the rank's own stack dump, headed by what hung.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ft_client.safefiles import read_bounded, write_json_atomic
from ft_monitor.core.notices import HangNotice
from ft_monitor.launcher.incident.crash import CrashVerdict
from ft_monitor.launcher.store.store_auth import HangRecord

MAX_STACK_CHARS = 64 * 1024


def hang_error_data(notice: HangNotice, stack: str | None, victim_of: HangRecord | None = None, *,
                    diagnosis: str | None = None, verdict: str | None = None) -> dict[str, Any]:
    """The error.json content (torchelastic's ErrorHandler format) for a hang notice.

    ``victim_of``: the hang another node reported earlier in the same round; this rank
    was most likely waiting for it in a collective, and the message says so first.
    ``diagnosis``/``verdict``: the roll call's diagnosis.json and its verdict line: the
    headline points at the file, the traceback starts with the verdict.
    """
    where = f"rank {notice.rank}, pid {notice.pid}"
    headline = f"RankHang: {notice.message} ({where})"
    if victim_of is not None:
        headline = (f"RankHang: rank {victim_of.rank} on {victim_of.host} hung first "
                    f"({victim_of.message}); this rank was waiting for it: {notice.message} ({where})")
    if notice.stack_dump:
        headline += f"; stack dump: {notice.stack_dump}"
    if diagnosis:
        headline += f"; diagnosis: {diagnosis}"
    callstack = headline + "\n"
    if verdict:
        callstack += f"verdict: {verdict}\n"
    if stack:
        callstack += stack[-MAX_STACK_CHARS:]
    else:
        callstack += "(no stack dump was captured)"
    onset = notice.onset_time or notice.detected_time
    return error_data(headline, callstack, onset, {"ft_diagnosis": diagnosis} if diagnosis else None)


def crash_error_data(verdict: CrashVerdict, timestamp: float) -> dict[str, Any]:
    """The error.json for a crash's root that wrote none (it was killed, or exited without an
    exception): torch's failure table and a parent launcher then name it, with ``timestamp``
    no later than any other failure's."""
    headline = f"RankCrash: {verdict.how}"
    if verdict.victims:
        headline += f"; rank(s) {', '.join(map(str, verdict.victims))} failed because of it"
    if verdict.raised:  # it said what it raised, but its own error file was not written (no folder, a link)
        why = "(no traceback: the rank raised the exception above, but wrote no error file of its own)"
    else:
        why = ("(no stack: the process did not raise; a signal it did not get from ft-launcher or torch (the OOM "
               "killer, kill -9, a fault in native code) or an exit without an exception ended it)")
    callstack = headline + "\n" + verdict.message + "\n" + why
    return error_data(headline, callstack, timestamp)


def remote_crash_error_data(verdict: CrashVerdict, rank: int, own: object, timestamp: float) -> dict[str, Any]:
    """The error.json of ``rank``, a victim here of a root on another node (``verdict``, from
    that node's crash record), no later than any other failure here (``timestamp``): the
    headline names the root; what ``rank`` raised itself (``own``: torch's reading of its error
    file, if it wrote one) follows in the traceback, nothing of it lost."""
    headline = f"RankCrash: {verdict.how}, the root of the failure; rank {rank} here failed because of it"
    callstack = headline + "\n" + verdict.message + "\n"
    message = own.get("message") if isinstance(own, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        trace = extra.get("py_callstack") if isinstance(extra, dict) else None
        callstack += f"rank {rank}'s own error: {message.get('message')}\n{trace if isinstance(trace, str) else ''}"
    elif message is not None:
        callstack += f"rank {rank}'s own error: {message}"
    else:
        callstack += f"(rank {rank} wrote no error file of its own)"
    return error_data(headline, callstack[:MAX_STACK_CHARS], timestamp)


def error_data(headline: str, callstack: str, timestamp: float, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """torchelastic's ErrorHandler format: the headline torch's failure table shows, the
    traceback, and the whole seconds its root cause is chosen by (the earliest)."""
    return {"message": {"message": headline, "extraInfo": {"py_callstack": callstack,
                                                           "timestamp": str(int(timestamp)), **(extra or {})}}}


def read_stack(path: str | None) -> str | None:
    """The end of a stack dump file: no symlink followed, no FIFO waited on, bounded."""
    if not path:
        return None
    try:
        return read_bounded(path, MAX_STACK_CHARS)
    except OSError:
        return None


def write_error_file(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write atomically (the worker may be writing its own error.json as it dies)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)
