"""nvidia-resiliency-ext's learning rules for its Lightning classes (ft_client.integrations.
reference_rules), with plain values: no Lightning, no client (the classes that use them:
tests/test_lightning_callback.py; the reference's own tests: scripts/nvrx-ptl-tests)."""

from __future__ import annotations

from typing import Any

import pytest

from ft_client.integrations import reference_rules as rules

# -- clean exits --------------------------------------------------------------------------------


@pytest.mark.parametrize(("exception", "clean"), [
    (None, True), (SystemExit(0), True), (SystemExit(None), True), (SystemExit(1), False),
    (SystemExit("bye"), False), (ValueError("x"), False), (KeyboardInterrupt(), False),
])
def test_only_no_exception_or_sys_exit_0_is_a_clean_exit(exception: BaseException | None, clean: bool) -> None:
    assert rules.is_clean_exit(exception) is clean


# -- heartbeats ---------------------------------------------------------------------------------


def test_a_save_counts_between_heartbeats_only_with_one_before_and_one_after() -> None:
    count = rules.HeartbeatCount()
    count.save()  # before any heartbeat: nothing before it
    count.beat()
    assert not count.save_between
    count.save()
    assert not count.save_between  # nothing after it yet
    count.beat()
    assert count.save_between and count.sent == 2
    count.save()  # latched: later saves do not undo it
    assert count.save_between


HB_OK: dict[str, Any] = dict(updated=False, iterations=2, failed=False, loaded_checkpoint=True,
                             save_between_heartbeats=True)


def test_the_heartbeat_timeouts_are_updated_in_a_resumed_run_that_saved() -> None:
    assert rules.may_update_hb_timeouts(**HB_OK)


@pytest.mark.parametrize("change", [
    {"updated": True},                     # at most once a run
    {"iterations": 1},                     # at least 2 training iterations
    {"failed": True},                      # not after a failure
    {"loaded_checkpoint": False},          # a fresh run learns nothing
    {"save_between_heartbeats": False},    # nor one that saved no checkpoint between heartbeats
])
def test_the_heartbeat_timeouts_are_not_updated_without_each_condition(change: dict[str, Any]) -> None:
    assert not rules.may_update_hb_timeouts(**{**HB_OK, **change})


# -- sections -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("last_update", "last_save", "due"), [(0, 0, False), (0, 50, True), (50, 50, False),
                                                              (51, 50, False), (50, 75, True)])
def test_an_update_is_due_after_a_save_at_a_later_step(last_update: int, last_save: int, due: bool) -> None:
    assert rules.update_due_after_save(last_update, last_save) is due


PLAN: dict[str, Any] = dict(failed=False, loaded_checkpoint=True, iterations=17, last_save_step=50,
                            async_checkpointing=False, final=True)


def _plan(**change: Any) -> tuple[tuple[str, ...], bool]:
    update = rules.plan_section_update(**{**PLAN, **change})
    return update.sections, update.out_of_section


def test_a_resumed_run_that_saved_learns_every_section_and_the_out_of_section_at_its_end() -> None:
    assert _plan() == (("setup", "step", "checkpointing"), True)
    assert _plan(final=False) == (("setup", "step", "checkpointing"), False)  # after a save: not yet


@pytest.mark.parametrize(("change", "expected", "note"), [
    ({"loaded_checkpoint": False}, (("step", "checkpointing"), False), "until persistent checkpoint is loaded"),
    ({"iterations": 16}, (("setup", "checkpointing"), False), "more training iterations"),
    ({"last_save_step": 0}, (("setup", "step"), False), "until a checkpoint was saved"),
    ({"async_checkpointing": True}, (("setup", "step"), True), "with async checkpointing"),
])
def test_each_section_waits_for_what_it_needs(change: dict[str, Any], expected: tuple[tuple[str, ...], bool],
                                             note: str) -> None:
    assert _plan(**change) == expected
    assert any(note in line for line in rules.plan_section_update(**{**PLAN, **change}).notes)


def test_a_fresh_run_learns_step_and_checkpointing_but_never_setup_or_the_out_of_section() -> None:
    update = rules.plan_section_update(**{**PLAN, "loaded_checkpoint": False})
    assert not update.out_of_section
    assert any("out-of-section timeout won't be updated" in line for line in update.notes)


def test_a_failure_learns_nothing_and_says_so() -> None:
    update = rules.plan_section_update(**{**PLAN, "failed": True})
    assert update.is_empty and update.notes == ("Rank exits due to a failure, won't update the FT timeouts",)


def test_a_run_with_nothing_to_learn_is_an_empty_plan() -> None:
    assert rules.plan_section_update(**{**PLAN, "loaded_checkpoint": False, "iterations": 3,
                                        "last_save_step": 0}).is_empty


@pytest.mark.parametrize(("listed", "ok"), [
    ({"setup": 1, "step": 1, "checkpointing": 1}, True),
    ({}, False), ({"setup": 1, "step": 1}, False),
    ({"setup": 1, "step": 1, "checkpointing": 1, "unexpected_section": 1}, False),
    ({"setup": 1, "step": 1, "checkpointing": 1, "validation": 1}, False),
])
def test_the_config_must_list_exactly_setup_step_and_checkpointing(listed: dict[str, int], ok: bool) -> None:
    problem = rules.config_problem(listed)
    assert (problem is None) is ok
    if problem is not None:
        assert "checkpointing, setup, step" in problem  # what is expected
        assert (", ".join(sorted(listed)) or "no section") in problem  # what is listed
