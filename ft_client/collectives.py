"""Where a thread waits for other ranks: inside torch.distributed (a collective,
``init_process_group``, a rendezvous store wait), or inside autograd's backward or DDP,
where gradients are all-reduced. Shared by the monitor's verdict (ft_monitor.forensics.stacks,
on stack dumps) and the in-process Wrapper (on the interrupted frame)."""

from __future__ import annotations

import os
from collections.abc import Iterable

COLLECTIVE_PARTS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/")
"""Parts of a source path whose frames wait for other ranks."""
NOT_THE_USERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ",
                 os.path.dirname(os.path.abspath(__file__)) + os.sep)
"""Parts of a source path whose frames are not the user's code: installed packages, the
standard library, and ft_client itself (a signal handler's frame, from a checkout too)."""


def waits_for_peers(files: Iterable[str]) -> bool:
    """Whether a thread whose frames' source files are ``files``, innermost first, waits for
    other ranks: the innermost frame that is either torch's waiting code or the user's own is
    torch's. Library frames between them do not decide (the standard library, Lightning, a
    module's ``__call__``). The user's code run from inside a wrapper that waits elsewhere is
    not waiting: Lightning calls ``training_step`` from inside DDP's ``forward``, so a rank
    hung in its training step has DDP's frames further out, and it is the hung one."""
    for f in files:
        if any(p in f for p in COLLECTIVE_PARTS):
            return True
        if not any(p in f for p in NOT_THE_USERS):
            return False
    return False
