"""Every setting's rule, written once (pure: no pydantic, no yaml).

Each rule takes a value in its typed (JSON) form and returns it typed, or raises
ValueError whose text is the rule, as a user reads it. `ft_monitor.config`
(pydantic: YAML, FT_<FIELD>, --ft-<field>) turns text forms ("none", "30",
"SIGTERM", "step:30") into values and then applies these rules;
`ft_monitor.core.settings` (what the daemon runs from, without pydantic) applies the
same rules to the JSON it is handed. A rule changed here changes both.
"""

from __future__ import annotations

import math
import reprlib
import signal
from collections.abc import Callable, Mapping
from typing import Any

from ft_client.learning.calc import SAFETY_FACTOR_RULE, safety_factor_ok
from ft_client.names import section_name_problem
from ft_client.timeouts import MAX_SECTIONS, Timeouts, TimeoutsError, check_timeout, check_wire_size

MAX_WHOLE = 2**63 - 1
"""Whole-number settings travel in msgpack as signed 64-bit integers."""
FAULTHANDLER_RESERVED = frozenset({signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL})
"""Signals faulthandler keeps for crashes: it cannot register them to dump on request."""
TIMEOUT_RULE = "must be a number of seconds > 0, or null to disable"
WHOLE_RULE = f"must be a whole number >= 0 and <= {MAX_WHOLE}"

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 8
_REPR.maxlevel = 2


def shown(value: Any) -> str:
    """repr() of a user's value for an error line: bounded in size and depth (a YAML alias
    can make a small file a huge or cyclic value)."""
    return _REPR.repr(value)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def timeout(v: Any) -> float | None:
    try:
        return check_timeout(v, "value")
    except ValueError as e:
        raise ValueError(TIMEOUT_RULE) from e


def section_timeouts(v: Any, convert: Callable[[Any], Any] = lambda x: x) -> dict[str, float | None]:
    """``convert`` turns a value's text form into a number or None first (the config's job)."""
    if not isinstance(v, Mapping):
        raise ValueError("must be a map of section name to seconds or null (CLI form: step:30,ckpt:none)")
    if len(v) > MAX_SECTIONS:
        raise ValueError(f"has {len(v)} sections; at most {MAX_SECTIONS}")
    out: dict[str, float | None] = {}
    for name, value in v.items():
        if isinstance(name, str) and not name.strip():
            raise ValueError(f"section name {shown(name)} must be a non-empty string")
        problem = section_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        try:
            out[name] = check_timeout(convert(value), name)
        except ValueError as e:
            raise ValueError(f"section {shown(name)} = {shown(value)}: {TIMEOUT_RULE}") from e
    return out


