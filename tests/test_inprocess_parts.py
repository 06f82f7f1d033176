"""The pieces of in-process restart, without processes: the phase timeline, the store
protocol (on an in-process HashStore), the launcher's rows, and the client's side of a
restart against a daemon running in this process."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from torch.distributed import HashStore, TCPStore

from ft_client import RankMonitorClient
from ft_client.inprocess import events, timeline
from ft_client.inprocess.store import FaultRecord, RestartStore, namespace
from ft_client.store.signed import Signer
from ft_monitor.core.notices import HangNotice
from ft_monitor.core.status import InprocessRestart
from ft_monitor.launcher.agent.inprocess import InprocessLedger
from tests.procs import wait_until
from tests.test_client_states import QUIET, ThreadDaemon

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

# -- timeline (pure) ------------------------------------------------------------------


def stamps(base: float, **offsets: float) -> dict[str, float]:
    return {k: base + v for k, v in offsets.items()}


def test_phases_end_when_the_last_rank_ends_them_and_add_up_to_the_total() -> None:
    r0 = stamps(100, seen=0.01, aborted=0.02, left=0.05, finalized=0.20, barrier=0.30, pg_ready=0.40,
                first_progress=0.45)
    r1 = stamps(100, seen=0.03, aborted=0.04, left=0.04, finalized=0.25, barrier=0.30, entered=0.31,
                first_progress=0.50)  # no pg_ready: counted from its re-entry
    b = timeline.breakdown(100.0, [r0, r1])
    assert b == {"notify": 0.03, "abort": 0.01, "interrupt": 0.01, "finalize": 0.2, "barrier": 0.05,
                 "reinit": 0.1, "first_step": 0.1, "total": 0.5}
    assert sum(v for k, v in b.items() if k != "total") == pytest.approx(b["total"])  # type: ignore[misc]
    assert timeline.describe(b).startswith("notify 0.030s, abort 0.010s, interrupt 0.010s")


def test_a_phase_stamped_out_of_order_counts_zero_and_an_unfinished_rank_leaves_no_total() -> None:
    # the rank that raised left its function before it saw (and aborted) the fault
    raised = stamps(0, left=0.0, seen=0.001, aborted=0.002, finalized=0.1, barrier=0.2, entered=0.2)
    b = timeline.breakdown(0.0, [raised])
    assert b["interrupt"] == 0.0 and b["first_step"] is None and b["total"] is None
    assert timeline.breakdown(0.0, []) == {**{n: None for n, _ in timeline.PHASES}, "total": None}


# -- the store protocol ------------------------------------------------------------------


SIGNER = Signer(b"k" * 32, "local")


def rstore(world: int = 2, rank: int = 0, base: object | None = None) -> RestartStore:
    return RestartStore(HashStore() if base is None else base, world, SIGNER, rank=rank, prefix="t/")


def test_the_first_fault_wins_and_a_done_iteration_takes_no_fault() -> None:
    s = rstore()
    first = FaultRecord("rank 1: ValueError: x", 1, "exception", 1, 5.0)
    assert s.report(0, first) == (True, first)
    won, current = s.report(0, FaultRecord("rank 0: later", 0, "timeout", 0, 6.0))
    assert not won and current == first and s.outcome(0) == first
    s.complete(1)
    assert s.outcome(1) is None  # one of two ranks done
    RestartStore(s.base, 2, SIGNER, rank=1, prefix="t/").complete(1)
    assert s.outcome(1) is True
    assert s.report(1, first) == (False, None)


def test_a_garbage_outcome_is_refused_not_a_fault() -> None:
    # before: any unreadable value was a fault of unknown cause, and every rank restarted on it
    s = rstore(1)
    s.base.set("t/iter/0/outcome", b"\xff not json")
    assert s.outcome(0) is None
    record = FaultRecord("real", 0, "exception", 0, 1.0)
    assert s.report(0, record) == (True, record)  # the writer replaces the refused value
    assert s.outcome(0) == record


def test_waits_are_bounded_and_a_waiter_wakes_on_the_outcome() -> None:
    # the watcher's second connection: Store.clone() from torch 2.8, a new TCPStore client before
    # (torch_features.store_connection; on 2.6 it was None, and the watcher never ran)
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    s = rstore(base=server)
    assert s.wait_outcome(0, 0.05) is None
    assert s.barrier(0, "barrier", 0.05) == 1  # one of two arrived: who to blame is in the error
    watcher = s.clone()
    assert watcher is not None
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(watcher.wait_outcome(2, 10)))
    t.start()
    s.report(2, FaultRecord("r", None, "monitor", 1, 1.0))
    t.join(10)
    assert isinstance(got[0], FaultRecord) and got[0].reason == "r"


def test_keys_are_per_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert namespace() == "ft_inprocess/job7/2/"
    assert RestartStore(HashStore(), 1, SIGNER).key(3, "outcome") == "ft_inprocess/job7/2/iter/3/outcome"


# -- the launcher's rows (pure) -----------------------------------------------------------


def _notice(**kw: object) -> HangNotice:
    base = dict(rank=1, pid=4242, reason="section", section="step", message="section 'step' open for 3.0 s",
                elapsed_s=3.0, timeout_s=3.0, onset_time=97.0, detected_time=100.0, iteration=12,
                report="/r.json", stack_dump=None, stack_dump_captured=False, error_file=None,
                action="inprocess", restart_iteration=1)
    base.update(kw)
    return HangNotice(**base)  # type: ignore[arg-type]


def _back(iteration: int, t0: float, reason: str = "rank 1: section 'step' open", source: str = "monitor",
          fault_rank: int | None = 1) -> InprocessRestart:
    return InprocessRestart(iteration, reason, fault_rank, source,
                            stamps(t0, fault=0.01, seen=0.02, aborted=0.03, left=0.05, finalized=0.1, barrier=0.2,
                                   pg_ready=0.3, first_progress=0.4))


def test_a_row_is_complete_when_every_local_rank_is_back() -> None:
    ledger = InprocessLedger()
    ledger.on_notice(_notice(), attempt=0)
    assert ledger.on_statuses({0: _back(1, 100.0), 1: None}, 2, attempt=0) == []
    (row,) = ledger.on_statuses({0: _back(1, 100.0), 1: _back(1, 100.05)}, 2, attempt=0)
    assert row.rank == 1 and row.reason == "section" and row.detected_time == 100.0
    assert row.phases is not None and row.phases["total"] == pytest.approx(0.45)  # from the verdict
    assert ledger.on_statuses({0: _back(1, 100.0), 1: _back(1, 100.05)}, 2, attempt=0) == []  # once
    (summary,) = ledger.summary()
    assert summary["kind"] == "inprocess" and summary["iteration"] == 1 and summary["ranks_back"] == [0, 1]


def test_the_row_names_the_earliest_onset_whatever_order_the_notices_come_in() -> None:
    for order in ((1, 0), (0, 1)):
        ledger = InprocessLedger()
        notices = {1: _notice(rank=1, onset_time=97.0), 0: _notice(rank=0, pid=4241, onset_time=97.06)}
        for r in order:  # rank 0 waited in the all-reduce for rank 1 and timed out 60 ms later
            row = ledger.on_notice(notices[r], attempt=0)
        assert (row.rank, row.pid) == (1, 4242), order


def test_a_waiting_ranks_notice_gives_way_to_the_fault_on_another_node() -> None:
    """Two nodes: rank 3 (the other node's) hung; this node's rank 1 timed out waiting for it
    and its monitor's notice arrived, before or after the ranks' re-entry, which names rank 3."""
    for notice_first in (True, False):
        ledger = InprocessLedger()
        victim = _notice(rank=1, pid=4242, onset_time=97.3, detected_time=100.3)
        back = {lr: _back(1, 100.0 + lr * 0.01, reason="rank 3: section 'step' open", fault_rank=3)
                for lr in (0, 1)}
        if notice_first:
            ledger.on_notice(victim, attempt=0)
        (row,) = ledger.on_statuses(back, 2, attempt=0)
        if not notice_first:
            ledger.on_notice(victim, attempt=0)
        assert (row.rank, row.pid, row.report, row.message) == (3, None, None, "rank 3: section 'step' open")
        assert row.detected_time == pytest.approx(100.01) and row.phases is not None  # the fault's record


def test_a_restart_without_a_notice_is_recorded_from_the_ranks() -> None:
    ledger = InprocessLedger()
    back = _back(1, 50.0, reason="rank 0: ValueError: bad batch", source="exception", fault_rank=0)
    (row,) = ledger.on_statuses({0: back}, 1, attempt=3)
    assert (row.rank, row.reason, row.message, row.attempt) == (0, "exception", "rank 0: ValueError: bad batch", 3)
    assert row.detected_time == pytest.approx(50.01) and row.phases["total"] == pytest.approx(0.39)  # type: ignore[index]
    ledger.on_statuses({0: _back(1, 70.0)}, 1, attempt=4)  # a new process-level attempt counts anew
    assert [(r["attempt"], r["iteration"]) for r in ledger.summary()] == [(3, 1), (4, 1)]


# -- the client during a restart -------------------------------------------------------------


def test_the_client_reports_a_restart_and_nothing_while_the_rank_unwinds(tmp_path: Path) -> None:
    sock = tmp_path / "s" / "m.sock"
    d = ThreadDaemon(sock, **{**QUIET, "rank_section_timeouts": {"step": 600.0}})
    c = RankMonitorClient(str(sock))
    try:
        c.init_workload_monitoring()
        c.start_section("step")
        c.send_heartbeat()
        wait_until(lambda: d.status().get("heartbeats") == 1, 5, "the first heartbeat")
        events.announce_aborting(1)
        wait_until(lambda: d.status().get("phase") == "restarting", 5, "the daemon to learn of the restart")
        time.sleep(0.05)  # the interrupted step, unwinding for a while
        c.end_section("step")  # the with-block's exit while unwinding
        c.send_heartbeat()
        restart = events.Restart(1, events.Fault("rank 1: ValueError: x", 1, 0, "exception"),
                                 {"fault": time.time(), "seen": time.time()})
        events.announce_entering(restart)
        assert d.status()["phase"] == "restarting" and d.status()["heartbeats"] == 1  # nothing sent meanwhile
        c.start_section("step")  # first progress after re-entry
        wait_until(lambda: d.status().get("phase") == "active", 5, "the daemon to see the rank back")
        st = d.status()
        assert st["last_restart"]["iteration"] == 1 and st["last_restart"]["source"] == "exception"
        assert "first_progress" in st["last_restart"]["times"] and "first_progress" in restart.times
        assert [s["name"] for s in st["open_sections"]] == ["step"]
        c.end_section("step")
        obs = c._calc.observations(time.monotonic())
        assert obs.sections["step"] < 0.05, "the interrupted step is not learned from"
    finally:
        c.shutdown_workload_monitoring()
        d.stop()


# -- the interrupt ---------------------------------------------------------------------------


class _Listener:
    def __init__(self) -> None:
        self.is_busy = False

    def aborting(self, iteration: int) -> None:
        pass

    def entering(self, restart: events.Restart) -> None:
        pass

    def busy(self) -> bool:
        return self.is_busy


def test_the_interrupt_waits_while_the_client_is_mid_frame_or_in_atomic() -> None:
    from ft_client.inprocess.wrapper import RestartInterrupt, _on_interrupt, _Run

    run = _Run(rstore(1), 0, 1)
    run.interruptible = True
    _on_interrupt(run, 0, None)  # no fault seen yet: nothing
    run.fault_seen.set()
    listener = _Listener()
    events.add_restart_listener(listener)
    try:
        listener.is_busy = True
        _on_interrupt(run, 0, None)  # the monitor thread sends it again in interrupt_interval
        listener.is_busy = False
        run.atomic_depth = 1
        _on_interrupt(run, 0, None)
        assert run.interrupt_pending  # raised when atomic() ends
        run.atomic_depth = 0
        with pytest.raises(RestartInterrupt):
            _on_interrupt(run, 0, None)
    finally:
        events.remove_restart_listener(listener)


def test_the_interrupt_never_waits_for_the_listeners_lock() -> None:
    """The signal handler asks busy() on the main thread, which may be inside
    add/remove_restart_listener, holding the listeners' lock, when the signal lands."""
    listener = _Listener()
    events.add_restart_listener(listener)
    try:
        with events._lock:
            listener.is_busy = True
            assert events.busy()
            listener.is_busy = False
            assert not events.busy()
    finally:
        events.remove_restart_listener(listener)
    assert listener not in events._each_listener()


def test_the_client_is_busy_while_in_a_call_or_its_connection_is_mid_send(tmp_path: Path) -> None:
    sock = tmp_path / "s" / "m.sock"
    d = ThreadDaemon(sock, **QUIET)
    c = RankMonitorClient(str(sock))
    try:
        c.init_workload_monitoring()
        hook = c._restart_hook
        assert not hook.busy()
        t = c._transport
        assert t is not None
        with t._lock:  # what a send or a request holds
            assert hook.busy()
        assert not hook.busy()
        with c._lock:  # what every client call holds, a progress store into the record included
            assert hook.busy()
        assert not hook.busy()
        held = threading.Event()
        release = threading.Event()

        def other_thread_in_a_call() -> None:
            with c._lock:
                held.set()
                release.wait(10)

        th = threading.Thread(target=other_thread_in_a_call)
        th.start()
        try:
            assert held.wait(10)
            assert not hook.busy()  # another thread's call: the main thread may be interrupted
        finally:
            release.set()
            th.join(10)
    finally:
        c.shutdown_workload_monitoring()
        d.stop()


def test_a_fault_that_cannot_reach_the_store_is_still_this_ranks_fault() -> None:
    from ft_client.inprocess.wrapper import _Run

    class Gone:
        def compare_set(self, *args: object) -> bytes:
            raise RuntimeError("Connection reset by peer")

        def clone(self) -> object:
            raise RuntimeError("Connection reset by peer")

    run = _Run(rstore(2, 1, Gone()), 1, 2)
    assert run.report("rank 1: ValueError: x", 1, "exception")
    assert run.fault is not None and run.fault.source == "store" and "unreachable" in run.fault.reason
    assert run.wake.is_set()


def test_the_reference_wrappers_options_are_taken_ignored_or_refused_with_the_reason() -> None:
    from datetime import timedelta

    from ft_client.inprocess import CallWrapper, InProcessError, Wrapper

    w = Wrapper(soft_timeout=timedelta(seconds=60), hard_timeout=timedelta(seconds=90),
                monitor_thread_interval=timedelta(seconds=1), heartbeat_timeout=timedelta(seconds=30),
                monitor_process_logfile="/tmp/m-{rank}.log", rank_assignment=None)
    assert (w.soft_timeout, w.hard_timeout, w.monitor_thread_interval) == (60.0, 90.0, 1.0)
    with pytest.raises(InProcessError, match="rank_assignment are not supported: ranks keep their rank"):
        Wrapper(rank_assignment=object())
    with pytest.raises(TypeError, match="unexpected keyword argument.*bogus"):
        Wrapper(bogus=1)
    with pytest.raises(InProcessError, match="hard_timeout = 10 s must be above soft_timeout = 60 s"):
        Wrapper(hard_timeout=10)
    with pytest.raises(InProcessError, match=r"barrier_timeout = -1: must be a positive number of seconds"):
        Wrapper(barrier_timeout=-1)

    def by_annotation(x: int, state: CallWrapper | None = None) -> None: ...
    def by_keyword(x: int, call: object = None) -> None: ...
    assert w._call_wrapper_param(by_annotation) == "state" and w._call_wrapper_param(by_keyword) == "call"
    assert Wrapper(enabled=False)(by_keyword) is by_keyword


def test_a_hang_verdict_on_a_waiting_rank_names_the_rank_outside_every_collective() -> None:
    from ft_client.inprocess.store import FaultRecord
    from ft_client.inprocess.wrapper import _culprit

    reported = FaultRecord("section 'step' open for 2.0 s", 0, "monitor", 0, 100.0)
    moved = _culprit(reported, 1)
    assert (moved.rank, moved.source, moved.time) == (1, "monitor", 100.0)
    assert moved.reason.startswith("rank 1 was outside every collective") and reported.reason in moved.reason
    assert _culprit(reported, None) is reported and _culprit(reported, 0) is reported
    raised = FaultRecord("rank 1: ValueError: bad batch", 1, "exception", 1, 100.0)
    assert _culprit(raised, 0) is raised  # an exception names its own rank
