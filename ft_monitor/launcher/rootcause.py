"""A torchelastic error.json for a rank stopped because it hung.

torch's `ChildFailedError` names as root cause the failure with the earliest
timestamp. Ranks that waited in a collective for the hung one fail later, so an
error file whose timestamp is the hang onset (the hung rank's last progress)
makes the report at the end of a failed job name the hung rank. The traceback
shown for it is the rank's own stack dump, headed by what hung.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

MAX_STACK_CHARS = 64 * 1024


def hang_error_data(notice: dict[str, Any], stack: str | None,
                    victim_of: dict[str, Any] | None = None) -> dict[str, Any]:
    """The error.json content (torchelastic's ErrorHandler format) for a hang notice.

    ``victim_of``: the hang another node reported earlier in the same round; this rank
    was most likely waiting for it in a collective, and the message says so first.
    """
    where = f"rank {notice.get('rank')}, pid {notice.get('pid')}"
    dump = notice.get("stack_dump")
    headline = f"RankHang: {notice.get('message')} ({where})"
    if victim_of is not None:
        headline = (f"RankHang: rank {victim_of.get('rank')} on {victim_of.get('host')} hung first "
                    f"({victim_of.get('message')}); this rank was waiting for it: {notice.get('message')} "
                    f"({where})")
    if dump:
        headline += f"; stack dump: {dump}"
    callstack = headline + "\n"
    if stack:
        callstack += stack[-MAX_STACK_CHARS:]
    else:
        callstack += "(no stack dump was captured)"
    onset = notice.get("onset_time") or notice.get("detected_time") or 0
    return {
        "message": {
            "message": headline,
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(onset))},
        }
    }


def read_stack(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def write_error_file(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write atomically (the worker may be writing its own error.json as it dies)."""
    directory = Path(path).parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".error-", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
