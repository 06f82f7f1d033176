"""TimeoutsRecorder observations and learned-timeout math, driven by a fake clock (plain floats)."""

from __future__ import annotations

import pytest

from ft_client.learning.calc import (
    MISSING,
    NotEnoughDataError,
    Observations,
    TimeoutsRecorder,
    hb_not_ready,
    learn_hb_timeouts,
    learn_section_timeouts,
    sections_not_ready,
)
from ft_client.timeouts import (
    LEARNED_HB,
    LEARNED_INITIAL_HB,
    LEARNED_OUT_OF_SECTION,
    Timeouts,
    learned_section_key,
)

CONFIG = Timeouts(
    initial_rank_heartbeat_timeout=600.0,
    rank_heartbeat_timeout=60.0,
    rank_section_timeouts={"step": 30.0, "ckpt": None, "warmup": 300.0},
    rank_out_of_section_timeout=120.0,
)


def calc(*sections: str, start: float | None = 0.0) -> TimeoutsRecorder:
    c = TimeoutsRecorder(sections or ("ckpt", "step"))
    if start is not None:
        c.start(start)
    return c


# -- observations ------------------------------------------------------------------
def test_initial_heartbeat_is_start_to_first_heartbeat() -> None:
    c = calc(start=10.0)
    c.on_heartbeat(13.5)
    obs = c.observations(20.0)
    assert obs.initial_hb == 3.5
    assert obs.hb_gap is None


def test_heartbeat_gap_is_largest_between_consecutive_heartbeats() -> None:
    c = calc()
    for t in (1.0, 2.0, 5.0, 5.5, 7.0):
        c.on_heartbeat(t)
    obs = c.observations(7.0)
    assert obs.initial_hb == 1.0
    assert obs.hb_gap == 3.0


def test_heartbeat_before_start_is_not_an_initial_observation() -> None:
    c = calc(start=None)
    c.on_heartbeat(1.0)
    c.on_heartbeat(3.0)
    assert c.observations(3.0).initial_hb is None
    assert c.observations(3.0).hb_gap == 2.0


def test_start_again_makes_the_next_heartbeat_initial_and_keeps_maxima() -> None:
    c = calc()
    c.on_heartbeat(2.0)
    c.on_heartbeat(6.0)
    c.start(100.0)
    c.on_heartbeat(101.0)  # initial again, not a 95 s gap
    obs = c.observations(101.0)
    assert (obs.initial_hb, obs.hb_gap) == (2.0, 4.0)


def test_section_longest_run_per_name() -> None:
    c = calc()
    c.on_section_open("step", 1.0)
    c.on_section_close("step", 2.0)
    c.on_section_open("step", 3.0)
    c.on_section_close("step", 6.0)
    c.on_section_open("step", 7.0)
    c.on_section_close("step", 8.0)
    assert c.observations(8.0).sections == {"ckpt": None, "step": 3.0}


def test_nested_sections_and_out_of_section_only_while_none_open() -> None:
    c = calc()  # started at 0
    c.on_section_open("step", 2.0)  # out-of-section 0..2
    c.on_section_open("ckpt", 3.0)
    c.on_section_close("ckpt", 7.0)  # ckpt 4, step still open: no out-of-section stretch
    c.on_section_close("step", 8.0)  # step 6
    c.on_section_open("step", 9.0)  # out-of-section 8..9
    obs = c.observations(9.0)
    assert obs.sections == {"ckpt": 4.0, "step": 6.0}
    assert obs.out_of_section == 2.0


def test_overlapping_sections() -> None:
    c = calc()
    c.on_section_open("step", 1.0)
    c.on_section_open("ckpt", 2.0)
    c.on_section_close("step", 4.0)  # step 3; ckpt still open
    c.on_section_close("ckpt", 9.0)  # ckpt 7; stretch starts at 9
    c.on_section_open("step", 10.0)
    obs = c.observations(10.0)
    assert obs.sections == {"ckpt": 7.0, "step": 3.0}
    assert obs.out_of_section == 1.0  # 0..1 and 9..10; never 4..9


def test_trailing_out_of_section_stretch_counts_at_calculation_time() -> None:
    c = calc()
    c.on_section_open("step", 1.0)
    c.on_section_close("step", 2.0)
    assert c.observations(2.5).out_of_section == 1.0
    assert c.observations(12.0).out_of_section == 10.0
    c.on_section_open("step", 4.0)
    assert c.observations(50.0).out_of_section == 2.0  # a section is open: no trailing stretch


