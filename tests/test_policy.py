"""Session state and hang policy with a fake clock: every deadline, and which one fires first."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_client.timeouts import Timeouts
from ft_monitor.core import startup
from ft_monitor.core.policy import Deadline, Hang, Reason, check, deadlines, next_deadline
from ft_monitor.core.startup import Spawned
from ft_monitor.core.state import MAX_OPEN_SECTIONS, Phase, Session, SessionError

T0 = 1000.0  # the handshake, on the daemon's monotonic clock


def session(*, warmup_iterations: int = 0, started_at: float = T0, **timeouts: Any) -> Session:
    return Session(rank=3, pid=4242, started_at=started_at, timeouts=Timeouts(**timeouts),
                   num_warmup_iterations=warmup_iterations)


def reasons(s: Session) -> set[tuple[Reason, str | None]]:
    return {(d.reason, d.section) for d in deadlines(s)}


def fires_at(s: Session, at: float) -> Hang:
    """The session is fine just before ``at`` and hung exactly at ``at``; returns that hang."""
    assert check(s, at - 1e-6) is None
    hang = check(s, at)
    assert hang is not None
    return hang


# ---------------------------------------------------------------------------
# Heartbeats


def test_nothing_timed_by_default() -> None:
    s = session()
    assert deadlines(s) == []
    assert next_deadline(s) is None
    assert check(s, T0 + 1e9) is None


def test_initial_heartbeat_deadline_counts_from_the_handshake() -> None:
    s = session(initial_rank_heartbeat_timeout=60.0, rank_heartbeat_timeout=5.0)
    assert next_deadline(s) == Deadline(T0 + 60.0, Reason.INITIAL_HEARTBEAT, T0, 60.0)
    hang = fires_at(s, T0 + 60.0)
    assert hang.reason is Reason.INITIAL_HEARTBEAT
    assert hang.onset == T0
    assert hang.elapsed == 60.0
    assert hang.last_heartbeat is None
    assert (hang.rank, hang.pid) == (3, 4242)


def test_subsequent_heartbeat_deadline_after_the_first() -> None:
    s = session(initial_rank_heartbeat_timeout=60.0, rank_heartbeat_timeout=5.0)
    s.heartbeat(T0 + 40.0)
    assert next_deadline(s) == Deadline(T0 + 45.0, Reason.HEARTBEAT, T0 + 40.0, 5.0)
    s.heartbeat(T0 + 44.0)
    hang = fires_at(s, T0 + 49.0)
    assert hang.reason is Reason.HEARTBEAT
    assert hang.last_heartbeat == T0 + 44.0
    assert hang.onset == T0 + 44.0
    assert s.heartbeats == 2


def test_heartbeat_timeout_none_is_off() -> None:
    s = session(initial_rank_heartbeat_timeout=60.0, rank_heartbeat_timeout=None)
    s.heartbeat(T0 + 1.0)
    assert deadlines(s) == []
    assert check(s, T0 + 1e6) is None


def test_initial_timeout_off_subsequent_on() -> None:
    s = session(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=5.0)
    assert check(s, T0 + 1e6) is None  # no first heartbeat is never a hang when initial is off
    s.heartbeat(T0 + 1e6)
    assert fires_at(s, T0 + 1e6 + 5.0).reason is Reason.HEARTBEAT


# ---------------------------------------------------------------------------
# Sections


def test_section_deadline_from_its_opening() -> None:
    s = session(rank_section_timeouts={"step": 10.0})
    s.open_section("step", T0 + 2.0)
    hang = fires_at(s, T0 + 12.0)
    assert hang.reason is Reason.SECTION
    assert hang.section == "step"
    assert hang.onset == T0 + 2.0
    assert hang.open_sections == (("step", 10.0),)


def test_closed_section_is_not_timed() -> None:
    s = session(rank_section_timeouts={"step": 10.0})
    s.open_section("step", T0)
    s.close_section("step", T0 + 9.0)
    assert deadlines(s) == []
    s.open_section("step", T0 + 9.5)
    assert fires_at(s, T0 + 19.5).onset == T0 + 9.5


def test_section_without_timeout_is_not_timed() -> None:
    s = session(rank_section_timeouts={"step": 10.0})
    s.open_section("unlisted", T0)
    s.open_section("step", T0 + 1.0)
    assert reasons(s) == {(Reason.SECTION, "step")}


def test_expired_outer_section_is_detected_while_an_inner_one_is_fresh() -> None:
    # The nvidia-resiliency-ext defect: the inner section's state hid the outer one's.
    s = session(rank_section_timeouts={"outer": 10.0, "inner": 100.0}, rank_heartbeat_timeout=1000.0)
    s.heartbeat(T0)
    s.open_section("outer", T0)
    s.open_section("inner", T0 + 9.0)
    hang = fires_at(s, T0 + 10.0)
    assert (hang.reason, hang.section) == (Reason.SECTION, "outer")
    assert dict(hang.open_sections) == {"outer": 10.0, "inner": 1.0}


def test_expired_inner_section_is_detected_inside_a_fresh_outer_one() -> None:
    s = session(rank_section_timeouts={"outer": 100.0, "inner": 5.0})
    s.open_section("outer", T0)
    s.open_section("inner", T0 + 1.0)
    assert fires_at(s, T0 + 6.0).section == "inner"


def test_overlapping_sections_are_checked_independently() -> None:
    s = session(rank_section_timeouts={"a": 10.0, "b": 10.0})
    s.open_section("a", T0)
    s.open_section("b", T0 + 5.0)
    s.close_section("a", T0 + 8.0)  # a closes before b: overlapping, not nested
    assert reasons(s) == {(Reason.SECTION, "b")}
    assert fires_at(s, T0 + 15.0).section == "b"
    s2 = session(rank_section_timeouts={"a": 10.0, "b": 10.0})
    s2.open_section("a", T0)
    s2.open_section("b", T0 + 5.0)
    assert fires_at(s2, T0 + 10.0).section == "a"


def test_open_twice_is_an_error() -> None:
    s = session(rank_section_timeouts={"step": 10.0})
    s.open_section("step", T0)
    with pytest.raises(SessionError, match=r"^section 'step' opened while already open$"):
        s.open_section("step", T0 + 1.0)
    assert s.open_sections["step"].opened_at == T0  # unchanged
    assert s.steps_started == 1


def test_close_unopened_is_an_error() -> None:
    s = session(rank_out_of_section_timeout=5.0)
    with pytest.raises(SessionError, match=r"^section 'ckpt' closed while not open$"):
        s.close_section("ckpt", T0 + 1.0)
    assert s.out_of_section_since is None  # unchanged: not judged before the first section


def test_max_open_sections() -> None:
    s = session()
    for i in range(MAX_OPEN_SECTIONS):
        s.open_section(f"s{i}", T0)
    with pytest.raises(SessionError, match=rf"^more than {MAX_OPEN_SECTIONS} sections open at once$"):
        s.open_section("one-more", T0)
    assert len(s.open_sections) == MAX_OPEN_SECTIONS
    s.close_section("s0", T0)
    s.open_section("one-more", T0)


def test_close_all_sections() -> None:
    s = session(rank_section_timeouts={"a": 5.0, "b": 5.0}, rank_out_of_section_timeout=30.0)
    s.open_section("a", T0)
    s.open_section("b", T0 + 1.0)
    s.close_all_sections(T0 + 2.0)
    assert s.open_sections == {}
    assert reasons(s) == {(Reason.OUT_OF_SECTION, None)}
    assert fires_at(s, T0 + 32.0).onset == T0 + 2.0


def test_close_all_with_nothing_open_keeps_the_out_of_section_clock() -> None:
    s = session(rank_out_of_section_timeout=30.0)
    s.open_section("a", T0 + 1.0)
    s.close_section("a", T0 + 5.0)
    s.close_all_sections(T0 + 20.0)
    assert fires_at(s, T0 + 35.0).onset == T0 + 5.0


# ---------------------------------------------------------------------------
# Out of section


def test_out_of_section_is_not_judged_before_the_first_section() -> None:
    # nvidia-resiliency-ext's rule: init, loading and the way to the first step are not
    # out-of-section time (before: counted from the handshake, a slow start was killed)
    s = session(rank_out_of_section_timeout=30.0)
    assert deadlines(s) == [] and check(s, T0 + 1000.0) is None
    s.open_section("step", T0 + 1000.0)
    s.close_section("step", T0 + 1001.0)
    hang = fires_at(s, T0 + 1031.0)
    assert (hang.reason, hang.section, hang.onset) == (Reason.OUT_OF_SECTION, None, T0 + 1001.0)
    assert hang.open_sections == ()


def test_out_of_section_is_not_judged_after_an_in_process_reentry_before_the_first_section() -> None:
    s = session(rank_out_of_section_timeout=30.0)
    s.open_section("step", T0)
    s.close_section("step", T0 + 1.0)
    s.begin_restart(T0 + 2.0, 60.0)
    s.reentered(1, T0 + 3.0)
    assert check(s, T0 + 500.0) is None
    s.open_section("step", T0 + 500.0)
    s.close_section("step", T0 + 501.0)
    assert fires_at(s, T0 + 531.0).onset == T0 + 501.0


def test_with_a_warmup_timeout_out_of_section_is_judged_from_the_handshake() -> None:
    """Issue 39 item 4: nvidia-resiliency-ext judges out-of-section time from the handshake
    when ``warmup`` is among the section timeouts: a rank that sleeps 40 s before any section is
    stopped at 30 s (before: never). After an in-process re-entry, from the re-entry."""
    s = session(rank_section_timeouts={"step": 10.0, "warmup": 60.0}, rank_out_of_section_timeout=30.0)
    hang = fires_at(s, T0 + 30.0)
    assert (hang.reason, hang.onset) == (Reason.OUT_OF_SECTION, T0)
    s = session(rank_section_timeouts={"step": 10.0, "warmup": 60.0}, rank_out_of_section_timeout=30.0)
    s.open_section("step", T0 + 1.0)
    s.close_section("step", T0 + 2.0)
    s.begin_restart(T0 + 3.0, 60.0)
    s.reentered(1, T0 + 4.0)
    assert fires_at(s, T0 + 34.0).onset == T0 + 4.0


def test_a_warmup_timeout_learned_before_the_first_section_starts_the_clock_then() -> None:
    s = session(rank_section_timeouts={"step": 10.0}, rank_out_of_section_timeout=30.0)
    assert check(s, T0 + 100.0) is None
    s.set_timeouts(Timeouts(rank_section_timeouts={"step": 10.0, "warmup": 60.0}, rank_out_of_section_timeout=30.0),
                   T0 + 100.0)
    assert fires_at(s, T0 + 130.0).onset == T0 + 100.0


def test_out_of_section_only_while_no_section_is_open() -> None:
    s = session(rank_out_of_section_timeout=30.0)
    s.open_section("a", T0 + 10.0)  # no timeout of its own: nothing is timed while it is open
    assert deadlines(s) == []
    assert check(s, T0 + 1000.0) is None
    s.open_section("b", T0 + 11.0)
    s.close_section("a", T0 + 50.0)
    assert deadlines(s) == []  # b still open
    s.close_section("b", T0 + 60.0)  # the last one closes: the clock restarts now
    assert next_deadline(s) == Deadline(T0 + 90.0, Reason.OUT_OF_SECTION, T0 + 60.0, 30.0)
    assert fires_at(s, T0 + 90.0).onset == T0 + 60.0


# ---------------------------------------------------------------------------
# Warm-up


def test_warmup_replaces_the_step_timeout_for_the_first_steps() -> None:
    s = session(warmup_iterations=2, rank_section_timeouts={"step": 10.0, "warmup": 100.0})
    opened: list[tuple[float | None, bool]] = []
    for i in range(4):
        s.open_section("step", T0 + 200.0 * i)
        sec = s.open_sections["step"]
        opened.append((sec.timeout, sec.warmup))
        s.close_section("step", T0 + 200.0 * i + 1.0)
    assert opened == [(100.0, True), (100.0, True), (10.0, False), (10.0, False)]
    assert s.steps_started == 4


def test_warmup_step_fires_on_the_warmup_timeout() -> None:
    s = session(warmup_iterations=1, rank_section_timeouts={"step": 10.0, "warmup": 100.0})
    s.open_section("step", T0)
    hang = fires_at(s, T0 + 100.0)
    assert (hang.section, hang.timeout) == ("step", 100.0)
    s2 = session(warmup_iterations=1, rank_section_timeouts={"step": 10.0, "warmup": 100.0})
    s2.open_section("step", T0)
    s2.close_section("step", T0 + 50.0)
    s2.open_section("step", T0 + 60.0)
    assert fires_at(s2, T0 + 70.0).timeout == 10.0


def test_warmup_null_means_no_timeout_during_warmup() -> None:
    s = session(warmup_iterations=2, rank_section_timeouts={"step": 10.0, "warmup": None})
    s.open_section("step", T0)
    assert deadlines(s) == []
    assert check(s, T0 + 1e6) is None
    s.close_section("step", T0 + 1e6)
    s.open_section("step", T0 + 1e6)
    assert deadlines(s) == []
    s.close_section("step", T0 + 2e6)
    s.open_section("step", T0 + 2e6)  # third step: warm-up over
    assert fires_at(s, T0 + 2e6 + 10.0).section == "step"


def test_no_warmup_entry_means_step_timeout_from_the_start() -> None:
    s = session(warmup_iterations=5, rank_section_timeouts={"step": 10.0})
    s.open_section("step", T0)
    assert s.open_sections["step"].warmup is False
    assert fires_at(s, T0 + 10.0).timeout == 10.0


def test_warmup_applies_only_to_step() -> None:
    s = session(warmup_iterations=5, rank_section_timeouts={"ckpt": 10.0, "warmup": 100.0})
    s.open_section("ckpt", T0)
    assert fires_at(s, T0 + 10.0).section == "ckpt"
    assert s.steps_started == 0


# ---------------------------------------------------------------------------
# Timeouts changed mid-session


def test_set_timeouts_applies_to_heartbeat_and_out_of_section_now() -> None:
    s = session(rank_heartbeat_timeout=100.0, rank_out_of_section_timeout=100.0)
    s.heartbeat(T0 + 10.0)
    s.set_timeouts(Timeouts(rank_heartbeat_timeout=5.0, rank_out_of_section_timeout=None), T0 + 10.0)
    assert reasons(s) == {(Reason.HEARTBEAT, None)}
    assert fires_at(s, T0 + 15.0).timeout == 5.0


def test_a_tighter_timeout_counts_from_when_it_was_set_not_retroactively() -> None:
    s = session(rank_heartbeat_timeout=100.0, rank_out_of_section_timeout=100.0)
    s.open_section("data", T0 + 0.5)
    s.close_section("data", T0 + 1.0)
    s.heartbeat(T0 + 1.0)
    s.set_timeouts(Timeouts(rank_heartbeat_timeout=5.0, rank_out_of_section_timeout=2.0), T0 + 50.0)
    assert check(s, T0 + 51.9) is None  # 50 s since the heartbeat, but the 2 s timeout began at T0+50
    hang = fires_at(s, T0 + 52.0)
    assert hang.reason is Reason.OUT_OF_SECTION and hang.onset == T0 + 50.0
    s.heartbeat(T0 + 51.0)
    s.open_section("step", T0 + 51.5)
    assert fires_at(s, T0 + 56.0).reason is Reason.HEARTBEAT


def test_set_timeouts_open_sections_keep_their_timeout() -> None:
    s = session(rank_section_timeouts={"step": 10.0})
    s.open_section("step", T0)
    s.open_section("ckpt", T0)  # no timeout yet
    s.set_timeouts(Timeouts(rank_section_timeouts={"step": 50.0, "ckpt": 20.0}), T0 + 1.0)
    assert s.open_sections["step"].timeout == 10.0
    assert s.open_sections["ckpt"].timeout == 20.0  # one without a timeout picks up the new one
    assert s.open_sections["ckpt"].counted_from == T0 + 1.0  # ... counted from when it was set
    assert fires_at(s, T0 + 10.0).section == "step"
    s.close_section("step", T0 + 5.0)
    s.open_section("step", T0 + 5.0)
    assert s.open_sections["step"].timeout == 50.0


def test_set_timeouts_does_not_arm_a_warmup_step_with_timeout_off() -> None:
    s = session(warmup_iterations=3, rank_section_timeouts={"step": None, "warmup": None})
    s.open_section("step", T0)
    s.set_timeouts(Timeouts(rank_section_timeouts={"step": 10.0, "warmup": None}), T0)
    assert s.open_sections["step"].timeout is None
    assert deadlines(s) == []


def test_set_timeouts_turns_everything_off() -> None:
    s = session(initial_rank_heartbeat_timeout=1.0, rank_out_of_section_timeout=1.0)
    s.set_timeouts(Timeouts(), T0)
    assert check(s, T0 + 1e6) is None


# ---------------------------------------------------------------------------
# Phases


def test_hung_session_is_no_longer_checked_and_ignores_progress() -> None:
    s = session(rank_heartbeat_timeout=5.0, rank_section_timeouts={"step": 10.0})
    s.heartbeat(T0)
    s.open_section("step", T0)
    assert fires_at(s, T0 + 5.0).reason is Reason.HEARTBEAT
    s.mark_hung()
    assert s.phase is Phase.HUNG
    assert deadlines(s) == [] and next_deadline(s) is None and check(s, T0 + 1e6) is None
    s.heartbeat(T0 + 6.0)
    s.open_section("step", T0 + 6.0)  # no SessionError: ignored
    s.close_section("nope", T0 + 6.0)
    s.close_all_sections(T0 + 6.0)
    assert s.last_heartbeat == T0
    assert list(s.open_sections) == ["step"]
    assert s.events == 6
    s.goodbye()
    assert s.phase is Phase.HUNG
    s.end()
    assert s.phase is Phase.ENDED


def test_closing_session_is_no_longer_checked() -> None:
    s = session(rank_out_of_section_timeout=5.0)
    s.goodbye()
    assert s.phase is Phase.CLOSING
    assert check(s, T0 + 1e6) is None
    s.end()
    assert s.phase is Phase.ENDED
    assert deadlines(s) == []


def test_iteration_is_reported() -> None:
    s = session(rank_out_of_section_timeout=5.0)
    s.open_section("data", T0)
    s.close_section("data", T0)
    assert check(s, T0 + 5.0).iteration is None  # type: ignore[union-attr]
    s.set_iteration(17)
    assert check(s, T0 + 5.0).iteration == 17  # type: ignore[union-attr]


# ---------------------------------------------------------------------------
# Which deadline, and when


def test_next_deadline_is_the_earliest() -> None:
    s = session(rank_heartbeat_timeout=20.0, rank_section_timeouts={"step": 30.0, "fwd": 12.0})
    s.heartbeat(T0)
    s.open_section("step", T0 + 1.0)
    s.open_section("fwd", T0 + 2.0)
    assert [d.at for d in sorted(deadlines(s), key=lambda d: d.at)] == [T0 + 14.0, T0 + 20.0, T0 + 31.0]
    assert next_deadline(s) == Deadline(T0 + 14.0, Reason.SECTION, T0 + 2.0, 12.0, "fwd")
    s.close_section("fwd", T0 + 3.0)
    assert next_deadline(s) == Deadline(T0 + 20.0, Reason.HEARTBEAT, T0, 20.0)


def test_check_is_none_before_and_the_hang_exactly_at_the_deadline() -> None:
    s = session(rank_section_timeouts={"step": 10.0})
    s.open_section("step", T0)
    assert check(s, T0) is None
    assert check(s, T0 + 9.999999) is None
    hang = check(s, T0 + 10.0)
    assert hang == Hang(rank=3, pid=4242, reason=Reason.SECTION, section="step", onset=T0, detected_at=T0 + 10.0,
                        timeout=10.0, last_heartbeat=None, open_sections=(("step", 10.0),), iteration=None)
    late = check(s, T0 + 12.3)
    assert late is not None and late.elapsed == pytest.approx(12.3)


@pytest.mark.parametrize(
    ("reason", "section", "elapsed", "timeout", "text"),
    [
        (Reason.SECTION, "step", 12.3, 10.0, "section 'step' open for 12.3 s, timeout 10.0 s"),
        (Reason.OUT_OF_SECTION, None, 31.04, 30.0, "no section open for 31.0 s, out-of-section timeout 30.0 s"),
        (Reason.INITIAL_HEARTBEAT, None, 60.0, 60.0,
         "no first heartbeat 60.0 s after connecting, initial heartbeat timeout 60.0 s"),
        (Reason.HEARTBEAT, None, 5.06, 5.0, "no heartbeat for 5.1 s, heartbeat timeout 5.0 s"),
        (Reason.STARTUP, None, 30.0, 30.0, "no heartbeat or step 30.0 s after it started, startup timeout 30.0 s"),
    ],
)
def test_hang_describe(reason: Reason, section: str | None, elapsed: float, timeout: float, text: str) -> None:
    hang = Hang(rank=0, pid=1, reason=reason, section=section, onset=T0, detected_at=T0 + elapsed, timeout=timeout,
                last_heartbeat=None, open_sections=(), iteration=None)
    assert hang.describe() == text


# ---------------------------------------------------------------------------
# Start-up (startup_timeout)


def test_startup_of_a_worker_not_connected_fires_at_its_deadline() -> None:
    w = Spawned(rank=2, pid=77, since=T0, timeout=8.0, error_file=None)
    assert startup.deadline(w) == Deadline(T0 + 8.0, Reason.STARTUP, T0, 8.0)
    assert startup.check(w, T0 + 8.0 - 1e-6) is None
    hang = startup.check(w, T0 + 8.0)
    assert hang == Hang(rank=2, pid=77, reason=Reason.STARTUP, section=None, onset=T0, detected_at=T0 + 8.0,
                        timeout=8.0, last_heartbeat=None, open_sections=(), iteration=None, connected=False)
    assert hang.describe() == "not connected to its monitor 8.0 s after it started, startup timeout 8.0 s"


def test_startup_until_first_step_is_timed_in_the_session_from_the_workers_start() -> None:
    s = session(started_at=T0 + 3.0, initial_rank_heartbeat_timeout=60.0)
    s.startup_since, s.startup_timeout = T0, 8.0  # announced at T0, connected at T0 + 3
    assert next_deadline(s) == Deadline(T0 + 8.0, Reason.STARTUP, T0, 8.0)
    hang = fires_at(s, T0 + 8.0)
    assert hang.reason is Reason.STARTUP and hang.connected and hang.elapsed == 8.0


@pytest.mark.parametrize(("progress", "ends"), [("heartbeat", True), ("step", True), ("setup", False)])
def test_startup_ends_at_the_first_heartbeat_or_step(progress: str, ends: bool) -> None:
    s = session(started_at=T0 + 1.0, rank_section_timeouts={"step": None, "setup": None})
    s.startup_since, s.startup_timeout = T0, 8.0
    if progress == "heartbeat":
        s.heartbeat(T0 + 7.0)
    else:
        s.open_section(progress, T0 + 7.0)  # a setup section is still start-up
    assert (check(s, T0 + 1e6) is None) == ends


def test_describe_from_a_real_session() -> None:
    s = session(rank_section_timeouts={"step": 10.0})
    s.open_section("step", T0)
    assert check(s, T0 + 12.3).describe() == "section 'step' open for 12.3 s, timeout 10.0 s"  # type: ignore[union-attr]


def test_fresh_session_after_restart_carries_the_timeouts_given_to_it() -> None:
    learned = Timeouts(rank_heartbeat_timeout=7.5, rank_section_timeouts={"step": 42.0},
                       learned=frozenset({"rank_heartbeat_timeout", "section:step"}))
    old = Session(rank=0, pid=100, started_at=T0, timeouts=Timeouts(rank_heartbeat_timeout=99.0))
    old.heartbeat(T0 + 1.0)
    old.open_section("step", T0 + 1.0)
    old.mark_hung()
    old.end()
    new = Session(rank=0, pid=200, started_at=T0 + 500.0, timeouts=learned, num_warmup_iterations=0)
    assert new.phase is Phase.ACTIVE
    assert new.timeouts is learned
    assert (new.last_heartbeat, new.heartbeats, new.open_sections, new.steps_started) == (None, 0, {}, 0)
    assert new.out_of_section_since is None  # judged from the end of its first section
    new.heartbeat(T0 + 501.0)
    new.open_section("step", T0 + 501.0)
    assert fires_at(new, T0 + 508.5).reason is Reason.HEARTBEAT
    for t in range(502, 544, 5):  # keep heartbeating: the learned step timeout fires
        new.heartbeat(T0 + t)
    assert fires_at(new, T0 + 543.0).section == "step"


# ---------------------------------------------------------------------------
# Property: check() agrees with deadlines()

SECTIONS = ("step", "fwd", "ckpt", "plain")

events = st.lists(
    st.tuples(
        st.sampled_from(["open", "close", "heartbeat", "close_all", "set_timeouts"]),
        st.sampled_from(SECTIONS),
        st.floats(0.0, 20.0, allow_nan=False),
    ),
    max_size=30,
)
timeouts_st = st.one_of(st.none(), st.floats(0.5, 50.0, allow_nan=False))
all_timeouts = st.builds(
    lambda i, h, o, step, fwd, ckpt, warm: Timeouts(
        initial_rank_heartbeat_timeout=i, rank_heartbeat_timeout=h, rank_out_of_section_timeout=o,
        rank_section_timeouts={k: v for k, v in (("step", step), ("fwd", fwd), ("ckpt", ckpt), ("warmup", warm))
                               if v != -1.0},
    ),
    timeouts_st, timeouts_st, timeouts_st, timeouts_st, timeouts_st, timeouts_st,
    st.one_of(st.just(-1.0), timeouts_st),
)


@given(all_timeouts, all_timeouts, st.integers(0, 3), events, st.floats(0.0, 200.0, allow_nan=False))
@settings(max_examples=300, deadline=None)
def test_check_agrees_with_deadlines(
    t1: Timeouts, t2: Timeouts, warmup: int, evs: list[tuple[str, str, float]], probe: float
) -> None:
    s = Session(rank=0, pid=1, started_at=0.0, timeouts=t1, num_warmup_iterations=warmup)
    now = 0.0
    opened = "warmup" in t1.rank_section_timeouts  # judged from the handshake: as if a section had closed there
    for kind, name, dt in evs:
        now += dt
        opened = opened or (kind == "open" and name not in s.open_sections)
        if kind == "open":
            if name in s.open_sections:
                with pytest.raises(SessionError):
                    s.open_section(name, now)
            else:
                s.open_section(name, now)
        elif kind == "close":
            if name in s.open_sections:
                s.close_section(name, now)
            else:
                with pytest.raises(SessionError):
                    s.close_section(name, now)
        elif kind == "heartbeat":
            s.heartbeat(now)
        elif kind == "close_all":
            s.close_all_sections(now)
        else:
            opened = opened or (t2 != s.timeouts and "warmup" in t2.rank_section_timeouts and not s.open_sections)
            s.set_timeouts(t2, now)
        # the out-of-section clock runs exactly while no section is open, once a first one was
        # (or from the start, with a warmup timeout)
        assert (s.out_of_section_since is None) == (bool(s.open_sections) or not opened)
    at = now + probe
    ds = deadlines(s)
    hang = check(s, at)
    passed = [d for d in ds if d.at <= at]
    assert (hang is not None) == bool(passed)
    nd = next_deadline(s)
    assert (nd is None) == (not ds)
    if nd is not None:
        assert nd.at == min(d.at for d in ds)
    if hang is not None:
        assert nd is not None
        assert (hang.reason, hang.section, hang.timeout, hang.onset) == (nd.reason, nd.section, nd.timeout, nd.since)
        assert hang.onset + hang.timeout == min(d.at for d in passed)
        assert hang.detected_at == at
        assert {name for name, _ in hang.open_sections} == set(s.open_sections)
    for d in ds:
        assert d.at == d.since + d.timeout
        assert d.timeout > 0
        if d.reason is Reason.SECTION:
            assert d.section in s.open_sections


def test_a_learned_value_that_switches_on_an_unconfigured_timeout_is_named() -> None:
    from ft_monitor.daemon.handlers import switched_on

    off, learned = Timeouts(), Timeouts(rank_out_of_section_timeout=5.0, initial_rank_heartbeat_timeout=9.0)
    assert switched_on(off, off, learned) == ["initial_rank_heartbeat_timeout", "rank_out_of_section_timeout"]
    assert switched_on(off, learned, learned) == []  # said once, when it is switched on
    assert switched_on(Timeouts(rank_out_of_section_timeout=60.0), off, learned) == ["initial_rank_heartbeat_timeout"]
