"""Aborting an iteration's collectives, and letting go of its process groups safely.

`AbortTorchDistributed` is the default ``abort`` hook of the `Wrapper`: it runs in
the Wrapper's monitor thread while the main thread may be blocked in a collective.

* gloo (measured on torch 2.13, CPU): a group's abort does not close its
  connections while anything (a DDP reducer, the interrupted frame) still holds
  the group, and a rank blocked in a collective is freed only when its socket
  fails. So the hook shuts down the TCP connections this process opened during
  the aborted iteration, except the rendezvous stores': a collective blocked on
  either side then fails at once ("Connection closed by peer").
* NCCL: the communicators are aborted from this thread (the only way to free
  kernels that wait for a peer).

`release_process_groups` (main thread, once out of the function) forgets every
group. The group objects themselves are kept alive (`hold_groups`, also called
on every tick of the monitor thread, so that a group the function destroys on
its way out is held too) until `bury`, after the restart barrier or the
completion wait. A gloo group destroyed right after a collective can deadlock:
its destructor joins its worker threads with the GIL held, while a worker thread
destroying the finished work needs the GIL when the work was enqueued from
autograd (DDP's all-reduce, or a barrier queued behind it); seen here as a hang
in ``~ProcessGroupGloo`` at the end of a DDP function that called ``barrier()``
and ``destroy_process_group()``. Past a store wait the worker threads are idle.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Protocol

from ft_client import logs
from ft_client.torch_features import group_abort

log = logs.logger("ft_client.inprocess")

_graveyard: list[Any] = []
"""Process groups kept alive until `bury` (after a store wait)."""


class AbortedCall(Protocol):
    """What the abort hook reads from the `CallWrapper` it is given. A protocol, so that
    this module does not import the Wrapper's, which imports this one."""

    @property
    def rank(self) -> int: ...

    @property
    def store_ports(self) -> set[int]: ...

    def new_tcp_sockets(self) -> set[int]: ...


class AbortTorchDistributed:
    """The default ``abort`` hook: free every collective in flight and abort every
    torch.distributed group, so that a fresh ``init_process_group`` can follow.

    ``close_tcp=False`` leaves TCP connections alone (then a gloo collective blocked on a
    peer that never answers stays blocked until gloo's own timeout): pass it, with your
    own hook, if the training function opens TCP connections that must outlive a restart.
    """

    def __init__(self, close_tcp: bool = True) -> None:
        self.close_tcp = close_tcp

    def __call__(self, call: AbortedCall) -> AbortedCall:
        """Abort, and return ``call``: so `Compose` hands it to the next hook unwarned."""
        import torch.distributed as dist

        if self.close_tcp:
            closed = close_tcp_connections(call.new_tcp_sockets(), call.store_ports)
            if closed:
                log.info("rank %d: shut down %d TCP connection(s) of the aborted iteration", call.rank, closed)
        if dist.is_available() and dist.is_initialized() and _uses_nccl():
            release_process_groups()  # NCCL: abort the communicators from this (monitor) thread
        return call


def _uses_nccl() -> bool:
    import torch.distributed as dist

    try:
        return "nccl" in str(dist.get_backend()).lower()
    except (RuntimeError, ValueError):
        return False


def _live_groups() -> list[Any]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_available():
        return []
    return list(distributed_c10d._world.pg_map)


def hold_groups() -> None:
    """Keep every live process group alive until `bury` (any thread)."""
    try:
        groups = _live_groups()
    except Exception:  # noqa: BLE001 - torch.distributed not usable: nothing to hold
        return
    held = {id(g) for g in _graveyard}
    _graveyard.extend(g for g in groups if id(g) not in held)


def release_process_groups() -> None:
    """Forget every torch.distributed group (main thread, no collective in flight), so that
    the next iteration can call ``init_process_group`` again; the group objects wait in the
    graveyard until `bury`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        hold_groups()
        if group_abort() or _uses_nccl():  # torch 2.6 aborts NCCL's only (a no-op and a warning for gloo)
            distributed_c10d._abort_process_group()
        if dist.is_initialized():  # torch 2.6 with gloo: the groups are still there; forget them
            dist.destroy_process_group()  # held in the graveyard: no group's destructor runs here


PINNING_MODULES = ("torch.distributed.nn.functional",)
"""torch modules whose functions take ``group=group.WORLD`` as a default argument, bound once,
when the module is first imported, and cheap to import (~30 ms on 2 loaded cores). DDP's
constructor imports ``torch._dynamo``, which imports this one: first imported inside the
wrapped function, its ten functions would hold iteration 0's default group for the life of the
process (with its gloo threads: ``gloo_tcp_loop`` and two ``pt_gloo_runloop``), and call it when
used without a ``group`` in a later iteration. Imported before the first group exists, their
default is None: the default group of the moment they are called. Two other torch modules do
the same (``torch.distributed.fsdp.sharded_grad_scaler``,
``torch.distributed.optim.zero_redundancy_optimizer``) but take seconds to import: not imported
here (docs/inprocess.md says to import them before the wrapped call)."""


def import_group_defaults() -> None:
    """Import `PINNING_MODULES` while no process group exists (the Wrapper's start: it refuses an
    initialised torch.distributed), so that no aborted group is pinned by a default argument."""
    import importlib

    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    for name in PINNING_MODULES:
        importlib.import_module(name)


def bury() -> int:
    """Destroy the aborted iterations' groups (after the restart barrier); how many."""
    n = len(_graveyard)
    _graveyard.clear()
    return n


def tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of the TCP sockets of this process's
    network namespace (/proc/self/net/tcp and tcp6)."""
    out: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                out[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16),
                                       fields[3])
    return out


def socket_fds() -> dict[int, int]:
    """inode -> descriptor of every socket this process holds."""
    out: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


ESTABLISHED = "01"


def close_tcp_connections(inodes: set[int], keep_ports: set[int]) -> int:
    """Shut down (not close: the descriptors stay their owners') the established TCP
    connections among ``inodes`` whose local and remote ports are not in ``keep_ports``;
    how many."""
    tcp = tcp_sockets()
    closed = 0
    for inode, fd in socket_fds().items():
        info = tcp.get(inode)
        if inode not in inodes or info is None or info[2] != ESTABLISHED or info[0] in keep_ports \
                or info[1] in keep_ports:
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            s.detach()
    return closed
