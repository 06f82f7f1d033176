"""A simulated launcher of bench/sim_nodes.py, and the store protocols it drives: the working
tree's, or those of commit BEFORE loaded from git. A `SimNode` is what ft-launcher's agent is to
the store, minus the processes: its own TCPStore client and torch's c10d rendezvous handler
(or, on etcd, torch's etcd-v2 backend, its etcd client and EtcdStore, as torchrun builds them),
torch's `_assign_worker_ranks`, the agent's `NodeMessages` and a `RollCaller` whose monitors
answer with evidence after a set delay (the seam is `RollCaller.local`)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.sim_nodes_store import Counter, CountingBackend, CountingStore, count_requests

ROOT = Path(__file__).resolve().parent.parent

BEFORE = "755bffb"
"""The commit whose launcher protocols are the "before" rows (issue 28's starting point)."""
SECRET = b"sim-nodes-job-secret-0123456789abcdef"
RUN_ID = "sim"
STACK = "".join(f'  File "/job/train.py", line {100 + i} in layer_{i}\n' for i in range(24))
STACK = f"Thread 0x00007f0000000000 (most recent call first):\n{STACK}"


# -- the protocols: the working tree's, and BEFORE's from git ------------------------------
@dataclass
class Protocol:
    name: str
    node_messages: type
    roll_caller: type
    step_exchange: Callable[[SimNode, str, dict[int, float]], dict[int, float]]
    tidies: bool
    """Whether the node deletes its keys of the previous round (leave_round)."""


def _module(name: str, source: str, origin: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = origin
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(source, origin, "exec"), mod.__dict__)  # noqa: S102 - the project's own code at BEFORE
    return mod


LAUNCHER_ROOMS = {
    # where issue 40 moved the launcher's flat modules (docs/migration.md, its changelog)
    "store": ("store_auth", "store_board", "sealed", "step_exchange"),
    "rdzv": ("rdzv_delay", "static_rdzv"),
    "incident": ("diagnosis", "crash", "rootcause", "decide", "progress", "restarts", "rollcall_wire", "rollcall",
                 "crossnode"),
    "telemetry": ("events", "metrics", "metrics_http", "goodput", "summary_text", "torch_events", "slow_ranks",
                  "telemetry"),
    "warm": ("template_wire", "template", "forked", "template_fork", "warm"),
    "agent": ("agent", "hangs", "observed", "runtime", "worker_env", "secret_env", "monitors", "groups", "control",
              "inprocess", "inprocess_watch", "torch_support"),
}
CLIENT_MOVED = {
    # ft_client's modules that issue 40 moved into rooms (docs/migration.md, its changelog), as
    # the old launcher modules import them
    "client_link": "client.link", "client_state": "client.state", "client_progress": "client.progress",
    "client_learning": "client.learning", "client_restart": "client.restart", "control": "client.control",
    "exiting": "client.exiting", "stackdump": "client.stackdump", "flight_recorder": "client.flight_recorder",
    "wire_messages": "wire.messages", "wire_decode": "wire.decode", "transport": "wire.transport",
    "peer": "wire.peer", "record_open": "record.mapped", "record_read": "record.read",
    "timeouts_calc_compat": "learning.compat", "state_dict": "learning.state_dict", "sync": "learning.sync",
    "jobkey": "store.jobkey", "signed": "store.signed", "store_counter": "store.counter",
    "loaded_modules": "startup.loaded_modules", "parent_death": "startup.parent_death",
    "exit_teardown": "startup.exit_teardown",
}


def protocol_before(ref: str = BEFORE) -> Protocol | None:
    """The launcher's protocols as they were at ``ref`` (None where git cannot show them)."""

    def source(path: str) -> str:
        out = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise FileNotFoundError(out.stderr.strip())
        return out.stdout

    # At BEFORE the launcher was one flat folder: its modules are read from there, and while they
    # load, the names they import (ft_monitor.launcher.<module>) lead to where those modules live now.
    moved = {f"ft_monitor.launcher.{m}": f"ft_monitor.launcher.{room}.{m}" for room, mods in LAUNCHER_ROOMS.items()
             for m in mods if m not in LAUNCHER_ROOMS}  # agent, telemetry, warm: the packages keep those names
    moved |= {f"ft_client.{old}": f"ft_client.{new}" for old, new in CLIENT_MOVED.items()}
    saved = {old: sys.modules.get(old) for old in moved}
    try:
        now = {old: importlib.import_module(new) for old, new in moved.items()}
        sys.modules.update(now)
        def old(name: str) -> types.ModuleType:
            return _module(f"ft_sim_before.{name}", source(f"ft_monitor/launcher/{name}.py"), f"{ref}:{name}.py")

        wire_now = sys.modules["ft_monitor.launcher.rollcall_wire"]
        sys.modules["ft_monitor.launcher.rollcall_wire"] = old("rollcall_wire")  # the old roll call: the old wire
        rollcall = old("rollcall")
        sys.modules["ft_monitor.launcher.rollcall_wire"] = wire_now
        crossnode = old("crossnode")
        telemetry = old("telemetry")
    except (FileNotFoundError, OSError, subprocess.SubprocessError, ImportError) as e:
        print(f"sim_nodes: no 'before' protocols ({ref}): {e}", file=sys.stderr)
        return None
    finally:
        for old, module in saved.items():
            if module is None:
                sys.modules.pop(old, None)
            else:
                sys.modules[old] = module

    def step(node: SimNode, section: str, local: dict[int, float]) -> dict[int, float]:
        # Telemetry._exchange of BEFORE, on the state it keeps (no Telemetry needed)
        state = types.SimpleNamespace(job_secret=SECRET, monotonic=time.monotonic, _exchanged_at=-1e18,
                                      host=node.host, remote_medians={}, _bad_values=set())
        telemetry.Telemetry._exchange(state, node.wg, section, local)
        return dict(state.remote_medians)

    return Protocol("before", crossnode.NodeMessages, rollcall.RollCaller, step, tidies=False)


def protocol_after() -> Protocol:
    from ft_monitor.launcher.incident.crossnode import NodeMessages
    from ft_monitor.launcher.incident.rollcall import RollCaller
    from ft_monitor.launcher.store.step_exchange import exchange_step_times

    def step(node: SimNode, section: str, local: dict[int, float]) -> dict[int, float]:
        medians, listed = exchange_step_times(node.wg.store, node.channel, node.wg.group_rank,
                                              node.wg.group_world_size, section, local, node.host, set(),
                                              listed=node.step_listed is node.wg)
        node.step_listed = node.wg if listed else None  # as Telemetry keeps it, per round
        return medians

    return Protocol("after", NodeMessages, RollCaller, step, tidies=True)


def sim_roll_caller(base: type, host: str, delay: float, timeout: float) -> Any:
    """``base`` (a RollCaller) whose monitors are evidence returned after ``delay`` seconds."""
    from ft_monitor.launcher.incident.diagnosis import ANSWERED, RankEvidence
    from ft_monitor.launcher.store.sealed import Sealer

    class SimRollCaller(base):  # type: ignore[valid-type, misc]
        def local(self, ranks: list[Any], incident: int, budget: float) -> list[Any]:
            time.sleep(max(0.0, min(delay, budget)))
            return [RankEvidence(r.global_rank, host, ANSWERED, r.local_rank, r.pid, "step", 100, STACK)
                    for r in ranks]

    return SimRollCaller(lambda lr: Path("/nonexistent"), host, timeout, False, sealer=Sealer(SECRET))



# -- a simulated node ---------------------------------------------------------------
class SimNode:
    def __init__(self, index: int, nodes: int, ranks_per_node: int, port: int, proto: Protocol,
                 timeout: float, rendezvous: str = "c10d", etcd: str | None = None) -> None:
        """``etcd``: the endpoint of the etcd that is the store (torch's etcd-v2 backend and its
        EtcdStore), instead of the TCPStore at ``port``."""
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        self.index = index
        self.host = f"node{index:03d}"
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.proto = proto
        self.counter = Counter()
        self.rdzv_counter = Counter()
        self.delay = 0.05 + 0.15 * ((index * 37) % nodes) / nodes
        """The simulated monitors' answer time (a stack dump): 50-200 ms."""
        self.requests = Counter()
        """On etcd: the HTTP requests of this node's etcd client (torch's and ours), by method."""
        if etcd is None:
            self.client: Any = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                        timeout=timedelta(seconds=60))
            params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=RUN_ID,
                                          min_nodes=nodes, max_nodes=nodes, local_addr=self.host, is_host=False,
                                          join_timeout=600)
            # what c10d_rendezvous_backend.create_backend + registry do, with the backend's store counted
            backend: Any = C10dRendezvousBackend(CountingStore(self.client, self.rdzv_counter), RUN_ID)
        else:
            from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

            from ft_monitor.launcher.store.store_board import read_etcd_folder_once

            read_etcd_folder_once()  # as ft-launcher does on an etcd rendezvous
            params = RendezvousParameters(backend="etcd-v2", endpoint=etcd, run_id=RUN_ID, min_nodes=nodes,
                                          max_nodes=nodes, local_addr=self.host, join_timeout=600)
            # what the registry does for --rdzv-backend etcd-v2: one etcd client for the backend and the store
            etcd_backend, self.client = create_backend(params)
            count_requests(self.client.client, self.requests)
            backend = CountingBackend(etcd_backend, self.rdzv_counter)
        self.handler = create_handler(self.client, backend, params)
        self.rdzv = rendezvous
        """``c10d``: torch's dynamic rendezvous (over the c10d backend, or etcd-v2 on etcd); ``given``:
        none, each node's rank given (as torch's static rendezvous does), under the same per-round
        store prefix as the dynamic one's."""
        self.messages = proto.node_messages(SECRET)
        self.rollcall = sim_roll_caller(proto.roll_caller, self.host, self.delay, timeout)
        self.wg: Any = None
        self.round_stores: list[Any] = []
        self.written: set[str] = set()
        self.round_written: list[set[str]] = []
        """The keys this node wrote in each round (the protocols' and torch's rank assignment)."""
        self.channel: Any = None
        self.step_listed: Any = None
        self.rounds = 0

    def rendezvous(self) -> None:
        """The agent's _rendezvous: torch's next_rendezvous and _assign_worker_ranks, then ours."""
        from torch.distributed import PrefixStore
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

        from ft_monitor.launcher.rdzv.rounds import rendezvous_round

        previous = self.wg
        if self.rdzv == "c10d":
            info = self.handler.next_rendezvous()
        else:
            info = types.SimpleNamespace(store=PrefixStore(f"torch.rendezvous.{RUN_ID}.{self.rounds}", self.client),
                                         rank=self.index, world_size=self.nodes)
        spec = WorkerSpec(role="trainer", local_world_size=self.ranks_per_node, rdzv_handler=self.handler,
                          entrypoint="sim")
        self.written = set()
        store = CountingStore(info.store, self.rdzv_counter)  # torch's keys: not counted as ours
        workers = SimpleElasticAgent._assign_worker_ranks(None, store, info.rank, info.world_size, spec)  # type: ignore[arg-type]
        self.rounds += 1
        self.wg = types.SimpleNamespace(store=CountingStore(info.store, self.counter, self.written), spec=spec,
                                        group_rank=info.rank, group_world_size=info.world_size, workers=workers)
        self.round_stores.append(info.store)
        if previous is not None and self.proto.tidies:
            self.messages.leave_round(CountingStore(previous.store.inner, self.counter), previous.group_rank,
                                      self.rollcall.written)
        self.rollcall.new_round(rendezvous_round(self.handler, self.rounds - 1) if self.rdzv == "c10d"
                                else self.rounds - 1)
        self.channel = self.messages.channel(self.wg)

    def ranks(self) -> list[Any]:
        from ft_monitor.launcher.incident.rollcall import Rank

        return [Rank(w.global_rank, w.local_rank, 100000 + w.global_rank) for w in self.wg.workers]

    def close(self) -> None:
        if self.rdzv == "c10d":
            self.handler._stop_heartbeats()

