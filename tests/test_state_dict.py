"""Checkpoint dict of learned timeouts: our version-1 format and nvidia-resiliency-ext's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ft_client.learning.calc import Observations, TimeoutsRecorder, learn_hb_timeouts, learn_section_timeouts
from ft_client.learning.state_dict import (
    FORMAT_VERSION,
    LoadedState,
    StateDictError,
    from_state_dict,
    overlay_learned,
    to_nvrx_state,
    to_state_dict,
    with_nvrx_state,
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
    rank_section_timeouts={"step": 30.0, "ckpt": None},
    rank_out_of_section_timeout=None,
)
OBS = Observations(initial_hb=10.0, hb_gap=2.0, out_of_section=1.0, sections={"step": 3.0, "ckpt": None})


def learned_state() -> dict[str, Any]:
    timeouts = learn_hb_timeouts(CONFIG, OBS)
    timeouts = learn_section_timeouts(timeouts, OBS, selected_sections=["step"])
    return to_state_dict(timeouts, OBS, 5.0)


def test_state_dict_layout() -> None:
    assert learned_state() == {
        "format_version": 1,
        "safety_factor": 5.0,
        "timeouts": {
            "initial_rank_heartbeat_timeout": 50.0,
            "rank_heartbeat_timeout": 10.0,
            "rank_section_timeouts": {"ckpt": None, "step": 15.0},
            "rank_out_of_section_timeout": 5.0,
            "learned": [
                "initial_rank_heartbeat_timeout",
                "rank_heartbeat_timeout",
                "rank_out_of_section_timeout",
                "section:step",
            ],
        },
        "observations": {
            "initial_hb": 10.0,
            "hb_gap": 2.0,
            "out_of_section": 1.0,
            "sections": {"ckpt": None, "step": 3.0},
        },
        "iteration": 0,
    }


def test_iteration_round_trips_and_is_checked() -> None:
    state = to_state_dict(Timeouts(), Observations(), 5.0, iteration=1200)
    assert state["iteration"] == 1200
    assert from_state_dict(state).iteration == 1200
    assert from_state_dict({}).iteration == 0
    with pytest.raises(StateDictError, match=r"^ft state_dict iteration = -1: must be a whole number >= 0$"):
        from_state_dict({**state, "iteration": -1})


def test_round_trip_through_json() -> None:
    state = learned_state()
    text = json.dumps(state, sort_keys=True)
    loaded = from_state_dict(json.loads(text))
    assert loaded.timeouts == from_state_dict(state).timeouts
    assert loaded.observations == OBS
    assert loaded.safety_factor == 5.0
    assert to_state_dict(loaded.timeouts, loaded.observations, loaded.safety_factor) == state


def test_identical_on_ranks_with_the_same_reduced_values() -> None:
    a, b = TimeoutsRecorder(["step", "ckpt"]), TimeoutsRecorder(["ckpt", "step"])
    for c, t in ((a, 1.0), (b, 3.0)):
        c.start(0.0)
        c.on_heartbeat(t)
        c.on_heartbeat(t + 1.0)
    reduced = [max(x, y) for x, y in zip(a.export_vector(5.0), b.export_vector(5.0))]
    states = [
        to_state_dict(learn_hb_timeouts(CONFIG, c.import_vector(reduced)), c.observations(5.0), c.safety_factor)
        for c in (a, b)
    ]
    assert json.dumps(states[0]) == json.dumps(states[1])


def test_empty_and_missing_keys_take_defaults() -> None:
    assert from_state_dict({}) == LoadedState()
    loaded = from_state_dict({"timeouts": {"rank_heartbeat_timeout": 7.0, "learned": ["rank_heartbeat_timeout"]}})
    assert loaded.timeouts == Timeouts(rank_heartbeat_timeout=7.0, learned=frozenset({LEARNED_HB}))
    assert loaded.observations == Observations()
    assert loaded.safety_factor == 5.0


def test_future_version_is_refused() -> None:
    with pytest.raises(
        StateDictError,
        match=r"^ft state_dict format_version = 2: this ft_client reads format_version 1 only; "
        r"load it with the ft_client version that wrote it$",
    ):
        from_state_dict({**learned_state(), "format_version": 2})
    with pytest.raises(StateDictError, match=r"^ft state_dict format_version = True: "):
        from_state_dict({"format_version": True})
    assert FORMAT_VERSION == 1


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(
        StateDictError,
        match=r"^ft state_dict has unknown key\(s\) extra: expected only format_version, safety_factor, timeouts, observations, iteration$",
    ):
        from_state_dict({**learned_state(), "extra": 1})
    with pytest.raises(StateDictError, match=r"^ft state_dict observations has unknown key\(s\) gap: "):
        from_state_dict({"observations": {"gap": 1.0}})
    with pytest.raises(StateDictError, match=r"^ft state_dict: unknown timeout field\(s\): bogus$"):
        from_state_dict({"timeouts": {"bogus": 1.0}})


def test_bad_values_are_refused() -> None:
    with pytest.raises(StateDictError, match=r"^ft state_dict = \[\]: must be a dict$"):
        from_state_dict([])  # type: ignore[arg-type]
    with pytest.raises(StateDictError, match=r"^ft state_dict: rank_heartbeat_timeout = -1: must be a number"):
        from_state_dict({"timeouts": {"rank_heartbeat_timeout": -1}})
    with pytest.raises(
        StateDictError,
        match=r"^ft state_dict observations.hb_gap = 'x': must be a number of seconds from 0 to 604800 \(7 days\), or null$",
    ):
        from_state_dict({"observations": {"hb_gap": "x"}})
    with pytest.raises(StateDictError, match=r"^ft state_dict: safety_factor = 0: must be a number >= 1\.0 \(a factor below 1 makes timeouts shorter than observed\) and <= 100 \(a larger one learns nothing\)$"):
        from_state_dict({"safety_factor": 0})
    # the config's rule: a checkpoint cannot carry a factor the config refuses
    with pytest.raises(StateDictError, match=r"^ft state_dict: safety_factor = 0.5: must be a number >= 1\.0 \(a factor below 1 makes timeouts shorter than observed\) and <= 100 \(a larger one learns nothing\)$"):
        from_state_dict({"safety_factor": 0.5})
    with pytest.raises(
        StateDictError,
        match=r"^ft state_dict timeouts.learned has 'section:ckpt', but that timeout has no value$",
    ):
        from_state_dict({"timeouts": {"rank_section_timeouts": {"ckpt": None}, "learned": ["section:ckpt"]}})
    with pytest.raises(StateDictError, match=r"^ft state_dict timeouts.learned has 'nonsense': expected "):
        from_state_dict({"timeouts": {"learned": ["nonsense"]}})


# -- overlay: learned values from the checkpoint over the config ---------------------
def test_learned_values_override_config_and_keep_marks() -> None:
    loaded = from_state_dict(learned_state()).timeouts
    config = Timeouts(
        initial_rank_heartbeat_timeout=900.0,
        rank_heartbeat_timeout=90.0,
        rank_section_timeouts={"step": 40.0, "ckpt": 200.0},
        rank_out_of_section_timeout=None,
    )
    merged = overlay_learned(config, loaded)
    assert merged.initial_rank_heartbeat_timeout == 50.0
    assert merged.rank_heartbeat_timeout == 10.0
    assert dict(merged.rank_section_timeouts) == {"step": 15.0, "ckpt": 200.0}  # ckpt was configured, not learned
    assert merged.rank_out_of_section_timeout == 5.0
    assert merged.learned == loaded.learned
    # the next calculation averages with the loaded values instead of replacing them
    nxt = learn_hb_timeouts(merged, Observations(initial_hb=30.0, hb_gap=6.0))
    assert (nxt.initial_rank_heartbeat_timeout, nxt.rank_heartbeat_timeout) == (100.0, 20.0)


def test_learned_section_not_in_config_is_dropped() -> None:
    loaded = Timeouts(rank_section_timeouts={"eval": 9.0}, learned=frozenset({learned_section_key("eval")}))
    merged = overlay_learned(CONFIG, loaded)
    assert merged == CONFIG


def test_overlay_of_empty_state_is_the_config() -> None:
    assert overlay_learned(CONFIG, from_state_dict({}).timeouts) == CONFIG


# -- nvidia-resiliency-ext's RankMonitorClient.state_dict() --------------------------
NVRX = {
    "current_timeouts": {
        "heartbeat": {"initial": 120.0, "subsequent": 30.0, "were_calculated": True},
        "section": {
            "section": {"step": 12.0, "ckpt": None, "eval": 80.0},
            "out_of_section": 7.5,
            "calculated_sections": ["eval", "step"],
            "is_out_of_section_calculated": True,
        },
    }
}


def test_nvrx_state_is_loaded_as_learned() -> None:
    loaded = from_state_dict(json.loads(json.dumps(NVRX)))
    t = loaded.timeouts
    assert (t.initial_rank_heartbeat_timeout, t.rank_heartbeat_timeout) == (120.0, 30.0)
    assert dict(t.rank_section_timeouts) == {"step": 12.0, "ckpt": None, "eval": 80.0}
    assert t.rank_out_of_section_timeout == 7.5
    assert t.learned == {
        LEARNED_INITIAL_HB,
        LEARNED_HB,
        LEARNED_OUT_OF_SECTION,
        learned_section_key("step"),
        learned_section_key("eval"),
    }
    assert loaded.observations == Observations()
    merged = overlay_learned(CONFIG, t)
    assert dict(merged.rank_section_timeouts) == {"step": 12.0, "ckpt": None}
    assert merged.rank_out_of_section_timeout == 7.5


def test_nvrx_partial_and_not_calculated() -> None:
    section = {**NVRX["current_timeouts"]["section"], "is_out_of_section_calculated": False}
    only_sections = {"current_timeouts": {"section": section}}
    t = from_state_dict(only_sections).timeouts
    assert t.learned == {learned_section_key("step"), learned_section_key("eval")}
    assert t.rank_heartbeat_timeout is None
    assert from_state_dict({"current_timeouts": {}}).timeouts == Timeouts()
    hb_config = {"current_timeouts": {"heartbeat": {"initial": 1.0, "subsequent": 2.0, "were_calculated": False}}}
    assert overlay_learned(CONFIG, from_state_dict(hb_config).timeouts) == CONFIG


def test_nvrx_heartbeat_only_release() -> None:
    # releases before sections kept the heartbeat fields directly under "current_timeouts"
    old = {"current_timeouts": {"initial": 100.0, "subsequent": 20.0, "were_calculated": True}}
    t = from_state_dict(old).timeouts
    assert (t.initial_rank_heartbeat_timeout, t.rank_heartbeat_timeout) == (100.0, 20.0)
    assert t.learned == {LEARNED_INITIAL_HB, LEARNED_HB}


def test_nvrx_bad_shapes_are_refused() -> None:
    with pytest.raises(
        StateDictError,
        match=r"^nvidia-resiliency-ext state_dict has unknown key\(s\) other: expected only current_timeouts$",
    ):
        from_state_dict({**NVRX, "other": 1})
    with pytest.raises(
        StateDictError,
        match=r"^nvidia-resiliency-ext state_dict current_timeouts has unknown key\(s\) x: ",
    ):
        from_state_dict({"current_timeouts": {"x": {}}})
    with pytest.raises(
        StateDictError,
        match=r"^nvidia-resiliency-ext state_dict current_timeouts.section.calculated_sections names 'ckpt', but ",
    ):
        from_state_dict({"current_timeouts": {"section": {"section": {"ckpt": None}, "calculated_sections": ["ckpt"]}}})
    with pytest.raises(
        StateDictError,
        match=r"^nvidia-resiliency-ext state_dict: current_timeouts.heartbeat.initial = 0: must be",
    ):
        from_state_dict({"current_timeouts": {"heartbeat": {"initial": 0, "subsequent": 1.0, "were_calculated": True}}})
    with pytest.raises(
        StateDictError,
        match=r"^nvidia-resiliency-ext state_dict current_timeouts = 3: must be a dict$",
    ):
        from_state_dict({"current_timeouts": 3})


# -- both in one dict: the file of the Lightning classes under the reference's names -----------
def test_our_state_with_the_references_entry_reads_as_ours() -> None:
    ours = learned_state()
    loaded = from_state_dict(ours)
    both = with_nvrx_state(ours, loaded.timeouts)
    assert set(both) == set(ours) | {"current_timeouts"}
    assert from_state_dict(json.loads(json.dumps(both))) == loaded
    # ours wins: the other entry is not read, whatever it holds
    assert from_state_dict({**ours, "current_timeouts": {"heartbeat": "junk"}}) == loaded
    assert from_state_dict({**ours, "current_timeouts": 3}) == loaded


def test_the_references_entry_is_laid_out_as_its_client_writes_it_and_reads_back_the_same() -> None:
    timeouts = from_state_dict(learned_state()).timeouts
    entry = to_nvrx_state(timeouts)
    assert entry == {"current_timeouts": {
        "heartbeat": {"initial": timeouts.initial_rank_heartbeat_timeout,
                      "subsequent": timeouts.rank_heartbeat_timeout, "were_calculated": True},
        "section": {"section": {"ckpt": None, "step": timeouts.rank_section_timeouts["step"]},
                    "out_of_section": timeouts.rank_out_of_section_timeout, "calculated_sections": ["step"],
                    "is_out_of_section_calculated": True},
    }}
    assert from_state_dict(entry).timeouts.learned == timeouts.learned
    # nothing learned: an empty entry, as the reference's (heartbeats set but configured too)
    assert to_nvrx_state(CONFIG) == {"current_timeouts": {}}
    assert to_nvrx_state(NVRX_TIMEOUTS) == NVRX


NVRX_TIMEOUTS = from_state_dict(NVRX).timeouts


def test_a_dict_with_both_still_refuses_what_ours_refuses() -> None:
    with pytest.raises(StateDictError, match="unknown key"):
        from_state_dict({"format_version": 1, "current_timeouts": {}, "other": 1})
    with pytest.raises(StateDictError, match="format_version"):
        from_state_dict({"format_version": 2, "current_timeouts": {}})


# -- bounds: a learned value from outside is one learning could have made (security round 4) -----
_LEARNED_HB = {"learned": ["initial_rank_heartbeat_timeout", "rank_heartbeat_timeout"]}


@pytest.mark.parametrize("value", [1e308, 1e-300, 1e-6, 7 * 24 * 3600 + 1, 10**400])
def test_learned_timeouts_outside_the_bounds_refuse_the_whole_dict(value: float) -> None:
    ours = {"format_version": 1,
            "timeouts": {"initial_rank_heartbeat_timeout": 60.0, "rank_heartbeat_timeout": value, **_LEARNED_HB}}
    section = {"timeouts": {"rank_section_timeouts": {"step": value}, "learned": ["section:step"]}}
    nvrx = {"current_timeouts": {"heartbeat": {"initial": 60.0, "subsequent": value, "were_calculated": True},
                                 "section": {"section": {"step": value}, "out_of_section": value,
                                             "calculated_sections": ["step"], "is_out_of_section_calculated": True}}}
    for state in (ours, section, nvrx, with_nvrx_state(ours, Timeouts())):
        with pytest.raises(StateDictError, match=r"^(ft|nvidia-resiliency-ext) state_dict") as e:
            from_state_dict(state)
        assert "7 days" in str(e.value) or "must be a number of seconds > 0" in str(e.value), str(e.value)


def test_the_floor_is_the_monitors_min_learned_timeout_and_1_ms() -> None:
    state = {"timeouts": {"initial_rank_heartbeat_timeout": 3.0, "rank_heartbeat_timeout": 3.0, **_LEARNED_HB}}
    assert from_state_dict(state).timeouts.rank_heartbeat_timeout == 3.0  # floor not known: 1 ms
    with pytest.raises(StateDictError, match=r"^ft state_dict learned initial_rank_heartbeat_timeout = 3\.0: must be "
                                             r"from 5 s \(the least a learned timeout may be: min_learned_timeout, "
                                             r"and 1 ms\) to 604800 s \(7 days\)$"):
        from_state_dict(state, floor=5.0)
    assert from_state_dict({"timeouts": {"rank_heartbeat_timeout": 1e-6}}).timeouts.learned == frozenset()  # not learned: not in force
    # what learning makes is always in the bounds: a state dict written is read back
    huge = Observations(initial_hb=1e9, hb_gap=1e-9, out_of_section=None, sections={})
    learned = learn_hb_timeouts(CONFIG, huge, 100.0)
    assert (learned.initial_rank_heartbeat_timeout, learned.rank_heartbeat_timeout) == (7 * 24 * 3600, 0.001)
    assert from_state_dict(to_state_dict(learned, Observations(), 100.0)).timeouts == learned


@pytest.mark.parametrize("factor", [1e308, 100.5, 0.5, float("nan"), float("inf"), 10**400])
def test_the_safety_factor_is_from_1_to_100(factor: float) -> None:
    with pytest.raises(StateDictError, match=r"^ft state_dict: safety_factor = .*: must be a number >= 1\.0 .* and <= 100"):
        from_state_dict({"safety_factor": factor})
    assert from_state_dict({"safety_factor": 100}).safety_factor == 100.0


def test_observations_are_bounded_and_huge_numbers_are_refused_not_raised() -> None:
    with pytest.raises(StateDictError, match=r"observations.hb_gap = 1e\+308: must be a number of seconds from 0"):
        from_state_dict({"observations": {"hb_gap": 1e308}})
    for state in ({"observations": {"hb_gap": 10**400}}, {"timeouts": {"rank_heartbeat_timeout": 10**400}},
                  {"current_timeouts": {"heartbeat": {"initial": 10**400}}}, {"safety_factor": 10**5000}):
        with pytest.raises(StateDictError):
            from_state_dict(state)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                     max_leaves=20)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(["format_version", "timeouts", "observations", "iteration", "safety_factor",
                                        "current_timeouts", "x"]), _JSON, max_size=6))
@example({"timeouts": 1})
@example({"timeouts": {"rank_heartbeat_timeout": 10**400}})  # raised OverflowError
@example({"safety_factor": 10**400})
@example({"timeouts": {"rank_heartbeat_timeout": 1e308, "learned": ["rank_heartbeat_timeout"]}})
def test_any_file_another_process_wrote_is_read_or_refused_with_state_dict_error(state: dict[str, object]) -> None:
    """The exp_dir file (ours and the reference's layout in one) is written by another process:
    reading it raises nothing but StateDictError (``{"timeouts": 1}`` raised TypeError), and
    what it puts in force lies in the bounds of learned values."""
    try:
        loaded = from_state_dict(state)
    except StateDictError:
        return
    t = loaded.timeouts
    for key in t.learned:
        value = t.rank_section_timeouts[key[8:]] if key.startswith("section:") else getattr(t, key)
        assert 0.001 <= value <= 7 * 24 * 3600, (key, value)
    assert 1.0 <= loaded.safety_factor <= 100.0
