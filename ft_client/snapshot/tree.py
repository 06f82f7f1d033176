"""A state's tree and its tensors (docs/snapshots.md, "save").

`flatten` turns what `save` is given (dicts, lists, tuples, plain values, tensors, objects
with ``state_dict()``) into a tree of plain values with a `TensorRef` where each tensor was,
and the list of those tensors, or refuses it by path; `lay_out` gives each tensor its place
in a buffer's data area; `view` shows a tensor's bytes in the monitor's memory to torch
without a copy; `rebuild` puts tensors back into a tree. torch is imported when they run.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ft_client.errors import MemorySnapshotError
from ft_client.snapshot import format as fmt
from ft_client.snapshot.format import TensorRef, TensorSpec

if TYPE_CHECKING:
    import torch

_PLAIN = (str, bytes, float, type(None), bool)


def flatten(obj: Any, path: str, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    """``obj`` with each tensor replaced by a TensorRef (appended to ``tensors``); Stateful objects
    (``state_dict()``) by their state; anything else a snapshot cannot hold refused by path."""
    import torch

    if depth > 100:
        raise MemorySnapshotError(f"{path} is nested over 100 deep")
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
            raise MemorySnapshotError(f"{path} is a {obj.layout} tensor: snapshots hold dense tensors")
        if str(obj.dtype).removeprefix("torch.") not in fmt.ITEMSIZE:
            raise MemorySnapshotError(f"{path} is a tensor of {obj.dtype}, which snapshots do not hold")
        tensors.append(obj.detach())
        return TensorRef(len(tensors) - 1)
    if type(obj) is int:
        if not -(2**63) <= obj <= 2**64 - 1:
            raise MemorySnapshotError(f"{path} = {obj} does not fit 64 bits")
        return obj
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise MemorySnapshotError(f"{path} has a key {k!r} of type {type(k).__name__}: keys are str or int")
            out[k] = flatten(v, f"{path}[{k!r}]", tensors, depth + 1)
        return out
    if isinstance(obj, list):
        return [flatten(v, f"{path}[{i}]", tensors, depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(flatten(v, f"{path}[{i}]", tensors, depth + 1) for i, v in enumerate(obj))
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):  # torch.distributed.checkpoint's Stateful: a module, an optimizer, ...
        return flatten(state_dict(), path, tensors, depth + 1)
    if isinstance(obj, int):  # an int subclass (IntEnum, ...) is saved as its value
        return flatten(int(obj), path, tensors, depth)
    raise MemorySnapshotError(f"{path} is a {type(obj).__qualname__}: a snapshot holds tensors, "
                              "state_dict()-able objects and plain values (None, bool, int, float, str, bytes, "
                              "lists, tuples, dicts)")


def lay_out(tensors: list[torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Each tensor's place in the data area (in order, each aligned), and the area's length."""
    specs, data_len = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape), data_len, nbytes))
        data_len = fmt.aligned(data_len + nbytes)
    return specs, data_len


def rebuild(tree: Any, tensors: list[Any]) -> Any:
    if isinstance(tree, TensorRef):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {k: rebuild(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rebuild(v, tensors) for v in tree]
    if isinstance(tree, tuple):
        return tuple(rebuild(v, tensors) for v in tree)
    return tree


def view(mm: mmap.mmap, offset: int, spec: TensorSpec) -> torch.Tensor:
    """A tensor over ``spec``'s bytes of the mapping (no copy)."""
    import torch

    dtype = getattr(torch, spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=spec.nbytes, offset=offset + spec.offset)
    return flat.view(dtype).view(spec.shape)
