"""The launcher's own stop (torch's SignalException, raised by its SIGTERM/SIGINT handler wherever
the main thread is) is never swallowed by a best-effort step of the agent. Found when a SIGINT
arrived while telemetry polled the monitors: "telemetry failed" was logged and the launcher ran
on until the test gave up."""

from __future__ import annotations

import ast
import signal
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from ft_monitor.launcher.observed import FtObservedAgent
from ft_monitor.launcher.stop_signal import is_stop, reraise_stop
from tests.procs import ROOT

MAIN_THREAD = ["crossnode.py", "hangs.py", "observed.py", "rollcall.py", "telemetry.py"]
"""The launcher's modules whose best-effort steps run in the agent's (main) thread."""


def test_is_stop_knows_torchs_signal_exception_only() -> None:
    assert is_stop(SignalException("got signal: 2", sigval=signal.SIGINT))
    assert not is_stop(RuntimeError("the store went away")) and not is_stop(KeyboardInterrupt())
    with pytest.raises(SignalException):
        reraise_stop(SignalException("got signal: 15", sigval=signal.SIGTERM))
    reraise_stop(ConnectionError("gone"))  # anything else: the caller's best effort goes on


def test_a_stop_inside_telemetry_reaches_the_launcher() -> None:
    agent: Any = FtObservedAgent.__new__(FtObservedAgent)
    agent._failed_telemetry = False

    def polled() -> None:
        raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)

    with pytest.raises(SignalException):
        agent._tell(polled)
    assert agent._failed_telemetry is False

    def broken() -> None:
        raise OSError("a monitor went away")

    agent._tell(broken)  # telemetry's own failure stays best effort
    assert agent._failed_telemetry is True


@pytest.mark.parametrize("module", MAIN_THREAD)
def test_every_best_effort_catch_in_the_agents_thread_lets_the_stop_through(module: str) -> None:
    tree = ast.parse((ROOT / "ft_monitor" / "launcher" / module).read_text())
    handlers = [h for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler)
                and isinstance(h.type, ast.Name) and h.type.id in ("Exception", "BaseException")]
    assert handlers, f"{module}: no best-effort catch left: take it off the list"
    for h in handlers:
        first = h.body[0]
        call = first.value if isinstance(first, ast.Expr) else None
        assert isinstance(call, ast.Call) and getattr(call.func, "id", None) == "reraise_stop", \
            f"{module}:{h.lineno}: `except {h.type.id}` must start with reraise_stop({h.name})"


def test_the_list_holds_every_module_that_catches_exception_in_the_agent() -> None:
    for path in sorted((ROOT / "ft_monitor" / "launcher").glob("*.py")):
        if path.name != "stop_signal.py" and "reraise_stop(" in path.read_text():
            assert path.name in MAIN_THREAD, f"{path.name} re-raises the stop: add it to MAIN_THREAD"
