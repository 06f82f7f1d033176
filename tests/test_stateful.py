"""The client in a torch.distributed.checkpoint (DCP) state dict, with a real daemon."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from ft_client import RankMonitorClient
from tests.procs import Daemon, cleanup_dir, short_tmpdir, status

pytestmark = pytest.mark.e2e


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = short_tmpdir()
    dm = Daemon(d, "--ft-rank-section-timeouts", "step:60,ckpt:300", "--ft-min-learned-timeout", "0.5").wait_ready()
    yield dm
    dm.stop()
    cleanup_dir(d)


def test_client_is_a_dcp_stateful_and_round_trips_learned_timeouts(daemon: Daemon, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about numpy and about DCP without a process group
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.stateful import Stateful

        t = 100.0
        first = RankMonitorClient(str(daemon.socket), clock=lambda: t)
        assert isinstance(first, Stateful)
        first.init_workload_monitoring()
        for _ in range(3):
            first.start_section("step")
            t += 0.2
            first.end_section("step")
        first.start_section("ckpt")
        t += 1.0
        first.end_section("ckpt")
        assert first.calculate_and_set_section_timeouts(calc_out_of_section=False)
        learned = first.timeouts
        assert learned.rank_section_timeouts == {"step": pytest.approx(1.0), "ckpt": pytest.approx(5.0)}
        dcp.save({"ft": first}, checkpoint_id=str(tmp_path / "ckpt"))
        first.shutdown_workload_monitoring()

        second = RankMonitorClient(str(daemon.socket))
        second.init_workload_monitoring()  # DCP loads into the layout state_dict() gives: init first
        dcp.load({"ft": second}, checkpoint_id=str(tmp_path / "ckpt"))
    assert second.timeouts == learned
    assert second.iteration == 3
    assert second.state_dict()["observations"]["sections"] == {"ckpt": pytest.approx(1.0), "step": pytest.approx(0.2)}
    assert status(daemon.socket)["timeouts"]["rank_section_timeouts"]["ckpt"] == pytest.approx(5.0)
    second.shutdown_workload_monitoring()
