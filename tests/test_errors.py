"""One exception family: every exception ft_client and ft_monitor define derives from
FtError; closed and broken connections are told apart by type; causes are kept."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import socket
from pathlib import Path

import pytest

import ft_client
import ft_monitor
from ft_client import (
    FtError,
    MonitorBrokenError,
    MonitorClosedError,
    NotEnoughDataError,
    RankMonitorClient,
    RankMonitorClientError,
)
from ft_client.wire.transport import ConnectTimeoutError, Transport, TransportBrokenError, TransportClosedError
from ft_monitor.config import ConfigError, load_config
from tests.procs import Daemon

SKIP = {"ft_monitor.launcher.agent.agent", "ft_monitor.launcher.main"}  # import torch.distributed.elastic


def _modules() -> list[str]:
    names = []
    for pkg in (ft_client, ft_monitor):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name not in SKIP:
                names.append(info.name)
    return names


CONTROL_FLOW = {"ft_client.inprocess.errors.RestartInterrupt"}
"""BaseExceptions that are no errors: RestartInterrupt unwinds the training function for an
in-process restart and must not be caught by ``except Exception`` (nor by ``except FtError``)."""


def test_every_exception_class_of_ours_derives_from_ft_error() -> None:
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
                if f"{name}.{obj.__name__}" in CONTROL_FLOW:
                    assert not issubclass(obj, Exception)
                    continue
                assert issubclass(obj, FtError), f"{name}.{obj.__name__} is not an FtError"
    assert len(found) >= 20, found  # the walk did find them


BUILTIN_RAISES_ALLOWED = {
    # pydantic turns a ValueError raised in a validator into ConfigError naming the field, and
    # settings.py turns the same rules' ValueError into SettingsError
    ("ft_monitor/core/rules.py", "ValueError"), ("ft_monitor/config.py", "ValueError"),
    ("ft_monitor/config_text.py", "ValueError"),  # the text-form parsers, the same way
    ("ft_client/env.py", "ValueError"),  # RankMonitorClient() re-raises it as RankMonitorClientError
    ("ft_client/__init__.py", "AttributeError"),  # a module's __getattr__ must raise it
    ("ft_client/inprocess/__init__.py", "AttributeError"), ("ft_client/client/__init__.py", "AttributeError"),
    ("ft_monitor/__init__.py", "AttributeError"),
    ("ft_monitor/daemon/__init__.py", "AttributeError"),
    # Wrapper(**options) given an option nvidia-resiliency-ext does not have either: what Python
    # itself raises for a keyword a function does not take
    ("ft_client/inprocess/config.py", "TypeError"),
    ("ft_client/wire/__init__.py", "TypeError"),  # encode() of something that is not a message: a bug, not input
    ("ft_monitor/launcher/agent/control.py", "EOFError"),  # the socket reader's, caught beside it
    ("ft_client/integrations/lightning.py", "ImportError"),  # importing it without Lightning: what Python raises
    # the multi_get given to torch's EtcdStore raises what torch's own get raises there (its callers catch that)
    ("ft_monitor/launcher/store/store_board.py", "LookupError"),
}


def test_nothing_raises_a_bare_builtin_exception() -> None:
    import ast
    import builtins

    root = Path(ft_client.__file__).resolve().parent.parent
    found = set()
    for pkg in ("ft_client", "ft_monitor"):
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                exc = node.exc if isinstance(node, ast.Raise) else None
                name = exc.func if isinstance(exc, ast.Call) else exc
                if isinstance(name, ast.Name) and isinstance(getattr(builtins, name.id, None), type) \
                        and issubclass(getattr(builtins, name.id), BaseException):
                    found.add((str(path.relative_to(root)), name.id, node.lineno))
    assert {(f, n) for f, n, _ in found} <= BUILTIN_RAISES_ALLOWED, sorted(
        x for x in found if x[:2] not in BUILTIN_RAISES_ALLOWED)


def test_the_public_names_and_their_bases() -> None:
    assert {"FtError", "MonitorClosedError", "MonitorBrokenError", "NotEnoughDataError", "TimeoutsCalc"} \
        <= set(ft_client.__all__)
    assert ft_monitor.FtError is FtError
    assert issubclass(MonitorClosedError, RankMonitorClientError)
    assert issubclass(MonitorBrokenError, RankMonitorClientError)
    assert issubclass(NotEnoughDataError, RankMonitorClientError) and issubclass(NotEnoughDataError, ValueError)
    assert issubclass(ConfigError, ValueError) and issubclass(ConnectTimeoutError, TimeoutError)


def test_bad_values_given_to_public_functions_raise_ft_errors_that_are_value_errors() -> None:
    from ft_client import Timeouts, TimeoutsCalc, WorkloadAction
    from ft_client.learning.calc import Observations, sections_not_ready

    current = Timeouts(rank_section_timeouts={"step": 10.0})
    for call in [
        lambda: TimeoutsCalc(safety_factor=0.5),
        lambda: WorkloadAction.parse("RestartEverything"),
        lambda: sections_not_ready(current, Observations(), ["warmup"]),
        lambda: sections_not_ready(current, Observations(), "step"),
        lambda: sections_not_ready(current, Observations(), ["nosuch"]),
        lambda: Observations.from_vector([1.0], ["step"]),
    ]:
        with pytest.raises(ValueError) as info:
            call()
        assert isinstance(info.value, FtError), repr(info.value)


def test_a_client_used_before_init_or_after_shutdown_raises_closed(workdir: Path) -> None:
    c = RankMonitorClient(str(workdir / "none.sock"))
    with pytest.raises(MonitorClosedError, match="not initialized"):
        c.set_timeouts(c.timeouts)
    d = Daemon(workdir).wait_ready()
    try:
        c.init_workload_monitoring(socket_path=str(d.socket))
        c.shutdown_workload_monitoring()
        with pytest.raises(MonitorClosedError):
            c.send_heartbeat()
    finally:
        d.stop()


def test_a_monitor_that_went_away_raises_broken_with_its_cause(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-on-monitor-lost", "raise").wait_ready()
    c = RankMonitorClient(str(d.socket))
    c.init_workload_monitoring()
    d.stop()
    with pytest.raises(MonitorBrokenError) as info:
        for _ in range(1000):
            c.send_heartbeat()
    assert isinstance(info.value.__cause__, TransportBrokenError)
    with pytest.raises(MonitorBrokenError, match="lost"):
        c.set_timeouts(c.timeouts)
    c.shutdown_workload_monitoring()


def test_transport_closed_here_versus_broken_by_the_peer(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen()
        t = Transport(path, 1.0)
        t.close()
        with pytest.raises(TransportClosedError):
            t.send_event(b"\0\0\0\1\x90")
        t2 = Transport(path, 1.0)
        peer, _ = server.accept()
        peer.close()
        peer2, _ = server.accept()
        peer2.close()  # the daemon end goes away
        with pytest.raises(TransportBrokenError) as info:
            t2.request(ft_client.wire.PING)
        t2.close()
    assert info.value.__cause__ is not None or "closed" in str(info.value)


def test_a_config_file_error_keeps_its_cause(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml", environ={})
    assert isinstance(info.value.__cause__, OSError)
    assert isinstance(info.value, FtError)
