"""The launcher's own stop (torch's SignalException, raised by its SIGTERM/SIGINT handler wherever
the main thread is) is never swallowed by a best-effort step of the agent. Found when a SIGINT
arrived while telemetry polled the monitors: "telemetry failed" was logged and the launcher ran
on until the test gave up."""

from __future__ import annotations

import ast
import signal
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from ft_monitor.launcher.agent.observed import FtObservedAgent
from ft_monitor.launcher.incident.crossnode import TORCH_NODE_KEYS, NodeMessages
from ft_monitor.launcher.incident.rollcall import RollCaller
from ft_monitor.launcher.stop_signal import is_stop, reraise_stop
from ft_monitor.launcher.store.sealed import Sealer
from ft_monitor.launcher.store.store_auth import HangRecord, StoreChannel
from tests.procs import ROOT

MAIN_THREAD = ["incident/crossnode.py", "agent/hangs.py", "agent/observed.py", "incident/rollcall.py",
               "telemetry/slow_watch.py", "store/agreed_key.py"]
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
    for path in sorted((ROOT / "ft_monitor" / "launcher").rglob("*.py")):
        name = str(path.relative_to(ROOT / "ft_monitor" / "launcher"))
        if path.name != "stop_signal.py" and "reraise_stop(" in path.read_text():
            assert name in MAIN_THREAD, f"{name} re-raises the stop: add it to MAIN_THREAD"


class BrokenStore:
    """A rendezvous store every call of which raises ``error``: a store host gone (ConnectionError),
    or the launcher's SIGTERM arriving while the call waits (SignalException)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise self.error
        return call


def _group(store: Any) -> Any:
    handler = SimpleNamespace(get_run_id=lambda: "job-1")
    return SimpleNamespace(store=store, group_world_size=2, group_rank=0, spec=SimpleNamespace(rdzv_handler=handler))


STOP = SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
SECRET = b"s" * 32


def _cross_node_steps(messages: NodeMessages, wg: Any) -> list[Callable[[], object]]:
    channel = StoreChannel(SECRET, "job-1")
    return [
        lambda: messages.exchange_hang_records(wg, channel, HangRecord(1, 1.0, "section 'step' open", "a")),
        lambda: messages.leave_round(wg.store, 0),
        lambda: messages.publish_shutdown(wg, "done", 0),
        lambda: messages.shared_shutdown(wg),
    ]


def test_a_store_gone_is_best_effort_in_every_cross_node_step(caplog: pytest.LogCaptureFixture) -> None:
    wg = _group(BrokenStore(ConnectionError("store host gone")))
    messages = NodeMessages(SECRET)
    hang, left, _, seen = (step() for step in _cross_node_steps(messages, wg))
    assert hang == {} and left > len(TORCH_NODE_KEYS) and seen is None  # the keys it tried to delete
    assert "could not compare hangs with other nodes: store host gone" in caplog.text
    assert "could not publish the shutdown to other nodes: store host gone" in caplog.text


@pytest.mark.parametrize("step", range(4), ids=["exchange", "leave_round", "publish_shutdown", "shared_shutdown"])
def test_the_launchers_stop_inside_a_cross_node_step_stops_the_launcher(step: int) -> None:
    wg = _group(BrokenStore(STOP))
    with pytest.raises(SignalException):
        _cross_node_steps(NodeMessages(SECRET), wg)[step]()


def test_the_launchers_stop_while_looking_for_a_roll_call_stops_the_launcher() -> None:
    def caller() -> RollCaller:
        return RollCaller(lambda lr: Path("/nonexistent"), "a", 3.0, False, sealer=Sealer(SECRET))

    channel = StoreChannel(SECRET, "job-1")
    assert not caller().answer_pending([], store=BrokenStore(ConnectionError("gone")), channel=channel, group_rank=1,
                                       group_world_size=2)
    with pytest.raises(SignalException):
        caller().answer_pending([], store=BrokenStore(STOP), channel=channel, group_rank=1, group_world_size=2)
