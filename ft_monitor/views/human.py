"""Numbers as people read them (pure): durations, ratios, counts, times of day.

``seconds(0.0421)`` is "42 ms", ``seconds(7.555)`` "7.55 s", ``seconds(125)`` "2 min 5 s",
``seconds(7384)`` "2 h 3 min"; ``percent(0.0423)`` "4.2 %"; ``count(12345)`` "12,345".
None (a value not known) is an en dash everywhere.
"""

from __future__ import annotations

import math
import time

UNKNOWN = "–"


def _finite(v: float | None) -> bool:
    return v is not None and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def seconds(v: float | None) -> str:
    """A duration with the unit and the digits it needs."""
    if v is None or not _finite(v):
        return UNKNOWN
    sign, v = ("-" if v < 0 else ""), abs(float(v))
    if v == 0:
        return "0 s"
    if v < 0.001:
        return f"{sign}{v * 1e6:.0f} µs"
    if v < 1:
        ms = v * 1000
        return f"{sign}{ms:.3g} ms" if ms < 10 else f"{sign}{ms:.0f} ms"
    if v < 10:
        return f"{sign}{v:.2f} s"
    if v < 60:
        return f"{sign}{v:.1f} s"
    if v < 3600:
        m, s = divmod(round(v), 60)
        return f"{sign}{m} min {s} s" if s else f"{sign}{m} min"
    if v < 86400 * 2:
        h, m = divmod(round(v / 60), 60)
        return f"{sign}{h} h {m} min" if m else f"{sign}{h} h"
    d, h = divmod(round(v / 3600), 24)
    return f"{sign}{d} d {h} h" if h else f"{sign}{d} d"


def percent(v: float | None) -> str:
    """A ratio (0..1) as a percentage, one decimal below 10 %."""
    if v is None or not _finite(v):
        return UNKNOWN
    p = float(v) * 100
    return f"{p:.1f} %" if abs(p) < 10 else f"{p:.0f} %"


def count(v: int | float | None) -> str:
    if v is None or not _finite(v):
        return UNKNOWN
    return f"{int(v):,}"


def plural(n: int, word: str, words: str | None = None) -> str:
    return f"{count(n)} {word if n == 1 else (words or word + 's')}"


def clock(t: float | None) -> str:
    """A Unix time as UTC date and time to the second."""
    if t is None or not _finite(t) or not -1e11 < t < 1e11:
        return UNKNOWN
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def ranks(rs: list[int] | tuple[int, ...]) -> str:
    """``rank 3``, ``ranks 0, 2 and 5``; runs of many as ``ranks 0–63``."""
    rs = sorted(set(rs))
    if not rs:
        return "no rank"
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts: list[str] = []
    start = prev = rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}, {prev}" if prev == start + 1 else f"{start}–{prev}")
        if r is not None:
            start = prev = r
    text = ", ".join(parts)
    head, _, last = text.rpartition(", ")
    return f"ranks {head} and {last}" if head else f"ranks {last}"
