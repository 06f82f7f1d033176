"""nvidia-resiliency-ext's `inprocess.Compose` and `CallWrapper.disable_hang_protection()`,
ported (issue 39, item 6): the chaining and its order without processes, then single-rank
wrapped calls (tests/test_inprocess_cleanup.run_script: a fresh process each) that restart,
or do not, as the reference's would."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from ft_client.errors import FtError
from ft_client.inprocess import CallWrapper, Compose, HookError, Wrapper
from tests.test_inprocess_cleanup import run_script

# -- Compose (pure) ------------------------------------------------------------------------------


def test_compose_calls_the_last_listed_first_and_hands_on_what_each_returns() -> None:
    seen: list[tuple[str, object]] = []

    def step(name: str, out: object = None) -> Callable[[object], object]:
        def f(x: object) -> object:
            seen.append((name, x))
            return out
        return f

    chain = Compose(step("a", "from a"), step("b", "from b"), step("c", "from c"))
    assert chain("x") == "from a"  # a(b(c(x))), as the reference's
    assert seen == [("c", "x"), ("b", "from c"), ("a", "from b")]
    seen.clear()
    hooks = Compose(step("a"), step("b"), step("c"))  # hooks that return nothing: each gets the CallWrapper
    with pytest.warns(UserWarning, match=r"^Compose didn't chain arguments after calling .* with \('call',\)") as got:
        assert hooks("call") is None
    assert seen == [("c", "call"), ("b", "call"), ("a", "call")]
    assert len(got) == 3  # one per call that returned None, as the reference's
    seen.clear()
    assert Compose(lambda x, y: x + y, lambda: (1, 2))() == 3  # a tuple is spread as the arguments
    assert chain.instances[0] is not None and len(chain.instances) == 3
    assert "Compose(" in repr(chain)


def test_compose_is_an_instance_of_what_its_callables_share_as_the_references() -> None:
    import abc

    class Abort(abc.ABC):  # the user's own base, as nvidia-resiliency-ext's users check it
        @abc.abstractmethod
        def __call__(self, call: object) -> object: ...

    class LogAbort(Abort):
        def __call__(self, call: object) -> object:
            return call

    class FreeCache(LogAbort):
        pass

    composed = Compose(FreeCache(), LogAbort())
    assert isinstance(composed, Abort) and isinstance(composed, LogAbort) and isinstance(composed, Compose)
    assert not isinstance(Compose(FreeCache(), print), Abort)
    assert composed("call") == "call"
    plain = Compose(print, len)  # builtins and functions share nothing a class may derive from
    assert type(plain) is Compose
    assert type(Compose(lambda: 1, lambda: 2)) is Compose


def test_compose_stops_at_an_exception_and_refuses_what_is_not_a_callable() -> None:
    called: list[object] = []

    def boom(x: object) -> None:
        raise RuntimeError("hook failed (test)")

    with pytest.raises(RuntimeError, match="hook failed"):
        Compose(called.append, boom)("x")
    assert called == []
    bad_calls: list[Callable[[], object]] = [lambda: Compose(), lambda: Compose(print, 3),
                                             lambda: Wrapper(finalize=3), lambda: Wrapper(health_check="check")]
    for bad in bad_calls:
        with pytest.raises(TypeError) as info:
            bad()
        assert isinstance(info.value, HookError) and isinstance(info.value, FtError)


COMPOSED_HOOKS = """
    import time
    from ft_client.inprocess import AbortTorchDistributed, Compose, Wrapper, events

    order = []
    def note(name):
        def hook(call):
            order.append(f"{name}@{call.iteration}")
            return call  # hands the CallWrapper on, as the reference's hooks return their state
        return hook

    @Wrapper(soft_timeout=30, hard_timeout=60, monitor_thread_interval=0.01,
             initialize=Compose(note("init2"), note("init1")),
             abort=Compose(AbortTorchDistributed(), note("abort")),
             finalize=Compose(note("fin2"), note("fin1")),
             health_check=Compose(note("health2"), note("health1")))
    def train(call):
        if call.iteration == 0:
            events.report_fault(events.Fault("test fault", 0))
            time.sleep(30)
        return call.iteration

    print("returned", train(), "order", " ".join(order), flush=True)
