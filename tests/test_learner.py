"""The client's learning collaborator (`ft_client.learning.learner.Learner`), on its own: pure,
with ``now`` and the timeouts in force as arguments, no connection and no lock."""

from __future__ import annotations

import pytest

from ft_client.learning.learner import Learner
from ft_client.timeouts import LEARNED_HB, WARMUP_SECTION, Timeouts, learned_section_key

CONFIG = Timeouts(initial_rank_heartbeat_timeout=600.0, rank_heartbeat_timeout=60.0,
                  rank_section_timeouts={"step": 30.0, "ckpt": None, WARMUP_SECTION: 90.0})


def observed_run(learner: Learner) -> None:
    """A run of 10 s: heartbeats 2 s apart, a `step` of 3 s; agreed alone (one rank)."""
    recorder = learner.recorder(CONFIG, 100.0)
    assert WARMUP_SECTION not in recorder.section_names  # warmup times steps; it is never learned
    for t in (101.0, 103.0, 105.0):
        recorder.on_heartbeat(t)
    recorder.on_section_open("step", 105.0)
    recorder.on_section_close("step", 108.0)
    learner.agree(recorder, recorder.export_vector(110.0))


def test_before_anything_was_observed_each_learning_says_what_is_missing() -> None:
    learner = Learner()
    learner.agree(learner.recorder(CONFIG, 0.0), learner.recorder(CONFIG, 0.0).export_vector(1.0))
    assert isinstance(learner.hb_timeouts(CONFIG), str)
    assert isinstance(learner.section_timeouts(CONFIG, None, True), str)
    with pytest.raises(ValueError):
        learner.section_timeouts(CONFIG, ["not-listed"], False)


def test_the_monitors_factor_and_floor_shape_what_is_learned() -> None:
    learner = Learner()
    learner.adopt(safety_factor=2.0, min_learned=0.0)
    observed_run(learner)
    hb = learner.hb_timeouts(CONFIG)
    assert isinstance(hb, Timeouts) and LEARNED_HB in hb.learned
    assert hb.rank_heartbeat_timeout == pytest.approx(4.0)  # the 2 s gap x 2
    sections = learner.section_timeouts(CONFIG, ["step"], False)
    assert isinstance(sections, Timeouts) and learned_section_key("step") in sections.learned
    assert sections.rank_section_timeouts["step"] == pytest.approx(6.0)
    learner.adopt(safety_factor=2.0, min_learned=20.0)  # a floor: no learned timeout below it
    floored = learner.section_timeouts(CONFIG, ["step"], False)
    assert isinstance(floored, Timeouts) and floored.rank_section_timeouts["step"] == pytest.approx(20.0)


def test_a_checkpoint_round_trip_keeps_the_timeouts_the_observations_and_the_iteration() -> None:
    learner = Learner()
    observed_run(learner)
    assert "'ckpt'" in str(learner.section_timeouts(CONFIG, None, False))  # listed, never completed: why
    learned = learner.section_timeouts(CONFIG, ["step"], False)
    assert isinstance(learned, Timeouts)
    state = learner.state_dict(learned, iteration=42)
    assert set(state["observations"]["sections"]) == {"step", "ckpt"}  # every listed section, null if unseen
    other = Learner()
    timeouts, iteration = other.load(state)
    assert iteration == 42 and timeouts == other.loaded
    assert timeouts.rank_section_timeouts["step"] == learned.rank_section_timeouts["step"]
    assert other.observed == learner.observed
    with pytest.raises(ValueError):
        other.load({"format_version": 99})


def test_the_warmup_steps_are_left_out_only_where_a_warmup_entry_times_them() -> None:
    learner = Learner()
    learner.adopt(5.0, 0.0, warmup_steps=3)
    assert learner.recorder(CONFIG, 0.0).warmup_steps == 3  # CONFIG has a warmup entry
    plain = Timeouts(rank_section_timeouts={"step": 30.0})
    assert learner.recorder(plain, 0.0).warmup_steps == 0  # untimed by warmup: learned from


def test_a_checkpoint_below_the_monitors_floor_is_refused_when_the_floor_is_known() -> None:
    """Security round 4: loaded learned timeouts obey the floor learned ones do (the monitor's
    ``min_learned_timeout``): refused at the load where it is known, and at the handshake where
    the checkpoint was loaded before it (then with the reason, for the client's one warning)."""
    state = {"timeouts": {"rank_heartbeat_timeout": 1.0, "learned": [LEARNED_HB]}}
    early = Learner()
    early.pending, _ = early.load(state)  # before the monitor: the floor is not known yet
    early.adopt(5.0, 2.0)  # the handshake: min_learned_timeout 2 s
    taken, why = early.take_pending()
    assert taken is None and why is not None and "rank_heartbeat_timeout = 1.0: must be from 2 s" in why
    assert early.pending is None and early.take_pending() == (None, None)
    late = Learner()
    late.adopt(5.0, 2.0)
    with pytest.raises(ValueError, match="must be from 2 s"):
        late.load(state)
    late.adopt(5.0, 0.5)
    assert late.load(state)[0].rank_heartbeat_timeout == 1.0
