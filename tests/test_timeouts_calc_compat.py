"""ft_client.TimeoutsCalc, nvidia-resiliency-ext's calculator API: the reference's own
worked examples with their numbers, then where we differ on purpose. Times are plain
floats passed in (the calculator's clock is never read here, except where injected)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ft_client import (
    FtError,
    HeartbeatTimeouts,
    NotEnoughDataError,
    SectionAction,
    SectionTimeouts,
    TimeoutsCalc,
    TimeoutsCalcError,
    TimeoutsCalcNotReadyError,
)

OPEN, CLOSE, CLOSE_ALL = SectionAction.OPEN, SectionAction.CLOSE, SectionAction.CLOSE_ALL
ROOT = Path(__file__).resolve().parent.parent


def events(tc: TimeoutsCalc, *items: tuple[str | None, SectionAction, float]) -> None:
    for section, action, t in items:
        tc.update_on_section_event(section, action, event_time=t)


# -- the reference's examples ------------------------------------------------------------
def test_heartbeat_timeouts_and_their_ema_merge_with_current() -> None:
    tc = TimeoutsCalc(start_time=0, safety_factor=2.0)
    assert tc.can_get_hb_timeouts() is False
    with pytest.raises(TimeoutsCalcError):
        tc.get_hb_timeouts()
    tc.update_on_heartbeat(hb_time=10)
    tc.update_on_heartbeat(hb_time=11)
    assert tc.can_get_hb_timeouts()
    tc.update_on_heartbeat(hb_time=18)
    tc.update_on_heartbeat(hb_time=20)
    # first heartbeat 10 s after start, longest gap 7 s; x2
    assert dataclasses.astuple(tc.get_hb_timeouts()) == (20, 14, True)
    # configured (not calculated) current values are replaced
    assert dataclasses.astuple(tc.get_hb_timeouts(current=HeartbeatTimeouts(99, 99, were_calculated=False))) \
        == (20, 14, True)
    # calculated current values are averaged with the new ones (EMA, alpha 0.5)
    assert dataclasses.astuple(tc.get_hb_timeouts(current=HeartbeatTimeouts(21, 15, were_calculated=True))) \
        == (20.5, 14.5, True)
    unset = HeartbeatTimeouts(None, None, were_calculated=False)
    assert unset.are_valid is False
    assert dataclasses.astuple(tc.get_hb_timeouts(current=unset)) == (20, 14, True)
    # "calculated" but without values: refused
    with pytest.raises(TimeoutsCalcError, match=r"says were_calculated but a timeout is None"):
        tc.get_hb_timeouts(current=HeartbeatTimeouts(None, None, were_calculated=True))


def test_sections_nested_with_out_of_section_time_and_the_bump() -> None:
    tc = TimeoutsCalc(sections=["one", "two"], start_time=5, safety_factor=1.0)
    assert tc.can_get_section_timeouts() is False
    with pytest.raises(TimeoutsCalcError):
        tc.get_section_timeouts()
    with pytest.raises(TimeoutsCalcError, match=r"^unknown section 'unknown_section': this calculator tracks \['one', 'two'\]"):
        tc.update_on_section_event(section="unknown_section", action=OPEN, event_time=1)
    # start at 5 (out of section) -> one at 10 -> two at 13 .. 23 -> one closed at 40
    events(tc, ("one", OPEN, 10), ("two", OPEN, 13))
    for name in ("one", "two"):
        with pytest.raises(TimeoutsCalcError, match=rf"^section '{name}' is already open"):
            tc.update_on_section_event(section=name, action=OPEN, event_time=14)
    events(tc, ("two", CLOSE, 23), ("one", CLOSE, 40))
    for name in ("one", "two"):
        with pytest.raises(TimeoutsCalcError, match=rf"^section '{name}' is not open"):
            tc.update_on_section_event(section=name, action=CLOSE, event_time=111)
    assert tc.can_get_section_timeouts() is True
    computed = tc.get_section_timeouts()
    assert computed.section == {"one": 30, "two": 10}
    assert computed.out_of_section == 5  # 5 -> 10; the stretch running since 40 is not recorded yet
    assert computed.calculated_sections == {"one", "two"}
    assert computed.is_out_of_section_calculated is True
    assert computed.were_calculated is True
    # opening a section records the stretch that ends there: 40 -> 100
    events(tc, ("one", OPEN, 100), ("one", CLOSE, 120))
    computed = tc.get_section_timeouts()
    assert (computed.section, computed.out_of_section) == ({"one": 30, "two": 10}, 60)
    # the bump records the stretch still running: 120 -> 220
    tc.maybe_bump_oos_time(curr_time=220)
    computed = tc.get_section_timeouts()
    assert (computed.section, computed.out_of_section, computed.were_calculated) == ({"one": 30, "two": 10}, 100, True)


def test_a_subset_of_sections() -> None:
    tc = TimeoutsCalc(sections=["one", "two"], start_time=1, safety_factor=1.0)
    for selected in (None, ["one"], ["two"]):
        for oos in (True, False):
            assert tc.can_get_section_timeouts(selected_sections=selected, calc_out_of_section=oos) is False
    events(tc, ("one", OPEN, 10), ("one", CLOSE, 20))
    assert tc.can_get_section_timeouts() is False
    assert tc.can_get_section_timeouts(selected_sections=["one"], calc_out_of_section=True) is True
    assert tc.can_get_section_timeouts(selected_sections=["one"], calc_out_of_section=False) is True
    assert tc.can_get_section_timeouts(selected_sections=["two"], calc_out_of_section=True) is False
    assert tc.can_get_section_timeouts(selected_sections=["two"], calc_out_of_section=False) is False
    events(tc, ("two", OPEN, 25), ("two", CLOSE, 36))
    for selected in (None, ["one"], ["two"]):
        for oos in (True, False):
            assert tc.can_get_section_timeouts(selected_sections=selected, calc_out_of_section=oos) is True

    def shape(st: SectionTimeouts) -> tuple[object, ...]:
        return st.section, st.out_of_section, st.calculated_sections, st.is_out_of_section_calculated, st.were_calculated

    assert shape(tc.get_section_timeouts()) == ({"one": 10, "two": 11}, 9, {"one", "two"}, True, True)
    assert shape(tc.get_section_timeouts(selected_sections=["one"])) == ({"one": 10, "two": None}, 9, {"one"}, True, False)
    assert shape(tc.get_section_timeouts(selected_sections=["two"])) == ({"one": None, "two": 11}, 9, {"two"}, True, False)
    assert shape(tc.get_section_timeouts(selected_sections=None, calc_out_of_section=False)) \
        == ({"one": 10, "two": 11}, None, {"one", "two"}, False, False)
    assert shape(tc.get_section_timeouts(selected_sections=[], calc_out_of_section=False)) \
        == ({"one": None, "two": None}, None, set(), False, False)


def test_section_timeouts_merged_with_current() -> None:
    tc = TimeoutsCalc(sections=["one", "two"], start_time=1, safety_factor=1.0)
    events(tc, ("one", OPEN, 10), ("one", CLOSE, 111))
    computed = tc.get_section_timeouts(selected_sections=["one"], calc_out_of_section=True)
    assert (computed.section, computed.out_of_section, computed.calculated_sections) == ({"one": 101, "two": None}, 9, {"one"})

    # 1: nothing in current was calculated: new values replace, the rest is kept
    current = SectionTimeouts(section={"one": 102, "two": 222}, out_of_section=123, calculated_sections={},
                              is_out_of_section_calculated=False)
    assert (current.are_valid, current.were_calculated) == (True, False)
    computed = tc.get_section_timeouts(selected_sections=["one"], calc_out_of_section=True, current=current)
    assert (computed.section, computed.out_of_section) == ({"one": 101, "two": 222}, 9)
    assert (computed.calculated_sections, computed.is_out_of_section_calculated, computed.were_calculated) \
        == ({"one"}, True, False)

    # 2: "two" and out-of-section were calculated: out-of-section is averaged, "one" replaced
    current = SectionTimeouts(section={"one": 102, "two": 222}, out_of_section=10, calculated_sections={"two"},
                              is_out_of_section_calculated=True)
    computed = tc.get_section_timeouts(selected_sections=["one"], calc_out_of_section=True, current=current)
    assert (computed.section, computed.out_of_section) == ({"one": 101, "two": 222}, 9.5)
    assert (computed.calculated_sections, computed.were_calculated) == ({"one", "two"}, True)

    # 3: everything was calculated: "one" is averaged too
    current = SectionTimeouts(section={"one": 102, "two": 223}, out_of_section=10, calculated_sections={"one", "two"},
                              is_out_of_section_calculated=True)
    assert current.were_calculated is True
    computed = tc.get_section_timeouts(selected_sections=["one"], calc_out_of_section=True, current=current)
    assert (computed.section, computed.out_of_section, computed.were_calculated) == ({"one": 101.5, "two": 223}, 9.5, True)


def test_end_all_sections() -> None:
    tc = TimeoutsCalc(sections=["one", "two", "three"], start_time=0, safety_factor=1.0)
    events(tc, ("one", OPEN, 1), ("two", OPEN, 3), ("three", OPEN, 6), (None, CLOSE_ALL, 10))
    computed = tc.get_section_timeouts()
    assert (computed.section, computed.out_of_section, computed.were_calculated) \
        == ({"one": 9, "two": 7, "three": 4}, 1, True)
    events(tc, ("one", OPEN, 12), ("two", OPEN, 21), ("three", OPEN, 23), (None, CLOSE_ALL, 30))
    computed = tc.get_section_timeouts()
    assert (computed.section, computed.out_of_section) == ({"one": 18, "two": 9, "three": 7}, 2)


# -- the recorded values, read-only --------------------------------------------------------
def test_recorded_maxima_read_as_the_reference_names_them() -> None:
    tc = TimeoutsCalc(sections=["one", "two"], start_time=2, safety_factor=3.0)
    assert (tc.initial_max_time, tc.subsequent_max_time, tc.out_of_section_max_time) == (-1, -1, -1)
    assert tc.section_to_max_time == {"one": -1, "two": -1}
    tc.update_on_heartbeat(hb_time=5)
    events(tc, ("one", OPEN, 6))
    assert tc.open_sections == {"one": 6} and tc.is_out_of_section is False
    events(tc, ("one", CLOSE, 8))
    assert (tc.start_time, tc.safety_factor, tc.initial_max_time, tc.out_of_section_max_time) == (2, 3.0, 3, 4)
    assert tc.section_to_max_time == {"one": 2, "two": -1}
    with pytest.raises(AttributeError):
        tc.start_time = 0  # type: ignore[misc]


# -- where we differ, on purpose -----------------------------------------------------------
def test_an_empty_selection_selects_nothing_in_every_call() -> None:
    tc = TimeoutsCalc(sections=["one"], start_time=0)
    events(tc, ("one", OPEN, 1))
    # the reference's readiness check reads [] as "all sections" (and says not ready here)
    assert tc.can_get_section_timeouts(selected_sections=[], calc_out_of_section=True) is True
    assert tc.get_section_timeouts(selected_sections=[], calc_out_of_section=True).section == {"one": None}


def test_not_ready_is_both_errors_and_says_what_is_missing() -> None:
    tc = TimeoutsCalc(sections=["ckpt"], start_time=0)
    tc.update_on_heartbeat(hb_time=1)
    with pytest.raises(TimeoutsCalcNotReadyError, match=r"^not enough data to return the timeouts: cannot learn the heartbeat timeout: fewer than two heartbeats") as info:
        tc.get_hb_timeouts()
    assert isinstance(info.value, NotEnoughDataError) and isinstance(info.value, FtError)
    with pytest.raises(TimeoutsCalcError, match=r"no 'ckpt' section has been completed yet"):
        tc.get_section_timeouts()


def test_bad_arguments_are_refused_with_the_rule() -> None:
    with pytest.raises(TimeoutsCalcError, match=r"^safety_factor = 0.5: must be a number >= 1\.0"):
        TimeoutsCalc(safety_factor=0.5)
    with pytest.raises(TimeoutsCalcError, match=r"^sections = 'step': must be a collection"):
        TimeoutsCalc(sections="step")
    tc = TimeoutsCalc(sections=["one"], start_time=0)
    with pytest.raises(TimeoutsCalcError, match=r"^action = 'open': must be SectionAction"):
        tc.update_on_section_event("one", "open", event_time=1)  # type: ignore[arg-type]
    with pytest.raises(TimeoutsCalcError, match=r"selected_sections contains 'three': only sections listed"):
        tc.can_get_section_timeouts(selected_sections=["three"])
    with pytest.raises(TimeoutsCalcError, match=r"^selected_sections = 'one': must be a collection"):
        tc.get_section_timeouts(selected_sections="one")


def test_warmup_is_recorded_but_never_learned() -> None:
    tc = TimeoutsCalc(sections=["step", "warmup"], start_time=0, safety_factor=1.0)
    events(tc, ("warmup", OPEN, 1), ("warmup", CLOSE, 3), ("step", OPEN, 3), ("step", CLOSE, 4))
    assert tc.section_to_max_time == {"step": 1, "warmup": 2}
    assert tc.get_section_timeouts().section == {"step": 1, "warmup": None}
    with pytest.raises(TimeoutsCalcError, match=r"selected_sections contains 'warmup'"):
        tc.get_section_timeouts(selected_sections=["warmup"])


def test_times_left_out_come_from_the_clock() -> None:
    now = [100.0]
    tc = TimeoutsCalc(sections=["s"], safety_factor=1.0, clock=lambda: now[0])
    assert tc.start_time == 100.0
    now[0] = 130.0
    tc.reset_start_time()  # the initial heartbeat is timed from here
    now[0] = 131.5
    tc.update_on_heartbeat()
    tc.update_on_section_event("s", OPEN)
    now[0] = 134.0
    tc.update_on_heartbeat()
    tc.update_on_section_event("s", CLOSE)
    now[0] = 140.0
    tc.maybe_bump_oos_time()
    assert (tc.initial_max_time, tc.subsequent_max_time, tc.section_to_max_time["s"]) == (1.5, 2.5, 2.5)
    assert tc.out_of_section_max_time == 31.5  # from the start (100), not from the reset: as the reference


def test_reset_start_time_after_the_first_heartbeat_changes_nothing() -> None:
    now = [0.0]
    tc = TimeoutsCalc(clock=lambda: now[0])
    now[0] = 4.0
    tc.update_on_heartbeat()
    now[0] = 10.0
    tc.reset_start_time()
    tc.update_on_heartbeat()
    assert (tc.initial_max_time, tc.subsequent_max_time) == (4.0, 6.0)


def test_synchronize_all_needs_a_process_group() -> None:
    with pytest.raises(TimeoutsCalcError, match=r"^synchronize_all\(\) needs an initialized torch.distributed process group"):
        TimeoutsCalc().synchronize_all()


def test_synchronize_all_without_torch_imported_does_not_import_it() -> None:
    code = ("import sys; from ft_client import TimeoutsCalc, TimeoutsCalcError\n"
            "try:\n    TimeoutsCalc().synchronize_all()\nexcept TimeoutsCalcError:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