"""


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_composed_hooks_run_in_the_references_order_in_a_restart(workdir: Path) -> None:
    code, out = run_script(workdir, "composed", COMPOSED_HOOKS)
    assert code == 0, out[-3000:]
    assert "returned 1 order init1@0 init2@0 abort@0 fin1@0 fin2@0 health1@0 health2@0 init1@1 init2@1" in out, \
        out[-3000:]


# -- disable_hang_protection ------------------------------------------------------------------------


def test_hang_protection_nests_counts_again_from_the_end_of_the_outermost_block_and_is_per_iteration() -> None:
    from ft_client.inprocess.call import Run
    from tests.test_inprocess_parts import rstore

    run = Run(rstore(1), 0, 1)
    call = CallWrapper(run, 0)
    call.ping()
    pinged = run.last_ping
    assert pinged is not None
    with call.disable_hang_protection():
        with call.disable_hang_protection():
            assert run.unprotected == 2
        assert run.unprotected == 1 and run.last_ping == pinged
    assert run.unprotected == 0 and run.last_ping is not None and run.last_ping > pinged  # no stale ping
    assert run.protected_since >= run.last_ping
    call._disable_hang_protection()
    run.iteration += 1
    run.new_iteration(sockets=set())  # a restart: protection is back on in the next iteration
    assert run.unprotected == 0
    call._enable_hang_protection()  # the previous iteration's CallWrapper changes nothing
    call._disable_hang_protection()
    assert run.unprotected == 0


PROTECTION = """
    import time
    from ft_client.inprocess import RestartInterrupt, Wrapper, events

    case = CASE

    def busy(seconds):  # long work in Python that pings nothing
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.02)

    @Wrapper(soft_timeout=0.5, hard_timeout=1.0, monitor_thread_interval=0.01, reinterrupt_interval=30)
    def train(call):
        if call.iteration > 0:
            return f"done in iteration {call.iteration}"
        call.ping()
        if case == "off":
            with call.disable_hang_protection():
                busy(1.5)  # three soft timeouts
            busy(0.3)  # the block's end counts as a ping
            call.ping()
        elif case == "on":
            busy(1.5)
        elif case == "fault":
            with call.disable_hang_protection():
                events.report_fault(events.Fault("test fault", 0))
                busy(30)
        elif case == "slow-exit":  # the hard timeout waits for the block's end
            with call.disable_hang_protection():
                events.report_fault(events.Fault("test fault", 0))
                try:
                    busy(30)
                except RestartInterrupt:
                    busy(1.5)  # three times hard_timeout - soft_timeout
                    print("left the block", flush=True)
                    raise
        return f"done in iteration {call.iteration}"

    print("returned:", train(), flush=True)
"""


@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "iteration"), [("off", 0), ("on", 1), ("fault", 1), ("slow-exit", 1)])
def test_disable_hang_protection_stops_the_timeouts_not_a_restart(workdir: Path, case: str, iteration: int) -> None:
    """``off``: 1.5 s without a ping (soft_timeout 0.5 s) inside the block is no fault; ``on``:
    the same outside it is one. ``fault``: a fault elsewhere still interrupts the block.
    ``slow-exit``: unwinding inside the block for three times hard_timeout - soft_timeout does
    not kill the rank (without the block it would: test_inprocess_cleanup)."""
    code, out = run_script(workdir, "protection", PROTECTION.replace("CASE", repr(case)))
    assert code == 0, out[-3000:]
    assert f"returned: done in iteration {iteration}" in out, out[-3000:]
    timeouts = re.findall(r"no ping\(\) for", out)
    assert len(timeouts) == (case == "on"), out[-3000:]
    assert "did not return" not in out, out[-3000:]
    if case == "slow-exit":
        assert "left the block" in out, out[-3000:]
