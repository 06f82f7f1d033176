"""The interrupt of an in-process restart lets the function's cleanup run (issue 39, item 2).

The interrupt is raised once per restart into the function, never into an ``except`` or
``finally`` block; it is raised again only into a function found running outside every such
block ``reinterrupt_interval`` later (it swallowed the first), and a cleanup that never ends
is bounded by the hard timeout (the rank kills itself ``hard_timeout - soft_timeout`` after
the fault). Before: the monitor thread sent the interrupt again every ``interrupt_interval``
(0.1 s) until the function had returned, and each one raised RestartInterrupt again, so a
``finally:`` that took 0.5 s was cut after 0.07-0.09 s.

The decisions are pure (ft_client/inprocess/decide.py) and tested here first; then 2 gloo
ranks (tests/workers/inprocess_cleanup.py) and single-rank scripts run the real thing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ft_client.inprocess.decide import Interrupt, MainThread, interrupt_action, must_kill, ping_timed_out, signal_due
from tests import zygote
from tests.procs import ROOT, WORKERS, free_port, slack
from tests.test_inprocess_hygiene import run_two_ranks

WORKER = WORKERS / "inprocess_cleanup.py"

# -- the decisions (pure) -----------------------------------------------------------------


def main_thread(**changes: object) -> MainThread:
    fields: dict[str, object] = dict(interruptible=True, fault_seen=True, busy=False, atomic=False, unwinding=False,
                                     raised_at=None)
    fields.update(changes)
    return MainThread(**fields)  # type: ignore[arg-type]


def test_the_interrupt_is_raised_once_and_never_into_an_except_or_finally_block() -> None:
    assert interrupt_action(main_thread(), 10.0, 5.0) is Interrupt.RAISE
    assert interrupt_action(main_thread(unwinding=True), 10.0, 5.0) is Interrupt.HOLD  # its cleanup runs
    assert interrupt_action(main_thread(raised_at=9.0), 10.0, 5.0) is Interrupt.HOLD  # once per restart
    assert interrupt_action(main_thread(raised_at=9.0, unwinding=True), 100.0, 5.0) is Interrupt.HOLD
    # a function found running outside every handler reinterrupt_interval later swallowed it
    assert interrupt_action(main_thread(raised_at=4.0), 10.0, 5.0) is Interrupt.RAISE
    assert interrupt_action(main_thread(atomic=True), 10.0, 5.0) is Interrupt.DEFER
    for off in (dict(interruptible=False), dict(fault_seen=False), dict(busy=True)):
        assert interrupt_action(main_thread(**off), 10.0, 5.0) is Interrupt.PASS, off


def test_the_signal_is_sent_every_interrupt_interval_until_raised_then_every_reinterrupt_interval() -> None:
    assert signal_due(0.0, None, False, 0.1, 5.0)
    assert not signal_due(1.05, 1.0, False, 0.1, 5.0) and signal_due(1.1, 1.0, False, 0.1, 5.0)
    assert not signal_due(5.9, 1.0, True, 0.1, 5.0) and signal_due(6.0, 1.0, True, 0.1, 5.0)


def test_hang_protection_off_stops_the_soft_and_hard_timeouts_and_the_hard_one_counts_from_its_end() -> None:
    assert ping_timed_out(10.0, 4.0, 5.0, True) and not ping_timed_out(10.0, 4.0, 5.0, False)
    assert not ping_timed_out(10.0, None, 5.0, True)  # not pinged yet in this iteration
    assert must_kill(40.0, 5.0, 0.0, 30.0, True) and not must_kill(40.0, 5.0, 0.0, 30.0, False)
    assert not must_kill(40.0, 5.0, 20.0, 30.0, True) and must_kill(50.5, 5.0, 20.0, 30.0, True)


def test_the_handler_sees_a_finally_block_and_an_except_block_as_unwinding() -> None:
    """What `on_interrupt` reads (sys.exc_info in the handler) in the frames it lands in."""
    from ft_client.inprocess.call import Run
    from ft_client.inprocess.errors import RestartInterrupt
    from ft_client.inprocess.interrupt import on_interrupt
    from tests.test_inprocess_parts import rstore

    run = Run(rstore(1), 0, 1, reinterrupt_interval=0.0)
    run.interruptible = True
    run.fault_seen.set()
    with pytest.raises(RestartInterrupt):
        on_interrupt(run, 0, None)
    assert run.interrupted_at is not None
    try:
        raise ValueError("unwinding (test)")
    except ValueError:
        on_interrupt(run, 0, None)  # an except block: held, though reinterrupt_interval has passed
    try:
        try:
            raise RestartInterrupt("the first interrupt (test)")
        finally:
            on_interrupt(run, 0, None)  # a finally block on the way out: held
    except RestartInterrupt:
        pass
    with pytest.raises(RestartInterrupt, match="raised again"):
        on_interrupt(run, 0, None)  # outside every handler: the function swallowed it and went on


def test_an_interrupt_deferred_by_atomic_is_raised_at_its_end_unless_the_block_ends_unwinding() -> None:
    from ft_client.inprocess.call import CallWrapper, Run
    from ft_client.inprocess.errors import RestartInterrupt
    from tests.test_inprocess_parts import rstore

    run = Run(rstore(1), 0, 1)
    run.interruptible = True
    call = CallWrapper(run, 0)
    with pytest.raises(ValueError, match="the block's own error"):
        with call.atomic():
            run.interrupt_pending = True  # as the handler leaves it (Interrupt.DEFER)
            raise ValueError("the block's own error (test)")  # on its way out: not replaced
    assert not run.interrupt_pending and run.interrupted_at is None
    with pytest.raises(RestartInterrupt, match="deferred until atomic"):
        with call.atomic():
            run.interrupt_pending = True
    assert run.interrupted_at is not None


# -- two gloo ranks -----------------------------------------------------------------------------


def _run_job(workdir: Path, where: str, *flags: str) -> list[str]:
    return run_two_ranks(workdir, WORKER, where, flags, free_port(2), 60, env={"FT_KEY_DIR": str(workdir / "keys")})


@pytest.mark.e2e
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("where", "flags"), [("sleep", ()), ("sleep", ("--reinterrupt", "0.05")),
                                              ("collective", ("--reinterrupt", "0.05"))],
                         ids=["interrupted", "interrupted-reinterrupt-0.05s", "collective-failed-reinterrupt-0.05s"])
def test_a_finally_block_runs_to_its_end_on_every_rank_after_a_restart(workdir: Path, where: str,
                                                                        flags: tuple[str, ...]) -> None:
    """On main each rank's 0.5 s cleanup was cut by the next interrupt (RestartInterrupt raised
    inside the finally). With ``reinterrupt_interval`` 0.05 s the main thread is probed ten
    times during the cleanup and each time found unwinding. With ``collective`` rank 0 is
    unwinding the error of the collective the abort made fail, not our interrupt."""
    outs = _run_job(workdir, where, *flags)
    for r, out in enumerate(outs):
        starts = re.findall(rf"rank {r} cleanup starts in iteration 0, unwinding (\w+)", out)
        assert len(starts) == 1, out[-3000:]
        if r == 1 or where == "sleep":
            assert starts == ["RestartInterrupt"], out[-3000:]
        done = re.findall(rf"rank {r} cleanup done in iteration 0 after ([0-9.]+) s", out)
        assert len(done) == 1, f"rank {r}'s cleanup was cut:\n{out[-3000:]}"
        assert float(done[0]) >= 0.5, out[-3000:]
        assert f"rank {r} returned: done in iteration 1" in out, out[-3000:]


# -- one rank (a script run in a fresh process) -------------------------------------------------


def run_script(workdir: Path, name: str, text: str, timeout: float = 60.0) -> tuple[int, str]:
    """Run ``text`` as rank 0 of 1 (the Wrapper's store in the process); (exit status, output)."""
    path, log = workdir / f"{name}.py", workdir / f"{name}.log"
    path.write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_USE_AGENT_STORE", "FT_INPROCESS_STORE")}
    env.update(RANK="0", WORLD_SIZE="1", PYTHONPATH=str(ROOT))
    with open(log, "w") as out:
        p = zygote.popen([sys.executable, str(path)], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        code = p.wait(timeout * slack())
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        raise AssertionError(f"{name} did not end:\n{log.read_text()[-3000:]}") from None
    return code, log.read_text(errors="replace")


ENDLESS_CLEANUP = """
    import time
    from ft_client.inprocess import Wrapper, events

    @Wrapper(soft_timeout=1, hard_timeout=2.5, monitor_thread_interval=0.01, reinterrupt_interval=0.05)
    def train(call):
        try:
            events.report_fault(events.Fault("test fault", 0))
            time.sleep(30)
        finally:
            print("cleanup starts", time.monotonic(), flush=True)
            time.sleep(30)  # never ends in time
            print("cleanup done", flush=True)

    train()
    print("returned", flush=True)
"""


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_cleanup_that_never_ends_is_bounded_by_the_hard_timeout(workdir: Path) -> None:
    code, out = run_script(workdir, "endless", ENDLESS_CLEANUP)
    assert code == -signal.SIGKILL, out[-3000:]
    assert "cleanup starts" in out and "cleanup done" not in out and "returned" not in out, out[-3000:]
    m = re.search(r"the training function did not return ([0-9.]+) s after an in-process restart", out)
    assert m and 1.5 <= float(m[1]) < 10 * slack(), out[-3000:]


SWALLOWED = """
    import time
    from ft_client.inprocess import RestartInterrupt, Wrapper, events

    @Wrapper(soft_timeout=30, hard_timeout=60, monitor_thread_interval=0.01, reinterrupt_interval=0.5)
    def train(call):
        if call.iteration > 0:
            return f"done in iteration {call.iteration}"
        events.report_fault(events.Fault("test fault", 0))
        try:
            time.sleep(30)
        except RestartInterrupt:
            swallowed = time.monotonic()
            print("swallowed", flush=True)
        try:
            time.sleep(30)  # went on: interrupted again
        finally:
            print(f"interrupted again after {time.monotonic() - swallowed:.2f} s", flush=True)
        return "not reached"

    print("returned:", train(), flush=True)
"""


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_function_that_swallowed_the_interrupt_gets_it_again_after_reinterrupt_interval(workdir: Path) -> None:
    code, out = run_script(workdir, "swallowed", SWALLOWED)
    assert code == 0, out[-3000:]
    m = re.search(r"interrupted again after ([0-9.]+) s", out)
    assert "swallowed" in out and m and 0.45 <= float(m[1]) < 5 * slack(), out[-3000:]
    assert "returned: done in iteration 1" in out, out[-3000:]
