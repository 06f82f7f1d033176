"""The snapshot memory budget's decision, with plain numbers (ft_monitor.core.snapshot_budget)."""

from __future__ import annotations

from typing import Any

import pytest

from ft_monitor.core.snapshot_budget import (
    MIN_RESERVE,
    PAGE_SIZE,
    Decision,
    capacity_for,
    decide,
    host_reserve,
    reservation_refusal,
    reserve_eaten,
    size_text,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PLENTY = dict(available=512 * GiB, total=1024 * GiB)


def ask(**kw: Any) -> Decision:
    args: dict[str, Any] = dict(kind="own", held_capacity=0, held_total=0, limit=16 * GiB, **PLENTY)
    args.update(kw)
    return decide(**args)


def test_capacities_are_whole_pages_and_sizes_read_in_binary_units() -> None:
    assert [capacity_for(n) for n in (0, 1, PAGE_SIZE, PAGE_SIZE + 1)] == [0, PAGE_SIZE, PAGE_SIZE, 2 * PAGE_SIZE]
    assert [size_text(n) for n in (0, 1023, 4096, 512 * MiB, 3 * GiB // 2, 16 * GiB)] == \
        ["0 bytes", "1023 bytes", "4.0 KiB", "512.0 MiB", "1.5 GiB", "16.0 GiB"]


def test_a_new_pair_is_granted_whole_pages_and_counts_both_buffers() -> None:
    d = ask(asked=100 * MiB + 1)
    assert d.ok and d.capacity == 100 * MiB + PAGE_SIZE and d.growth == 2 * d.capacity


def test_nothing_asked_and_nothing_held_makes_nothing() -> None:
    assert ask(asked=0) == Decision(0, 0)


def test_a_pair_never_shrinks_and_asking_within_it_costs_nothing() -> None:
    assert ask(asked=0, held_capacity=GiB, held_total=2 * GiB) == Decision(GiB, 0)
    assert ask(asked=MiB, held_capacity=GiB, held_total=2 * GiB) == Decision(GiB, 0)
    # even with the host out of memory and the limit reached: nothing grows
    assert ask(asked=GiB, held_capacity=GiB, held_total=2 * GiB, limit=2 * GiB, available=0).ok


def test_growing_a_pair_counts_only_the_growth() -> None:
    # 2 x 256 MiB held, 2 x 1 GiB asked: 1.5 GiB more, 2 GiB in all
    d = ask(asked=GiB, held_capacity=256 * MiB, held_total=512 * MiB, limit=2 * GiB)
    assert d.ok and d.capacity == GiB and d.growth == 2 * (GiB - 256 * MiB)
    # the host check, too, counts the growth only: 1.5 GiB more fits 1.5 GiB free over the reserve
    assert ask(asked=GiB, held_capacity=256 * MiB, held_total=512 * MiB,
               available=MIN_RESERVE + 3 * GiB // 2, total=8 * GiB).ok


def test_over_the_limit_is_refused_naming_the_setting() -> None:
    d = ask(asked=GiB, held_capacity=0, held_total=512 * MiB, limit=3 * GiB // 2)
    assert not d.ok and d.capacity == 0 and d.growth == 0
    assert d.refusal == ("2 x 1.0 GiB of snapshot memory asked (own), 512.0 MiB held; snapshot_max_bytes is "
                         "1.5 GiB")
    # the limit itself is allowed, one page more is not
    assert ask(asked=GiB, held_total=512 * MiB, limit=2 * GiB + 512 * MiB).ok
    assert not ask(asked=GiB + 1, held_total=512 * MiB, limit=2 * GiB + 512 * MiB).ok
    # another kind's memory counts: the peer pair on top of the own one
    d = ask(kind="peer", asked=GiB, held_total=2 * GiB, limit=3 * GiB)
    assert d.refusal == "2 x 1.0 GiB of snapshot memory asked (peer), 2.0 GiB held; snapshot_max_bytes is 3.0 GiB"


def test_off_refuses_everything() -> None:
    for asked in (0, 1, GiB):
        assert ask(asked=asked, limit=0).refusal == "snapshots are off on this monitor: snapshot_max_bytes is 0"


@pytest.mark.parametrize("total, reserve", [(None, GiB), (8 * GiB, GiB), (20 * GiB, GiB), (100 * GiB, 5 * GiB)])
def test_the_host_reserve_is_1_gib_or_5_percent_of_its_memory(total: int | None, reserve: int) -> None:
    assert host_reserve(total) == reserve


def test_more_than_the_host_has_is_refused_with_both_numbers() -> None:
    # 2 x 1 GiB on a 64 GiB host with 4 GiB available: 3.2 GiB reserve leaves 0.8 GiB
    d = ask(asked=GiB, available=4 * GiB, total=64 * GiB)
    assert d.refusal == ("2 x 1.0 GiB of snapshot memory asked (own) needs 2.0 GiB more; the host has 4.0 GiB "
                         "available (MemAvailable) and keeps 3.2 GiB in reserve (the larger of 1 GiB and 5% of "
                         "MemTotal)")
    # exactly what is left over the reserve is granted
    assert ask(asked=GiB, available=2 * GiB + host_reserve(8 * GiB), total=8 * GiB).ok
    assert not ask(asked=GiB + 1, available=2 * GiB + host_reserve(8 * GiB), total=8 * GiB).ok
    # less available than the reserve: nothing grows
    assert not ask(asked=1, available=GiB // 2, total=8 * GiB).ok
    # host memory unknown (no /proc/meminfo): only the limit decides
    assert ask(asked=GiB, available=None, total=None).ok


def test_the_limit_is_checked_before_the_host() -> None:
    d = ask(asked=4 * GiB, limit=GiB, available=0, total=8 * GiB)
    assert d.refusal is not None and d.refusal.endswith("snapshot_max_bytes is 1.0 GiB")


def test_a_grant_whose_pages_cannot_be_allocated_is_refused_saying_what_is_kept() -> None:
    assert reservation_refusal(kind="own", capacity=64 * MiB, held_capacity=0, error="Cannot allocate memory") == (
        "2 x 64.0 MiB of snapshot memory asked (own) could not be reserved: the host did not allocate its pages "
        "(fallocate: Cannot allocate memory); none was made")
    assert reservation_refusal(kind="peer", capacity=GiB, held_capacity=256 * MiB,
                               error="No space left on device") == (
        "2 x 1.0 GiB of snapshot memory asked (peer) could not be reserved: the host did not allocate its pages "
        "(fallocate: No space left on device); the snapshot memory held is kept, with its contents")


def test_a_reserve_eaten_after_the_allocation_is_worded_and_a_whole_one_is_not() -> None:
    # 64 GiB host: the reserve is 3.2 GiB
    assert reserve_eaten(available=3 * GiB, total=64 * GiB) == (
        "the host has 3.0 GiB available (MemAvailable) once this grant's pages are allocated, under the 3.2 GiB "
        "it keeps in reserve: something else took memory since the decision (another monitor granting at the "
        "same moment?); the grant stands")
    assert reserve_eaten(available=host_reserve(64 * GiB), total=64 * GiB) is None  # exactly the reserve: whole
    assert reserve_eaten(available=host_reserve(64 * GiB) - 1, total=64 * GiB) is not None
    assert reserve_eaten(available=GiB // 2, total=None) is not None  # MemTotal unknown: the 1 GiB floor
    assert reserve_eaten(available=None, total=64 * GiB) is None  # MemAvailable unknown: nothing to say
