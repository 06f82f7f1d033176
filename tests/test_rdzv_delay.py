"""A restart's rendezvous skips torch's random first-run delay (ft_monitor.launcher.rdzv.rdzv_delay),
checked on torch's own c10d rendezvous handler: the first join sleeps its random (0, 0.3) s,
the restart's join inside `no_first_run_delay` does not, and other delays still sleep."""

from __future__ import annotations

from typing import Any

import pytest

from ft_monitor.launcher.rdzv.rdzv_delay import no_first_run_delay
from tests.procs import free_port

dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")


@pytest.fixture
def delays(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []

    def record(seconds: Any) -> None:  # torch calls it as _delay(seconds=...)
        seen.append(seconds)

    monkeypatch.setattr(dr, "_delay", record)
    return seen


def test_the_restart_joins_without_the_first_run_delay(delays: list[Any]) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{free_port()}", run_id="delay",
                                  min_nodes=1, max_nodes=1, is_host=True, join_timeout=30)
    handler = get_rendezvous_handler(params)
    try:
        handler.next_rendezvous()
        assert (0, 0.3) in delays  # the first join: torch's random skew
        first, recorder = len(delays), dr._delay
        with no_first_run_delay() as applied:
            info = handler.next_rendezvous()  # a restart: torch's cached state is still round 0
        assert applied
        assert info.world_size == 1
        assert not any(isinstance(d, tuple) for d in delays[first:])
        assert dr._delay is recorder  # put back
    finally:
        handler.shutdown()


def test_a_fixed_delay_still_sleeps(delays: list[Any]) -> None:
    with no_first_run_delay():
        dr._delay(seconds=(0, 0.3))
        dr._delay(seconds=1)
    assert delays == [1]
