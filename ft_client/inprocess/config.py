"""The Wrapper's options, checked once: `WrapperConfig` takes the keyword arguments of
`Wrapper(...)` (nvidia-resiliency-ext's names), refuses the options that would change what
runs, ignores those of the reference's separate monitor process, turns durations into
seconds and checks them. `Wrapper` is a `WrapperConfig`; the modules that run an
iteration read their settings from it."""

from __future__ import annotations

import signal
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ft_client import logs
from ft_client.inprocess import abort as aborting
from ft_client.inprocess import decide
from ft_client.inprocess.errors import HookError, InProcessError

if TYPE_CHECKING:
    from ft_client.inprocess.call import CallWrapper

log = logs.logger("ft_client.inprocess")

Seconds = float | timedelta

UNSUPPORTED = ("rank_assignment", "rank_filter", "completion", "terminate")
"""nvidia-resiliency-ext options that change what runs; refused (docs/inprocess.md says why)."""
IGNORED = ("monitor_process_interval", "heartbeat_interval", "heartbeat_timeout", "progress_watchdog_interval",
           "last_call_wait", "termination_grace_time", "monitor_process_logfile", "monitor_process_pidfile")
"""nvidia-resiliency-ext options of its separate monitor process, whose job the rank's
monitor daemon does here: accepted and ignored."""


def seconds(name: str, value: Seconds) -> float:
    s = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not s > 0:
        raise InProcessError(f"{name} = {value!r}: must be a positive number of seconds (or a timedelta)")
    return s


class WrapperConfig:
    """The options of a `Wrapper` (its docstring describes them), checked."""

    def __init__(
        self,
        *,
        store_factory: Callable[..., Any] | None = None,
        store_kwargs: dict[str, Any] | None = None,
        initialize: Callable[[CallWrapper], Any] | None = None,
        abort: Callable[[CallWrapper], Any] | None = None,
        finalize: Callable[[CallWrapper], Any] | None = None,
        health_check: Callable[[CallWrapper], Any] | None = None,
        monitor_thread_interval: Seconds = 1.0,
        soft_timeout: Seconds = 60.0,
        hard_timeout: Seconds = 90.0,
        barrier_timeout: Seconds = 120.0,
        completion_timeout: Seconds = 120.0,
        max_iterations: int | None = None,
        interrupt_signal: int = signal.SIGURG,
        interrupt_interval: Seconds = 0.1,
        reinterrupt_interval: Seconds = decide.REINTERRUPT_INTERVAL,
        call_wrapper_arg: str = "call",
        enabled: bool = True,
        **reference_options: Any,
    ) -> None:
        refused = [k for k in UNSUPPORTED if reference_options.get(k) is not None]
        if refused:
            raise InProcessError(f"Wrapper option(s) {', '.join(refused)} are not supported: ranks keep their "
                                 "rank across in-process restarts, and a rank that cannot go on is restarted with "
                                 "its process (see docs/inprocess.md)")
        unknown = sorted(set(reference_options) - set(UNSUPPORTED) - set(IGNORED))
        if unknown:
            raise TypeError(f"Wrapper() got unexpected keyword argument(s): {', '.join(unknown)}")
        ignored = sorted(k for k in reference_options if k in IGNORED)
        if ignored:
            log.info("Wrapper option(s) %s ignored: they configure nvidia-resiliency-ext's monitor process, whose "
                     "job the rank's ft-monitor daemon does", ", ".join(ignored))
        self.monitor_thread_interval = seconds("monitor_thread_interval", monitor_thread_interval)
        self.soft_timeout = seconds("soft_timeout", soft_timeout)
        self.hard_timeout = seconds("hard_timeout", hard_timeout)
        self.barrier_timeout = seconds("barrier_timeout", barrier_timeout)
        self.completion_timeout = seconds("completion_timeout", completion_timeout)
        self.interrupt_interval = seconds("interrupt_interval", interrupt_interval)
        self.reinterrupt_interval = seconds("reinterrupt_interval", reinterrupt_interval)
        if self.hard_timeout <= self.soft_timeout:
            raise InProcessError(f"hard_timeout = {self.hard_timeout:g} s must be above soft_timeout = "
                                 f"{self.soft_timeout:g} s: the difference is how long an interrupted rank has to "
                                 "leave the function")
        for name, hook in (("initialize", initialize), ("abort", abort), ("finalize", finalize),
                           ("health_check", health_check), ("store_factory", store_factory)):
            if hook is not None and not callable(hook):
                raise HookError(f"{name} = {hook!r}: must be a callable or None")
        if max_iterations is not None and max_iterations < 0:
            raise InProcessError(f"max_iterations = {max_iterations}: must be None or >= 0")
        self.store_factory = store_factory
        self.store_kwargs = dict(store_kwargs or {})
        self.initialize = initialize
        self.abort: Callable[[CallWrapper], Any] = abort if abort is not None else aborting.AbortTorchDistributed()
        self.finalize = finalize
        self.health_check = health_check
        self.max_iterations = max_iterations
        self.interrupt_signal = interrupt_signal
        self.call_wrapper_arg = call_wrapper_arg
        self.enabled = enabled
