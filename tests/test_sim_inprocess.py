"""The in-process restart's store protocol at small N (issue 28): bench/sim_inprocess.py's
simulated ranks (threads running the Wrapper's own watcher, fault report, barrier and
cleanup) against one real TCPStore in its own process. Protocol facts only: every rank
learns of the fault and passes the barrier, the store keeps no key per rank of a past
incident, the store calls per rank do not grow with N, and nothing calls the store while
the ranks train. Times are for bench/, never asserted here."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed import HashStore

from bench.sim_inprocess_sim import Pool, Sim
from ft_client.inprocess.store import RestartStore
from ft_client.store.signed import Signer

CALLS_PER_RANK = 20
"""Bound on one rank's store calls per incident, whatever N (today 9-11 on average, the
busiest up to 17: rank 0 as the culprit and the last arrival, with its shared deletes)."""


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool(16)
    try:
        yield p
    finally:
        p.close()


def incidents(pool: Pool, n: int, count: int) -> list[dict[str, object]]:
    sim = Sim(pool, n, seed=n)
    try:
        rows = []
        for k in range(1, count + 1):
            quiet = sim.quiet(0.2)
            assert quiet["calls"] == 0  # the watchers wait in the store: no poll while training
            culprits = [r.run for r in sim.ranks]
            row = sim.incident()
            for r in sim.ranks:  # every rank was notified, passed the barrier and re-entered
                assert r.error is None
                assert len(r.stamps) == k and {"seen", "in", "out", "done"} <= r.stamps[-1].keys()
                assert r.run.iteration == k and r.run.restart is not None
            faults = {(r.run.restart.fault.reason, r.run.restart.fault.rank) for r in sim.ranks if r.run.restart}
            assert len(faults) == 1  # the same fault everywhere
            (_, rank), = faults
            assert rank is not None and culprits[rank].rank == rank
            rows.append(row)
        return rows
    finally:
        sim.close()


@pytest.mark.parametrize("n", [8, 16])
def test_every_rank_restarts_with_a_constant_number_of_store_calls(pool: Pool, n: int) -> None:
    rows = incidents(pool, n, 3)
    for row in rows:
        assert row["calls_busiest_rank"] <= CALLS_PER_RANK  # type: ignore[operator]
        assert row["calls"] <= CALLS_PER_RANK * n  # type: ignore[operator]
        assert row["keys_past"] <= 2  # barrier_done and outside of the last incident, not one per rank
    for row in rows[1:]:
        assert row["keys_growth"] == 0  # nothing left behind per incident
    ops = rows[-1]["calls_by_op"]
    assert isinstance(ops, dict) and ops["delete_key"] <= 2 * n + 5  # one's own keys, not everyone's


def test_the_barrier_carries_the_outside_claim_and_forget_leaves_two_keys() -> None:
    base = HashStore()
    signer = Signer(b"k" * 32, "local")
    stores = [RestartStore(base, 2, signer, rank=r, prefix="t/", attempt_id="0") for r in range(2)]
    for iteration in (0, 1):
        stores[1].claim_outside(iteration, reporter=True)
        with ThreadPoolExecutor(2) as threads:
            assert list(threads.map(lambda s, i=iteration: s.barrier(i, "barrier", 10), stores)) == [None, None]
        base.delete_key(f"t/iter/{iteration}/outside")  # no rank reads it again: barrier_done carried it
        assert [s.outside(iteration) for s in stores] == [1, 1]
        for s in stores:
            s.forget(iteration)
        assert base.num_keys() == 1  # this iteration's barrier_done; the previous one's went with forget
        assert base.check([f"t/iter/{iteration}/barrier_done"])
