"""In-process restart: on a fault every rank aborts its collectives and re-enters the
training function in the same process (no Python start, no ``import torch``, no
CUDA context to rebuild). docs/inprocess.md has the contract and the details.

    from ft_client.inprocess import Wrapper, CallWrapper

    @Wrapper(soft_timeout=60, hard_timeout=90, barrier_timeout=120)
    def train(call: CallWrapper):
        call.init_process_group("gloo")       # on call.store: a fresh key space per restart
        ...                                   # rebuild DDP, optimizer, reload state
        for step in range(start, steps):
            call.ping()
            ...

    train()

The names follow nvidia-resiliency-ext's ``inprocess`` package, so its users switch
by changing an import (options we do not take are listed in docs/inprocess.md).
Importing this package does not import torch; calling a Wrapper does.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Wrapper",
    "CallWrapper",
    "Compose",
    "RestartInterrupt",
    "InProcessError",
    "HealthCheckError",
    "RestartLimitError",
    "BarrierTimeoutError",
    "DistributedInitializedError",
    "HookError",
    "AbortTorchDistributed",
    "events",
]


def __getattr__(name: str) -> Any:
    if name == "events":
        import ft_client.inprocess.events as events_module

        return events_module
    if name == "Compose":  # no torch: a chain of hooks can be built before the first call
        from ft_client.inprocess.compose import Compose

        return Compose
    if name == "AbortTorchDistributed":
        from ft_client.inprocess import abort

        return abort.AbortTorchDistributed
    if name in __all__:
        from ft_client.inprocess import wrapper

        return getattr(wrapper, name)
    raise AttributeError(f"module 'ft_client.inprocess' has no attribute {name!r}")
