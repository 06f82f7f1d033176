"""Writing this rank's Flight Recorder trace when its monitor asks (FR_DUMP, roll call).

torch's Flight Recorder (on when ``TORCH_FR_BUFFER_SIZE`` > 0 in the environment the
process group was created in; ft-launcher sets it from ``flight_recorder_entries``)
keeps the last collectives this process enqueued. In a roll call the monitor pushes
FR_DUMP on the rank's control connection; the control thread (control.py) calls
`write_trace`, which writes ``torch._C._distributed_c10d._dump_fr_trace_json()`` (before torch
2.8, NCCL's ``_dump_nccl_trace_json``: `ft_client.torch_features`) to the path given, through
a temporary file and a rename, so the monitor sees a complete file or none. It never imports
torch: in a process that has not imported it there is nothing to dump, and a small JSON object
saying so is written instead, as it is for any failure, so the monitor does not wait for nothing.

It runs on the control thread, so it needs the GIL: a rank whose main thread holds the
GIL (stuck in a C call) writes nothing, and the roll call lists its trace as missing.
"""

from __future__ import annotations

import json
import sys

from ft_client.errors import FtError
from ft_client.safefiles import write_bytes_atomic
from ft_client.torch_features import flight_recorder

ERROR_KEY = "ft_error"
"""Set in the file written instead of a trace, with the reason."""


class NoFlightRecorderError(FtError, RuntimeError):
    """This process has no Flight Recorder trace to write (no torch, no c10d, an old torch)."""


def trace_bytes() -> bytes:
    """torch's Flight Recorder JSON for this process; raises NoFlightRecorderError when there is none."""
    if "torch" not in sys.modules:
        raise NoFlightRecorderError("torch is not imported in this process")
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError as e:
        raise NoFlightRecorderError(f"torch.distributed is not available: {e}") from e
    name = flight_recorder().dump_function  # torch's own from 2.8, NCCL's before (torch_features.py)
    dump = getattr(c10d, name, None)
    if dump is None:
        raise NoFlightRecorderError(f"this torch has no {name} (a torch built without NCCL keeps no trace before 2.8)")
    out = dump()
    return out if isinstance(out, bytes) else str(out).encode()


def write_trace(path: str) -> str | None:
    """Write the trace (or why there is none) to ``path``; the reason when there is none."""
    why: str | None = None
    try:
        data = trace_bytes()
    except Exception as e:  # noqa: BLE001 - whatever torch raises, the monitor must get an answer
        why = str(e) or type(e).__name__
        data = json.dumps({ERROR_KEY: why}).encode()
    write_bytes_atomic(path, data)
    return why
