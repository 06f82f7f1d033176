"""`Compose`: several hooks given where the `Wrapper` takes one (``initialize``, ``abort``,
``finalize``, ``health_check``), under nvidia-resiliency-ext's name and in its order.

    abort=Compose(AbortTorchDistributed(), log_abort)   # log_abort runs first

As in the reference, ``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last one listed runs
first, and a callable that returns something hands it on to the next one (a tuple is
spread as its arguments); a callable that returns None where it was given arguments draws
the reference's warning ("didn't chain arguments"). Unlike the reference, the chain then
goes on with the arguments that callable was given, not with None, so a hook that forgot
to return its `CallWrapper` does not cost the next one its argument.

As in the reference, a `Compose` is an instance of the nearest class its callables share
(other than ``object``): ``Compose(MyAbort(), OtherAbort())`` passes
``isinstance(hook, AbortBase)`` where both derive from ``AbortBase``. Where that class
cannot be a base (plain functions share ``function``, which Python does not let anyone
subclass), it is a plain `Compose`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ft_client.inprocess.errors import HookError


def nearest_common_class(objects: tuple[object, ...]) -> type | None:
    """The first class in the first object's MRO that every object is an instance of,
    ``object`` left out; None where they share nothing else."""
    for cls in type(objects[0]).__mro__:
        if cls is not object and all(isinstance(o, cls) for o in objects[1:]):
            return cls
    return None


class Compose:
    """Call ``callables`` one after the other, the last listed first; returns what the one
    listed first returned. An exception stops the chain (the rest are not called)."""

    instances: tuple[Callable[..., Any], ...]
    """The callables, as listed (the reference's attribute name)."""

    def __new__(cls, *callables: Callable[..., Any]) -> Compose:
        if not callables:
            raise HookError("Compose() needs at least one callable")
        for c in callables:
            if not callable(c):
                raise HookError(f"Compose({c!r}): not a callable")
        composed = object.__new__(cls)
        shared = nearest_common_class(callables)
        if cls is Compose and shared is not None and not issubclass(shared, Compose):
            try:  # the reference's rule: an instance of what its parts share
                kind = type(f"Compose[{shared.__name__}]", (Compose, shared), {"__module__": __name__})
                composed = object.__new__(kind)
            except TypeError:  # no acceptable base (function, bool, a layout or metaclass conflict, abstract)
                pass
        composed.instances = callables
        return composed

    def __init__(self, *callables: Callable[..., Any]) -> None:
        """Everything is done in ``__new__``; a shared base's own ``__init__`` is not run
        (the composed object holds no state of its parts')."""

    def __call__(self, *args: Any) -> Any:
        result: Any = None
        for c in reversed(self.instances):
            result = c(*args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
            elif args and args != (None,):
                warnings.warn(f"{type(self).__name__} didn't chain arguments after calling {c!r} with {args!r}; "
                              "the next callable gets the same arguments", stacklevel=2)
        return result

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.instances))})"