def test_untracked_section_is_ignored_and_does_not_pause_out_of_section() -> None:
    c = calc("step")
    c.on_section_open("eval", 1.0)
    c.on_section_close("eval", 5.0)
    obs = c.observations(6.0)
    assert obs.sections == {"step": None}
    assert obs.out_of_section == 6.0


def test_misuse_on_the_hot_path_is_ignored() -> None:
    c = calc()
    c.on_section_close("step", 1.0)  # never opened
    c.on_section_open("step", 2.0)
    c.on_section_open("step", 3.0)  # already open: first start kept
    c.on_section_close("step", 5.0)
    assert c.observations(5.0).sections["step"] == 3.0


def test_close_all_closes_every_open_section() -> None:
    c = calc()
    c.on_section_open("step", 1.0)
    c.on_section_open("ckpt", 2.0)
    c.on_close_all(6.0)
    obs = c.observations(8.0)
    assert obs.sections == {"ckpt": 4.0, "step": 5.0}
    assert obs.out_of_section == 2.0  # 0..1 and the trailing 6..8
    c.on_close_all(9.0)  # nothing open: no-op
    assert c.observations(9.0).sections == {"ckpt": 4.0, "step": 5.0}


def test_recorded_only_leaves_the_running_stretch_out_until_it_is_recorded() -> None:
    c = calc("step", start=0.0)
    c.on_section_open("step", 2.0)
    c.on_section_close("step", 3.0)
    assert c.observations(None).out_of_section == 2.0  # 0 -> 2; the stretch since 3 is still running
    assert c.observations(10.0).out_of_section == 7.0
    c.record_out_of_section(8.0)
    assert c.observations(None).out_of_section == 5.0
    c.record_out_of_section(4.0)  # maxima only grow
    assert c.observations(None).out_of_section == 5.0
    c.on_section_open("step", 12.0)  # the stretch was still running: it ends here
    assert c.observations(None).out_of_section == 9.0
    c.record_out_of_section(20.0)  # a section is open: nothing to record
    assert c.observations(None).out_of_section == 9.0
    assert c.export_vector(None) == [-1.0, -1.0, 9.0, 1.0]


def test_set_start_moves_only_the_initial_heartbeat_origin() -> None:
    c = calc("step", start=0.0)
    c.on_section_open("step", 1.0)
    c.set_start(5.0)
    assert (c.start_time, c.open_sections) == (5.0, {"step": 1.0})
    c.on_heartbeat(7.0)
    c.on_section_close("step", 8.0)
    obs = c.observations(None)
    assert (obs.initial_hb, obs.sections["step"], obs.out_of_section) == (2.0, 7.0, 1.0)


def test_calc_uses_slots() -> None:
    c = calc()
    with pytest.raises(AttributeError):
        c.extra = 1  # type: ignore[attr-defined]


def test_bad_safety_factor() -> None:
    for bad in (0, 0.5, float("nan"), True):
        with pytest.raises(ValueError, match=r"^safety_factor = .*: must be a number >= 1\.0 \(a factor below 1 makes timeouts shorter than observed\) and <= 100 \(a larger one learns nothing\)$"):
            TimeoutsRecorder((), safety_factor=bad)


# -- reduction vector --------------------------------------------------------------
def test_vector_layout_and_round_trip() -> None:
    c = calc("step", "ckpt")
    c.on_heartbeat(1.0)
    c.on_section_open("step", 2.0)
    c.on_section_close("step", 4.0)
    assert c.section_names == ("ckpt", "step")
    vec = c.export_vector(5.0)
    assert vec == [1.0, MISSING, 2.0, MISSING, 2.0]
    assert all(type(v) is float for v in vec)
    assert Observations.from_vector(vec, c.section_names) == c.observations(5.0)


def test_vector_max_keeps_any_real_value_and_detects_all_missing() -> None:
    a, b = calc(), calc()
    a.on_heartbeat(1.0)
    a.on_section_open("step", 1.0)
    a.on_section_close("step", 2.0)
    b.on_heartbeat(3.0)
    b.on_heartbeat(4.0)
    reduced = [max(x, y) for x, y in zip(a.export_vector(2.0), b.export_vector(4.0))]
    obs = a.import_vector(reduced)
    assert obs == Observations(initial_hb=3.0, hb_gap=1.0, out_of_section=4.0, sections={"ckpt": None, "step": 1.0})
    assert a.observations(2.0) == obs  # adopted as this rank's maxima
    assert obs.sections["ckpt"] is None  # missing on every rank
    a.on_heartbeat(10.0)  # adoption does not turn the next heartbeat into a gap
    assert a.observations(10.0).hb_gap == 9.0


