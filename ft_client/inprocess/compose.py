"""`Compose`: several hooks given where the `Wrapper` takes one (``initialize``, ``abort``,
``finalize``, ``health_check``), under nvidia-resiliency-ext's name and in its order.

    abort=Compose(AbortTorchDistributed(), log_abort)   # log_abort runs first

As in the reference, ``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last one listed runs
first, and a callable that returns something hands it on to the next one (a tuple is
spread as its arguments). Unlike the reference, a callable that returns None hands on the
arguments it was given: our hooks take the `CallWrapper` and return nothing, so a chain
of them gets the same `CallWrapper` each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ft_client.inprocess.errors import HookError


class Compose:
    """Call ``callables`` one after the other, the last listed first; returns what the one
    listed first returned. An exception stops the chain (the rest are not called)."""

    def __init__(self, *callables: Callable[..., Any]) -> None:
        if not callables:
            raise HookError("Compose() needs at least one callable")
        for c in callables:
            if not callable(c):
                raise HookError(f"Compose({c!r}): not a callable")
        self.instances: tuple[Callable[..., Any], ...] = callables
        """The callables, as listed (the reference's attribute name)."""

    def __call__(self, *args: Any) -> Any:
        result: Any = None
        for c in reversed(self.instances):
            result = c(*args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
        return result

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.instances))})"
