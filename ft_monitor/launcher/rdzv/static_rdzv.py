"""A fresh worker store for every attempt under torch's static rendezvous (issue 39, item 1).

torch's static rendezvous (``--master-port``; with ``--node-rank`` and ``--master-addr`` on
several nodes, the way many Slurm scripts start torchrun) hosts one TCPStore in node 0's agent
and always hands it to the workers (``use_agent_store`` is True whatever
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` says: only the dynamic handler reads it). The workers'
keys carry no attempt, so after a restart a rank's gloo could read a peer's address of the
previous attempt before the peer wrote its new one: ``connectFullMesh ... Connection refused``
and the attempt died (4 of 4 runs in the port of nvidia-resiliency-ext's tests; reproduced
here whenever a rank starts its process group after the others).

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (ft-launcher's default, launcher.md) the static
rendezvous now does what the dynamic one does: node 0 picks a free port for every attempt
(torch's own ``RendezvousStoreInfo.build``), the other nodes read it from the agent's store at
a key of that attempt's rendezvous round, and the workers get it as MASTER_ADDR:MASTER_PORT
with ``TORCHELASTIC_USE_AGENT_STORE=False``: global rank 0 hosts a new store there, as torch
did before 2.4. The agents' store stays as it was (the launcher's messages, the in-process
Wrapper's records). The nodes of a static rendezvous all restart together (none can rejoin
alone), so their round counts agree.
"""

from __future__ import annotations

import os
from typing import Any

OPT_OUT_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""torch's worker-side switch: ``"True"``, connect to the agent's store; else rank 0 hosts one."""
ROUND_PREFIX = "ft_launcher/static_round/{}"
"""Where node 0 leaves the worker store's address of a round (two keys, torch's names)."""


def fresh_worker_store(handler: Any, environ: Any = os.environ) -> bool:
    """Whether the workers of this rendezvous get a store of their own each attempt from us:
    torch's static handler, and the opt-out of sharing the agent's store in force."""
    try:
        backend = handler.get_backend()
    except Exception:  # noqa: BLE001 - a handler that cannot say: not ours to change
        return False
    return bool(backend == "static" and environ.get(OPT_OUT_ENV, "0") == "1")


def worker_store_address(handler: Any, store: Any, group_rank: int, round_: int) -> tuple[str, int]:
    """(host, port) of round ``round_``'s worker store: chosen by node 0 (a free port on its
    ``--master-addr``), read by the others from the agent's ``store``."""
    from torch._C._distributed_c10d import PrefixStore
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    info = RendezvousStoreInfo.build(group_rank, PrefixStore(ROUND_PREFIX.format(round_), store),
                                     local_addr=getattr(handler, "master_addr", None))
    return info.master_addr, info.master_port
