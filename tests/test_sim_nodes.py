"""Issue 28: the launcher's store protocols at M simulated nodes against one real TCPStore
(bench/sim_nodes.py's harness, at small M). Protocol facts only, never wall-clock limits:
every node that decides names the same first hang and exactly one node takes the roll
call; the roll call gets every node's answer and every rank; no key of ours is left in the
store once the next round is joined; the store operations of an incident, of the slow-rank
exchange and of idle monitor loops grow at most linearly with M."""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

import pytest

from bench import sim_nodes
from tests.procs import slack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, Any]]:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as ft-launcher sets it
    after = sim_nodes.protocol_after()
    return {m: sim_nodes.run_nodes(m, after, incidents=2, ranks_per_node=2, idle_s=1.0, timeout=5.0 * slack())
            for m in (2, 8)}


@pytest.mark.timeout(240)
def test_every_node_agrees_on_the_first_hang_and_one_takes_the_roll_call(runs: dict[int, dict[str, Any]]) -> None:
    for m, run in runs.items():
        for inc in run["incidents"]:
            assert inc["errors"] == [], (m, inc["errors"])
            assert inc["agreed"] and inc["owners"] == 1, (m, inc)
            assert inc["reporting_nodes"] == m // 2, (m, inc)  # the hung node and the victims decided


@pytest.mark.timeout(240)
def test_the_roll_call_gets_every_answer(runs: dict[int, dict[str, Any]]) -> None:
    for m, run in runs.items():
        for inc in run["incidents"]:
            assert inc["answered_nodes"] == m and inc["missing_ranks"] == 0, (m, inc)


@pytest.mark.timeout(240)
def test_no_key_of_ours_is_left_once_the_next_round_is_joined(runs: dict[int, dict[str, Any]]) -> None:
    for m, run in runs.items():
        assert [inc["keys_left_ours"] for inc in run["incidents"]] == [0, 0], m


@pytest.mark.timeout(240)
def test_store_operations_grow_at_most_linearly_with_the_nodes(runs: dict[int, dict[str, Any]]) -> None:
    """Per node: an incident's operations are bounded by a constant (the polls of a window
    and a roll call, not one per other node); the slow-rank exchange costs 4 per node (5 the
    first time in a round); an idle monitor loop a few per second."""
    for m, run in runs.items():
        for inc in run["incidents"]:
            assert inc["incident_ops"] <= 120 * m * slack(), (m, inc["incident_ops"])
            assert inc["step_ops"] == 5 * m, (m, inc["step_ops"])  # set, check+get(index), check, multi_get
            assert inc["step_ops_first"] <= 7 * m, (m, inc["step_ops_first"])  # the round's first: + append
            assert inc["step_medians_seen"] == 2 * (m - 1), m  # every other node's ranks, through multi_get
        assert run["idle"]["ops_per_s_per_node"] <= 10, (m, run["idle"])
    per_node = {m: max(i["incident_ops"] for i in r["incidents"]) / m for m, r in runs.items()}
    assert per_node[8] <= 2 * per_node[2] + 20, per_node  # flat per node, not growing with M


@pytest.mark.timeout(120)
def test_on_etcd_two_nodes_agree_and_every_answer_comes_back() -> None:
    """Issue 43: the bench's etcd store (a real etcd; torch's etcd-v2 backend and EtcdStore, which
    has no append, multi_get nor delete_key) runs the same incident through the per-key path,
    its HTTP requests to etcd counted."""
    if shutil.which("etcd") is None or importlib.util.find_spec("etcd") is None:
        pytest.skip("no etcd or no python-etcd here (scripts/setup-env installs them)")
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    run = sim_nodes.run_nodes(2, sim_nodes.protocol_after(), incidents=1, ranks_per_node=2, idle_s=0.5,
                              timeout=5.0 * slack(), store="etcd")
    (inc,) = run["incidents"]
    assert inc["errors"] == [] and inc["agreed"] and inc["owners"] == 1, inc
    assert inc["answered_nodes"] == 2 and inc["missing_ranks"] == 0, inc
    assert inc["incident_requests"] > 0 and inc["incident_ops"] > 0, inc