def test_import_vector_wrong_length() -> None:
    with pytest.raises(
        ValueError,
        match=r"^observation vector has 2 values: expected 5 \(3 \+ one per section in \['ckpt', 'step'\]\)$",
    ):
        calc().import_vector([1.0, 2.0])


# -- heartbeat timeouts ------------------------------------------------------------
def observed(
    initial: float | None = None, gap: float | None = None, oos: float | None = None, **sections: float | None
) -> Observations:
    return Observations(initial_hb=initial, hb_gap=gap, out_of_section=oos, sections=sections)


def test_hb_timeouts_replace_config_values_with_safety_factor() -> None:
    new = learn_hb_timeouts(CONFIG, observed(initial=10.0, gap=2.0))
    assert new.initial_rank_heartbeat_timeout == 50.0
    assert new.rank_heartbeat_timeout == 10.0
    assert new.learned == {LEARNED_INITIAL_HB, LEARNED_HB}
    assert new.rank_section_timeouts == CONFIG.rank_section_timeouts  # untouched
    assert learn_hb_timeouts(CONFIG, observed(initial=10.0, gap=2.0), 3.0).rank_heartbeat_timeout == 6.0


def test_hb_timeouts_average_with_learned_values_over_three_runs() -> None:
    run1 = learn_hb_timeouts(CONFIG, observed(initial=10.0, gap=2.0))  # 50, 10
    run2 = learn_hb_timeouts(run1, observed(initial=30.0, gap=4.0))  # (50+150)/2, (10+20)/2
    run3 = learn_hb_timeouts(run2, observed(initial=2.0, gap=1.0))  # (100+10)/2, (15+5)/2
    assert (run2.initial_rank_heartbeat_timeout, run2.rank_heartbeat_timeout) == (100.0, 15.0)
    assert (run3.initial_rank_heartbeat_timeout, run3.rank_heartbeat_timeout) == (55.0, 10.0)
    assert run3.hb.were_calculated


def test_hb_not_enough_data() -> None:
    assert hb_not_ready(observed(initial=1.0, gap=1.0)) is None
    with pytest.raises(
        NotEnoughDataError,
        match=r"^cannot learn the initial heartbeat timeout: no heartbeat has been sent",
    ):
        learn_hb_timeouts(CONFIG, observed())
    with pytest.raises(NotEnoughDataError, match=r"^cannot learn the heartbeat timeout: fewer than two heartbeats"):
        learn_hb_timeouts(CONFIG, observed(initial=1.0))
    with pytest.raises(
        NotEnoughDataError,
        match=r"^cannot learn the heartbeat timeout: the longest observed interval is 0 s",
    ):
        learn_hb_timeouts(CONFIG, observed(initial=1.0, gap=0.0))
    assert isinstance(NotEnoughDataError("x"), ValueError)


def test_hb_skip_path_reports_not_ready() -> None:
    c = calc()
    c.on_heartbeat(1.0)
    reason = hb_not_ready(c.observations(1.0))
    assert reason is not None and reason.startswith("cannot learn the heartbeat timeout")


# -- section timeouts --------------------------------------------------------------
def test_section_timeouts_all_configured_but_warmup() -> None:
    new = learn_section_timeouts(CONFIG, observed(oos=3.0, step=2.0, ckpt=20.0))
    assert dict(new.rank_section_timeouts) == {"step": 10.0, "ckpt": 100.0, "warmup": 300.0}
    assert new.rank_out_of_section_timeout == 15.0
    assert new.learned == {learned_section_key("step"), learned_section_key("ckpt"), LEARNED_OUT_OF_SECTION}
    assert new.sections.calculated_sections == {"step", "ckpt"}
    assert new.sections.is_out_of_section_calculated
    assert new.initial_rank_heartbeat_timeout == 600.0  # heartbeat untouched


def test_section_timeouts_selected_and_no_out_of_section() -> None:
    new = learn_section_timeouts(
        CONFIG, observed(oos=3.0, step=2.0), selected_sections=["step"], calc_out_of_section=False
    )
    assert dict(new.rank_section_timeouts) == {"step": 10.0, "ckpt": None, "warmup": 300.0}
    assert new.rank_out_of_section_timeout == 120.0
    assert new.learned == {learned_section_key("step")}


def test_section_timeouts_only_out_of_section() -> None:
    new = learn_section_timeouts(CONFIG, observed(oos=3.0), selected_sections=[])
    assert new.rank_section_timeouts == CONFIG.rank_section_timeouts
    assert new.learned == {LEARNED_OUT_OF_SECTION}


