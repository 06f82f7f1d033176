"""Cross-rank agreement on learned-timeout observations: one element-wise MAX.

Owns the only torch.distributed call in ft_client. torch is imported lazily,
inside the call, and not at all when the process never imported
torch.distributed (then no process group can exist). Must not choose what is
reduced (see `ft_client.learning.calc`) nor create or destroy process groups.
"""

from __future__ import annotations

import sys

_CPU_BACKENDS = frozenset({"gloo", "mpi", "ucc"})


def device_type_for_backend(backend: str) -> str:
    """The tensor device type an all_reduce on `backend` accepts.

    A backend string is a name ("gloo", "nccl") or a device map
    ("cpu:gloo,cuda:nccl"). CPU is used whenever the backend serves CPU
    tensors; pure NCCL needs CUDA; any other backend gets its own name back as
    the device type is unknown here ("accelerator").
    """
    parts = [p.strip().lower() for p in str(backend).split(",") if p.strip()]
    names: set[str] = set()
    for part in parts:
        device, sep, name = part.partition(":")
        if sep and device == "cpu":
            return "cpu"
        names.add(name if sep else device)
    if names & _CPU_BACKENDS:
        return "cpu"
    if "nccl" in names:
        return "cuda"
    return "accelerator"


def _accelerator_available(torch: object) -> bool:
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accel is not None and bool(accel.is_available())


def max_across_ranks(values: list[float]) -> list[float]:
    """Element-wise MAX of `values` over every rank of the default process group.

    Collective: when a process group is initialized, every rank must call this
    with a list of the same length. Without torch.distributed, or before
    init_process_group, returns `values` unchanged.
    """
    if "torch.distributed" not in sys.modules or not values:
        return list(values)
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    kind = device_type_for_backend(dist.get_backend())
    if kind == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    elif kind == "accelerator" and _accelerator_available(torch):
        accel = torch.accelerator.current_accelerator()
        device = torch.device(accel.type if accel is not None else "cpu", torch.accelerator.current_device_index())
    else:
        device = torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]
