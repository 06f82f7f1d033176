"""Where the torch minors ft-monitor supports (2.6 to 2.14) differ, each difference one seam,
chosen once by what the installed torch has (a feature test, not a version comparison).

A `Feature` names what ft-monitor does with it and the torch it works from; `off` lists those
the installed torch lacks, one line each, which ft-launcher prints at start (and nothing later
raises a traceback for them). The values the rest of the code reads (`flight_recorder`) are
taken from here, so that no other module tests torch's version or internals for these.

Found by running the product on torch 2.6.0, 2.13.0 and 2.14.1 and reading the wheels of every
minor between (docs/launcher.md, "torch versions"):

* A second connection to a store (``Store.clone()``): from torch 2.8. Before, `store_connection`
  opens one to a plain TCPStore itself (a new client of the same server); a store under a
  PrefixStore (torch's rendezvous store, as ft-launcher's agents hold it), whose prefix torch
  does not expose before 2.8, has none: its counters are added to on its own connection, and a
  counter another user spoils closes that connection (ft_client/store/counter.py).
* Aborting a process group (``distributed_c10d._abort_process_group``): from torch 2.7 every
  backend's (``ProcessGroup.abort``); in 2.6 NCCL's only, a no-op for gloo that leaves the group
  in place, so an in-process restart's next ``init_process_group`` failed ("trying to initialize
  the default process group twice"). `group_abort` tells them apart; before 2.7 the in-process
  Wrapper destroys the (held) groups instead (ft_client/inprocess/abort.py).
* torch's failure table: from 2.10 it lists, beside the worker that failed first, the workers it
  then stopped (``SubprocessContext._capture_process_failures``); before, only the first, so a
  crash's victims went unnamed. `failures_list_stopped_workers` tells them apart, and before 2.10
  ft-launcher adds the stopped workers' exits itself (ft_monitor/launcher/agent/torch_support.py).
* FSDP2 (``fully_shard``) on CPU: from torch 2.7 (its all-gather records an event on
  ``torch.cpu.Stream``, which has ``record_event`` from 2.7); before, fully_shard needs a GPU.
  Snapshots of DTensors (ft_client.snapshot) work on 2.6 whatever made them.
* Flight Recorder: from torch 2.8 it is torch's own (``TORCH_FR_BUFFER_SIZE``,
  ``TORCH_FR_DUMP_TEMP_FILE``, ``_dump_fr_trace_json``) and records gloo's collectives too;
  before, it is NCCL's only, under NCCL's names (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, ``_dump_nccl_trace_json``), so a CPU (gloo) job has no
  trace and a hang's verdict comes from the ranks' stacks alone.

Nothing here imports torch at module load; the tests run at the first question, once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Feature:
    """One place where the supported torch minors differ."""

    name: str
    """What ft-monitor does with it, as the start-up line names it."""
    since: str
    """The torch minor it works from."""
    without: str
    """What happens instead on an older torch."""

    def line(self, version: str) -> str:
        return f"{self.name} is off on torch {version} (it works from torch {self.since}): {self.without}"


FLIGHT_RECORDER = Feature(
    "the Flight Recorder of gloo's collectives (a hang's verdict from every rank's last collectives)",
    "2.8",
    "torch's Flight Recorder here is NCCL's only, so a gloo job's verdict comes from the ranks' stacks alone")


STORE_CLONE = Feature(
    "a private connection for the launchers' counters in the rendezvous store",
    "2.8",
    "torch's PrefixStore (the launchers' rendezvous store) cannot be reconnected before 2.8, so a counter there "
    "that another user who reaches the store spoils closes the launcher's connection to it (the in-process "
    "Wrapper's store, a plain TCPStore, gets a new client of its own)")


FSDP2_CPU = Feature(
    "FSDP2 (fully_shard) on CPU with gloo",
    "2.7",
    "fully_shard needs a GPU here (torch.cpu.Stream has no record_event); snapshots of DTensors still work")


@dataclass(frozen=True)
class FlightRecorder:
    """The names under which the installed torch's Flight Recorder is configured and read."""

    buffer_env: str
    """Entries each process keeps (0 or unset: off), read when a process group is made."""
    buffer_envs: tuple[str, ...]
    """Every name of the buffer's size some supported torch reads (one already set: the user's)."""
    dump_function: str
    """The name in ``torch._C._distributed_c10d`` that returns this process's trace as JSON."""
    records_gloo: bool


FR_BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_ENVS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""Where torch's watchdog writes a rank's dump (a prefix: torch appends the rank): torch's name from
2.8, NCCL's before (2.8 and later read it too). Both are always set, so that no torch writes to its
default /tmp/nccl_trace_rank_<rank>."""
MODERN_FR = FlightRecorder("TORCH_FR_BUFFER_SIZE", FR_BUFFER_ENVS, "_dump_fr_trace_json", True)
NCCL_FR = FlightRecorder("TORCH_NCCL_TRACE_BUFFER_SIZE", FR_BUFFER_ENVS, "_dump_nccl_trace_json", False)


def _c10d() -> Any:
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    return c10d


@functools.cache
def flight_recorder() -> FlightRecorder:
    """The installed torch's Flight Recorder names: torch's own from 2.8 (it has
    ``_dump_fr_trace_json``), NCCL's before."""
    c10d = _c10d()
    return MODERN_FR if c10d is None or hasattr(c10d, MODERN_FR.dump_function) else NCCL_FR


@functools.cache
def store_clone() -> bool:
    """torch's stores have ``clone()`` (a new connection to the same server and keys)."""
    try:
        from torch._C._distributed_c10d import Store
    except ImportError:
        return False
    return hasattr(Store, "clone")


def store_connection(store: Any) -> Any:
    """A new connection to ``store``'s server and keys, or None where there is none: ``clone()``
    where torch has it (from 2.8); before, a new client of a plain TCPStore. Raises what torch
    raises when the server cannot be reached."""
    if store_clone():
        return store.clone()
    from torch._C._distributed_c10d import TCPStore

    if type(store) is not TCPStore:
        return None
    server: Any = store  # torch's stubs name neither timeout nor libuvBackend
    return TCPStore(server.host, server.port, is_master=False, timeout=server.timeout, wait_for_workers=False,
                    use_libuv=server.libuvBackend)


@functools.cache
def group_abort() -> bool:
    """torch aborts a process group of any backend (``ProcessGroup.abort``, from 2.7); in 2.6 its
    ``_abort_process_group`` aborts NCCL's communicators only."""
    try:
        from torch._C._distributed_c10d import ProcessGroup
    except ImportError:
        return False
    return hasattr(ProcessGroup, "abort")


@functools.cache
def failures_list_stopped_workers() -> bool:
    """torch's failure table lists the workers it stopped after the first failure (from 2.10)."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    except ImportError:
        return False
    return hasattr(SubprocessContext, "_capture_process_failures")


@functools.cache
def fsdp2_on_cpu() -> bool:
    """torch's fully_shard can run on CPU (gloo): ``torch.cpu.Stream`` records events."""
    try:
        import torch
    except ImportError:
        return False
    return hasattr(getattr(getattr(torch, "cpu", None), "Stream", None), "record_event")


def version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def off() -> list[str]:
    """One line for each feature the installed torch lacks (empty on a torch that has them all)."""
    found = version()
    if found is None:
        return []
    checks = ((STORE_CLONE, store_clone()), (FSDP2_CPU, fsdp2_on_cpu()),
              (FLIGHT_RECORDER, flight_recorder().records_gloo))
    return [f.line(found) for f, present in checks if not present]