def whole(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_WHOLE:
        raise ValueError(WHOLE_RULE)
    return v


def connections(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65536:
        raise ValueError("must be a whole number from 1 to 65536 (connections besides the rank's)")
    return v


def number(bound: float, inclusive: bool, rule: str) -> Callable[[Any], float]:
    """A rule: a finite number >= ``bound`` (> ``bound`` unless ``inclusive``)."""

    def check(v: Any) -> float:
        if not _is_number(v) or v < bound or (v == bound and not inclusive):
            raise ValueError(rule)
        return float(v)

    return check


duration = number(0.0, True, "must be a number of seconds >= 0")
positive_seconds = number(0.0, False, "must be a number of seconds > 0")
request_timeout = number(0.0, False, "must be a number of seconds > 0 (a request must not wait forever)")


def safety_factor(v: Any) -> float:
    if not safety_factor_ok(v):
        raise ValueError(SAFETY_FACTOR_RULE)
    return float(v)


def parse_signal(value: Any) -> signal.Signals:
    """'SIGTERM', 'term', '15', 15 or signal.SIGTERM -> signal.SIGTERM; else KeyError/ValueError."""
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return signal.Signals(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            return signal.Signals(int(text))
        name = text.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        return signal.Signals[name]
    raise ValueError(value)


def signal_number(v: Any) -> signal.Signals:
    try:
        sig = parse_signal(v)
    except (KeyError, ValueError) as e:
        raise ValueError("must be a signal name or number, e.g. SIGTERM, TERM or 15") from e
    if sig in (signal.SIGSTOP, signal.SIGCONT):
        raise ValueError(f"{sig.name} cannot be used here")
    return sig


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def log_level(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_WHOLE:
        raise ValueError("must be DEBUG, INFO, WARNING, ERROR, CRITICAL or a number")
    return v


def on_monitor_lost(v: Any) -> str:
    if v not in ("warn", "raise"):
        raise ValueError("must be 'warn' (log once, keep training) or 'raise'")
    return str(v)


ON_HANG = ("kill", "inprocess", "dump")


def on_hang(v: Any) -> str:
    if v not in ON_HANG:
        raise ValueError("must be 'kill' (stop the rank; the launcher restarts the group), 'inprocess' (restart "
                         "in the same processes through ft_client.inprocess.Wrapper, kill as the fallback) or 'dump' "
                         "(diagnose and keep the job running)")
    return str(v)


MAX_FR_ENTRIES = 1_000_000


def flight_recorder_entries(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_FR_ENTRIES:
        raise ValueError(f"must be a whole number from 0 (Flight Recorder off) to {MAX_FR_ENTRIES} (collectives "
                         "each worker's Flight Recorder keeps: TORCH_FR_BUFFER_SIZE)")
    return v


SNAPSHOT_MAX_BYTES_DEFAULT = 16 * 2**30


def snapshot_max_bytes(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_WHOLE:
        raise ValueError(f"must be a whole number of bytes from 0 (snapshots off) to {MAX_WHOLE}: the snapshot "
                         "memory one monitor may hold (default 17179869184 = 16 GiB)")
    return v


def metrics_port(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        raise ValueError("must be a TCP port from 0 to 65535 (0: any free port, logged), or null for no /metrics")
    return v


def metrics_address(v: Any) -> str:
    if not isinstance(v, str) or not v.strip() or len(v) > 255 or any(c.isspace() for c in v):
        raise ValueError("must be an address to listen on, e.g. 127.0.0.1 (the default: this host only), :: or "
                         "0.0.0.0 (every interface)")
    return v


def metrics_textfile(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v.startswith("/") or not v.endswith(".prom"):
        raise ValueError("must be an absolute path ending in .prom (node-exporter's textfile collector reads only "
                         "those), or null")
    return v


def slow_rank_ratio(v: Any) -> float | None:
    if v is None:
        return None
    if not _is_number(v) or v <= 1.0:
        raise ValueError("must be a number > 1 (a rank is slow when its median section time exceeds the others' "
                         "by this factor), or null to turn slow-rank detection off")
    return float(v)


def section_name(v: Any) -> str:
    problem = section_name_problem(v)
    if problem is not None:
        raise ValueError(problem)
    return str(v)


def startup_until(v: Any) -> str:
    if v not in ("handshake", "first_step"):
        raise ValueError("must be 'handshake' (start-up ends when the worker connects to its monitor) or "
                         "'first_step' (at its first heartbeat or step section)")
    return str(v)


def timeout_check(v: Any) -> str:
    if v not in ("warn", "strict", "off"):
        raise ValueError("must be 'warn' (log each timeout inversion at launch), 'strict' (refuse to launch) or "
                         "'off'")
    return str(v)


def report_dir(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v.startswith("/"):
        raise ValueError("must be an absolute directory path, or null")
    return v


def signals_problem(dump: signal.Signals, term: signal.Signals) -> str | None:
    """The rule across the two signal settings; None when they are fine together."""
    if dump == term:
        return (f"stack_dump_signal = {dump.name} is also rank_termination_signal: the dump signal must not stop "
                "the rank; choose another (default SIGUSR2)")
    if dump in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        return (f"stack_dump_signal = {dump.name} would stop the rank instead of dumping its stack; use SIGUSR1, "
                "SIGUSR2 or a real-time signal")
    if dump in FAULTHANDLER_RESERVED:
        return (f"stack_dump_signal = {dump.name} is kept by faulthandler for crashes and cannot dump a stack on "
                "request; use SIGUSR1, SIGUSR2 or a real-time signal")
    return None


def timeouts_problem(timeouts: Timeouts) -> str | None:
    """The timeouts map must fit the wire (HELLO_OK, CONFIG_OK)."""
    try:
        check_wire_size(timeouts)
    except TimeoutsError as e:
        return str(e)
    return None
