"""Where a thread waits for other ranks: inside torch.distributed (a collective,
``init_process_group``, a rendezvous store wait), or inside autograd's backward or DDP,
where gradients are all-reduced. Shared by the monitor's verdict (ft_monitor.forensics.stacks,
on stack dumps) and the in-process Wrapper (on the interrupted frame)."""

from __future__ import annotations

from collections.abc import Iterable

COLLECTIVE_PARTS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/")
"""Parts of a source path whose frames wait for other ranks."""


def waits_for_peers(files: Iterable[str]) -> bool:
    """Whether any of these frames' source files waits for other ranks."""
    return any(p in f for f in files for p in COLLECTIVE_PARTS)
