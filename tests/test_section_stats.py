"""Section durations as the daemon keeps them (pure), and how they travel in STATUS."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ft_client.timeouts import Timeouts
from ft_monitor.core.section_stats import (
    BOUNDS,
    MAX_TRACKED_SECTIONS,
    RECENT,
    SectionHistogram,
    SectionStats,
    SectionStatsError,
)
from ft_monitor.core.state import Session
from ft_monitor.core.status import MonitorStatus, StatusError, build_status, format_status


def test_histogram_buckets_are_inclusive_upper_bounds_and_cumulative_ends_at_the_count() -> None:
    h = SectionHistogram()
    for d in (0.05, 0.05, 0.0500001, 7200.0):
        h.record(d)
    cum = dict(h.cumulative())
    assert cum[0.05] == 2 and cum[0.1] == 3 and cum[3600.0] == 3 and cum[math.inf] == 4
    assert h.count == 4 and h.sum_s == pytest.approx(7200.1500001)


def test_recent_median_follows_the_last_durations_only() -> None:
    h = SectionHistogram()
    for _ in range(100):
        h.record(1.0)
    for _ in range(RECENT):
        h.record(0.1)
    assert h.median_recent() == pytest.approx(0.1) and h.count == 100 + RECENT


def test_closes_counted_together_are_counted_and_summed_exactly_and_filed_at_their_mean() -> None:
    """A progress record's read may find many closes since the last one: their count and sum
    are the rank's, each is filed at the mean; one alone is exactly `record`."""
    h = SectionHistogram()
    h.record_many(40, 0.2)
    assert h.count == 40 and h.sum_s == pytest.approx(0.2) and sum(h.buckets) == 40
    assert dict(h.cumulative())[0.005] == 40 and dict(h.cumulative())[0.0025] == 0
    assert len(h.recent) == RECENT and h.median_recent() == pytest.approx(0.005)
    h.record_many(0, 0.0)
    assert h.count == 40
    one, other = SectionHistogram(), SectionHistogram()
    one.record_many(1, 0.3)
    other.record(0.3)
    assert one == other
    s = SectionStats()
    for i in range(MAX_TRACKED_SECTIONS):
        s.record(f"s{i}", 0.01)
    s.record_many("late", 5, 1.0)
    assert "late" not in s.sections and s.untracked == 5


def test_names_past_the_cap_are_counted_not_timed() -> None:
    s = SectionStats()
    for i in range(MAX_TRACKED_SECTIONS + 3):
        s.record(f"s{i}", 0.01)
    assert len(s.sections) == MAX_TRACKED_SECTIONS and s.untracked == 3


def test_wire_round_trip_and_refusals() -> None:
    s = SectionStats()
    s.record("step", 0.2)
    s.record("step", -1.0)  # a clock oddity is a zero, not a negative sum
    back = SectionStats.from_wire(s.to_wire())
    assert back.sections["step"].buckets == s.sections["step"].buckets
    assert list(back.sections["step"].recent) == [0.2, 0.0]
    bad = s.to_wire()
    bad["sections"]["step"]["buckets"] = [1] * len(BOUNDS)
    with pytest.raises(SectionStatsError, match="buckets"):
        SectionStats.from_wire(bad)
    with pytest.raises(SectionStatsError, match="fields"):
        SectionStats.from_wire({"sections": {"step": {"count": 1}}})


def test_session_counts_closed_steps_progress_and_the_iteration_it_started_from() -> None:
    s = Session(rank=0, pid=1, started_at=0.0, timeouts=Timeouts())
    assert s.last_progress is None
    s.open_section("step", 1.0)
    assert s.close_section("step", 1.25) == pytest.approx(0.25)
    s.open_section("step", 2.0)
    s.close_section("step", 2.5)
    s.set_iteration(12)  # the client counts on from its checkpoint: it resumed at 10
    assert s.iteration_base == 10 and s.steps_closed == 2 and s.last_progress == 2.5
    s.heartbeat(3.0)
    assert s.last_progress == 3.0
    s.mark_hung()
    assert s.close_section("step", 4.0) is None


def test_status_carries_the_stats_and_the_rank_iteration_now() -> None:
    s = Session(rank=3, pid=7, started_at=0.0, timeouts=Timeouts())
    s.open_section("step", 1.0)
    s.close_section("step", 1.5)
    s.set_iteration(41)
    stats = SectionStats()
    stats.record("step", 0.5)
    st = build_status(now=4.0, monitor_pid=1, socket="/s", started_at=0.0, sessions=1, timeouts=Timeouts(),
                      iteration_high=41, session=s, hangs=[], section_stats=stats)
    back = MonitorStatus.from_wire(st.to_wire())
    assert back.rank is not None and back.rank.iteration_now == 41 and back.rank.since_last_progress_s == 2.5
    assert replace(back.rank, iteration_base=None, iteration=7).iteration_now == 7  # the last report, as the policy
    assert replace(back.rank, iteration_base=0, steps_closed=0, iteration=7).iteration_now == 0
    assert back.section_stats.sections["step"].count == 1
    assert "'step' 0.500s x1" in format_status(back)
    wire = st.to_wire()
    wire["section_stats"] = {"sections": {"step": {"buckets": "x"}}}
    with pytest.raises(StatusError):
        MonitorStatus.from_wire(wire)


def test_status_from_an_older_daemon_without_stats_still_reads() -> None:
    st = build_status(now=1.0, monitor_pid=1, socket="/s", started_at=0.0, sessions=0, timeouts=Timeouts(),
                      iteration_high=None, session=None, hangs=[]).to_wire()
    del st["section_stats"]
    del st["last_iteration"]
    back = MonitorStatus.from_wire(st)
    assert back.section_stats.sections == {} and back.last_iteration is None


def test_status_of_a_rank_gone_says_where_its_session_ended() -> None:
    st = build_status(now=1.0, monitor_pid=1, socket="/s", started_at=0.0, sessions=1, timeouts=Timeouts(),
                      iteration_high=30, session=None, hangs=[], last_iteration=30)
    back = MonitorStatus.from_wire(st.to_wire())
    assert not back.connected and back.last_iteration == 30