def test_section_timeouts_average_learned_replace_configured() -> None:
    run1 = learn_section_timeouts(CONFIG, observed(oos=2.0, step=2.0), selected_sections=["step"])
    run2 = learn_section_timeouts(run1, observed(oos=6.0, step=6.0, ckpt=1.0))
    assert run2.rank_section_timeouts["step"] == 20.0  # (10 + 30) / 2
    assert run2.rank_section_timeouts["ckpt"] == 5.0  # configured None: replaced
    assert run2.rank_out_of_section_timeout == 20.0  # (10 + 30) / 2
    run3 = learn_section_timeouts(run2, observed(oos=2.0, step=2.0, ckpt=3.0))
    assert run3.rank_section_timeouts["step"] == 15.0
    assert run3.rank_section_timeouts["ckpt"] == 10.0
    assert run3.rank_out_of_section_timeout == 15.0


def test_section_not_enough_data_names_the_section() -> None:
    obs = observed(oos=1.0, step=1.0)
    with pytest.raises(
        NotEnoughDataError,
        match=r"^cannot learn the 'ckpt' section timeout: no 'ckpt' section has been completed yet$",
    ):
        learn_section_timeouts(CONFIG, obs)
    assert sections_not_ready(CONFIG, obs) == (
        "cannot learn the 'ckpt' section timeout: no 'ckpt' section has been completed yet"
    )
    assert sections_not_ready(CONFIG, obs, selected_sections=["step"]) is None


def test_out_of_section_not_enough_data() -> None:
    obs = observed(step=1.0, ckpt=1.0)
    with pytest.raises(NotEnoughDataError, match=r"^cannot learn the out-of-section timeout: no time outside"):
        learn_section_timeouts(CONFIG, obs)
    assert sections_not_ready(CONFIG, obs, calc_out_of_section=False) is None


def test_bad_selection_is_a_usage_error_not_missing_data() -> None:
    obs = observed(oos=1.0, step=1.0, ckpt=1.0)
    with pytest.raises(ValueError, match=r"^selected_sections contains 'warmup': it is not a section of its own"):
        sections_not_ready(CONFIG, obs, selected_sections=["warmup"])
    with pytest.raises(
        ValueError,
        match=r"^selected_sections contains 'eval': only sections listed in rank_section_timeouts",
    ):
        learn_section_timeouts(CONFIG, obs, selected_sections=["eval"])
    with pytest.raises(ValueError, match=r"^selected_sections = 'step': must be a collection of section names"):
        learn_section_timeouts(CONFIG, obs, selected_sections="step")


def test_end_to_end_with_fake_clock() -> None:
    c = TimeoutsRecorder(name for name in CONFIG.rank_section_timeouts if name != "warmup")
    c.start(0.0)
    now = 0.0
    for step in range(3):
        c.on_section_open("step", now + 0.5)
        c.on_section_close("step", now + 1.5 + step)
        c.on_heartbeat(now + 2.0 + step)
        now += 2.0 + step
    c.on_section_open("ckpt", now)
    c.on_section_close("ckpt", now + 4.0)
    obs = c.import_vector(c.export_vector(now + 4.5))
    new = learn_section_timeouts(CONFIG, obs, safety_factor=c.safety_factor)
    new = learn_hb_timeouts(new, obs, safety_factor=c.safety_factor)
    assert dict(new.rank_section_timeouts) == {"step": 15.0, "ckpt": 20.0, "warmup": 300.0}
    assert new.rank_out_of_section_timeout == 5.0  # 1 s between two steps
    assert new.initial_rank_heartbeat_timeout == 10.0
    assert new.rank_heartbeat_timeout == 20.0


def test_the_steps_a_warmup_entry_times_are_not_learned_from_after_each_start() -> None:
    """torch.compile's first steps: the `warmup` entry times them, so they do not set the step
    timeout; a restart in the same process (`start`) warms up again."""
    rec = TimeoutsRecorder(["step"], warmup_steps=2)
    rec.start(0.0)
    for began, took in ((0.0, 30.0), (30.0, 5.0), (35.0, 0.5), (35.5, 0.25)):
        rec.on_section_open("step", began)
        rec.on_section_close("step", began + took)
    assert rec.observations(40.0).sections["step"] == 0.5
    rec.start(100.0)  # an in-process re-entry: compiles again
    rec.on_section_open("step", 100.0)
    rec.on_section_close("step", 120.0)
    assert rec.observations(130.0).sections["step"] == 0.5
    plain = TimeoutsRecorder(["step"])
    plain.start(0.0)
    plain.on_section_open("step", 0.0)
    plain.on_section_close("step", 30.0)
    assert plain.observations(40.0).sections["step"] == 30.0
