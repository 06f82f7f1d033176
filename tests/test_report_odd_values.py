"""`ft-monitor report` on events that are odd but were valid by the schema (issue 24, item 7).

On main `validate_event` took any dict for ``phases`` (restart) and ``ranks`` (stats,
attempt_start) and any finite number anywhere, and `render` then raised a TypeError,
a ValueError or an OverflowError (or, with times of opposite huge signs, never ended),
and `read_events` let a RecursionError out of ``json.loads``. Now validation is total
(an event is either refused with EventSchemaError or renders) and reading a file
gives nothing but EventSchemaError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ft_monitor.launcher.telemetry.events import SCHEMA, EventSchemaError, read_events, validate_event
from ft_monitor.views.report_html import render, write_report

SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([1e300, -1e300, 10**30, -(10**30), 2**63, 1e15, -1e15]) | st.text(max_size=6))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4) | st.sampled_from(["0", "1", "total", "sections"]),
                                      inner, max_size=3), max_leaves=12)
RANK_KEYS = st.sampled_from(["0", "1", "12", "-1", "x", "1.5", "٣", ""])


def _default(types: tuple[type, ...]) -> Any:
    t = types[0]
    return {int: 1, float: 1.0, str: "x", dict: {}, list: [], type(None): None}[t]


def _base(kind: str, seq: int) -> dict[str, Any]:
    ev: dict[str, Any] = {"v": 1, "seq": seq, "time": 1.7e9 + seq, "kind": kind, "host": "h", "launcher_pid": 1}
    ev.update({name: _default(types) for name, types in SCHEMA[kind].items()})
    if kind == "restart":
        ev["mode"] = "process"
        ev["cause"] = "hang"
    return ev


@st.composite
def odd_event(draw: st.DrawFn, seq: int) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(SCHEMA)))
    ev = _base(kind, seq)
    for name in draw(st.lists(st.sampled_from(sorted({*SCHEMA[kind], "time"})), max_size=3, unique=True)):
        ev[name] = draw(SCALARS if draw(st.booleans()) else JSON)
    if kind == "restart" and draw(st.booleans()):
        ev["phases"] = draw(st.dictionaries(st.sampled_from(["total", "notify", "stop", "first_step", "x"]), JSON,
                                            max_size=4))
    if kind in ("stats", "attempt_start") and draw(st.booleans()):
        sections = st.dictionaries(st.text(max_size=3), st.dictionaries(
            st.sampled_from(["count", "median_s", "sum_s"]), JSON, max_size=3) | JSON, max_size=2)
        entry = st.fixed_dictionaries({}, optional={"iteration": JSON, "local_rank": JSON, "pid": JSON,
                                                    "sections": sections | JSON})
        ev["ranks"] = draw(st.dictionaries(RANK_KEYS, entry | JSON, max_size=3))
    return ev


@st.composite
def odd_events(draw: st.DrawFn) -> list[dict[str, Any]]:
    n = draw(st.integers(1, 5))
    return [draw(odd_event(i)) for i in range(n)]


def _render_if_valid(events: list[dict[str, Any]]) -> None:
    valid = []
    for ev in events:
        try:
            valid.append(validate_event(ev))
        except EventSchemaError:
            continue
    if valid:
        page = render(valid)
        assert page.startswith("<!DOCTYPE html>")


RESTART = _base("restart", 1)
STATS = _base("stats", 2)
START = _base("attempt_start", 0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(odd_events())
@example([START, {**RESTART, "phases": {"total": "1", "stop": 0.5}}])  # main: str - float
@example([START, {**RESTART, "phases": {"total": 1.0, "stop": [1]}}])  # main: list * float
@example([START, {**STATS, "ranks": {"rank-a": {"sections": {"step": {"median_s": 0.1}}}}}])  # main: int("rank-a")
@example([START, {**STATS, "ranks": {"0": {"sections": {"step": {"median_s": "slow"}}}}}])  # main: "slow" > 0
@example([START, {**STATS, "ranks": {"0": {"sections": ["step"]}}}])  # main: list.get
@example([{**START, "time": 10**400}])  # main: int too large to convert to float
def test_an_event_is_refused_or_rendered_never_a_traceback(events: list[dict[str, Any]]) -> None:
    _render_if_valid(events)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.sampled_from([b"[" * 20000, b"{\"a\":" * 20000, b"1e999", b"9" * 5000,
                                                   b'{"v": 1, "kind": [1]}']))
def test_reading_any_bytes_gives_events_or_one_typed_refusal(tmp_path_factory: pytest.TempPathFactory,
                                                             raw: bytes) -> None:
    path = tmp_path_factory.mktemp("ev") / "events.jsonl"
    path.write_bytes(json.dumps(START).encode() + b"\n" + raw + b"\n")
    try:
        events = read_events(path)
    except EventSchemaError:
        return
    render(events)


def test_the_report_command_refuses_a_deep_line_in_one_error(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(json.dumps(START) + "\n" + "[" * 20000 + "\n")
    with pytest.raises(EventSchemaError, match=r"events.jsonl:2: RecursionError"):
        write_report(tmp_path)
