"""In-memory snapshots of a rank's training state, kept by its monitor (docs/snapshots.md).

    from ft_client import snapshot

    got = snapshot.restore()                 # after init_process_group: every rank calls it
    # FSDP2 (DTensors): restore(like={"model": model, "opt": opt}) gives DTensors on the model's mesh
    if got is not None:
        step, state = got
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
    else:
        ...                                  # the file checkpoint (one line said why)
    for step in range(start, steps):
        train_step()
        if step % 10 == 0:
            snapshot.save(step + 1, {"model": model, "opt": opt, "step": step + 1})
    snapshot.wait()                          # before destroy_process_group(): a partner copy may run

`save` copies the state's tensors into one of two memory files that the rank's monitor
daemon owns (they outlive this process: a `kill -9` loses nothing saved), then finishes
the write off the training thread (layout, checksum, the header that makes it complete)
and, on a job of several nodes, copies it to a partner rank on the next node, whose
monitor keeps it (a lost node loses nothing either). `restore` maps the monitor's
memory (no file is read), checks what it finds (torn writes, checksums, another job's or
another rank's snapshot are refused with the reason), agrees with every other rank on
the newest step all of them hold (so DDP and sharded jobs never mix steps), fetches
from the partner what this rank lost with its node, and returns it; or None, after one
line saying why (first start, a monitor that restarted, memory refused), and the
caller falls back to its file checkpoint.

A DTensor (FSDP2's parameters and optimizer state) is saved as this rank's shard and what makes
it a DTensor again (placements, global shape and stride, device mesh); `restore` gives it back
as a DTensor, on the mesh of the state passed as ``like`` or on a mesh made as recorded.

Nothing another process wrote is unpickled: the layout is msgpack (`format`).

The package's modules, each importing only those above it in this list:

- `format`: the bytes of a buffer (header, checksum, layout) and their total readers; pure.
- `tree`: a state's tree flattened into tensors and plain values, and rebuilt.
- `memory`: the monitor's memory files, asked for over its socket and mapped.
- `agreement`: the step every rank restores, and who fetches from whom.
- `peer`: the partner copy, made at save and fetched at restore.
- `snapshotter`: `Snapshotter`, which puts them together.

Importing the package imports no torch: it is imported when a snapshot is saved or restored.
"""

from __future__ import annotations

import threading
from typing import Any

from ft_client.errors import MemorySnapshotError
from ft_client.snapshot.agreement import SLOTS, Agreement, Held, Holdings, agree, from_row, to_row
from ft_client.snapshot.format import (
    HEADER_SIZE,
    DTensorRef,
    Header,
    MeshSpec,
    SnapshotFormatError,
    TensorRef,
    TensorSpec,
)
from ft_client.snapshot.memory import CONNECT_TIMEOUT, HEADROOM, OWN, PEER, open_pair
from ft_client.snapshot.peer import PEER_TIMEOUT, partners
from ft_client.snapshot.snapshotter import Snapshotter

_default: Snapshotter | None = None
_default_lock = threading.Lock()


def default() -> Snapshotter:
    """The process's Snapshotter, made from the environment at first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Snapshotter()
        return _default


def save(step: int, state: Any) -> bool:
    """`Snapshotter.save` on the process's snapshotter."""
    return default().save(step, state)


def restore(map_location: Any = "cpu", *, like: Any = None) -> tuple[int, dict[str, Any]] | None:
    """`Snapshotter.restore` on the process's snapshotter (``like``: the state to restore into, whose
    DTensors' device meshes the restored DTensors get)."""
    return default().restore(map_location, like=like)


def wait() -> None:
    """`Snapshotter.wait` on the process's snapshotter."""
    default().wait()


__all__ = ["Agreement", "DTensorRef", "Held", "Holdings", "MemorySnapshotError", "MeshSpec", "Snapshotter", "agree",
           "default", "open_pair",
           "partners", "restore", "save", "wait",
           # reachable here before the split into modules (issue 40), and still
           "CONNECT_TIMEOUT", "HEADER_SIZE", "HEADROOM", "OWN", "PEER", "PEER_TIMEOUT", "SLOTS", "Header",
           "SnapshotFormatError", "TensorRef", "TensorSpec", "from_row", "to_row"]
