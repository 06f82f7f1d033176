#!/usr/bin/env python3
"""Issue 28, across nodes: M simulated launchers (threads of this process) against ONE real
torch.distributed TCPStore (its own process), driving the launcher's own protocol code.

    bench/sim_nodes.py [--quick | --smoke] [--nodes 2,4,...,128] [--incidents K] [--stores tcp,etcd]
                       [--out FILE.json] [--plot DIR]

Each simulated node is what ft-launcher's agent is to the store, minus the processes:
its own TCPStore client, a rendezvous handler built the way torchrun builds it for
``--rdzv-backend c10d`` (`C10dRendezvousBackend` + `dynamic_rendezvous.create_handler`; the
store server is not any node's: ``is_host`` false) and torch's `_assign_worker_ranks`, a
WorkerGroup with the round's store, and the agent's `NodeMessages` (crossnode.py), a
`RollCaller` (rollcall.py, whose monitors are replaced by evidence returned after a set
delay: the seam is `RollCaller.local`) and the slow-rank exchange. Per incident:

1. a rank on node h hangs; the other nodes' ranks waiting for it time out 50-300 ms later
   (every other node; the rest keep running and answer from their monitor loop, every
   0.1 s): each reporting node runs `exchange_hang_records` + `decide.first_hang`;
2. the node that hung first takes the roll call (`RollCaller.run`), the victims answer it
   as hangs.py does (`answer_pending(wait=...)`), the others from their loop;
3. every node joins the next rendezvous round (`next_rendezvous` + `_assign_worker_ranks`,
   as the agent's `_rendezvous`), and with the new protocols `leave_round` tidies the last;
4. the slow-rank exchange, twice (the second is the steady state).

Every store operation of a node goes through a counting wrapper (operations and bytes, keys
and values both ways); the keys the protocols wrote in the incident's round are checked
afterwards (left), and the store's own count (`num_keys`) tells torch's keys from ours;
the store host's CPU comes from /proc/PID/stat. Then an idle spell: every node's monitor
loop (roll call polls, shutdown check) for a few seconds: store operations per second
while training runs.

``--protocols`` before,after: "before" is the code of commit BEFORE (755bffb, loaded from
git), "after" the working tree's; both run in the same invocation, side by side.

``--stores tcp,etcd`` (issue 43): each M also against a real etcd (tests/etcd.py's server, v2
API, started in a temporary folder): every node builds what torchrun builds for
``--rdzv-backend etcd-v2`` (torch's `create_backend`: one python-etcd client for the
rendezvous backend and the EtcdStore, the round's store a PrefixStore over it) and the same
incidents run through it; besides the store operations, each node's HTTP requests to etcd
are counted (its client's urllib3 pool), and the rendezvous round is etcd-v2's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from bench.sim_nodes_incident import run_nodes  # noqa: E402
from bench.sim_nodes_node import BEFORE, protocol_after, protocol_before  # noqa: E402
from bench.sim_nodes_report import plot, summarize, table  # noqa: E402


# -- bench/run.py's figures ------------------------------------------------------------
def figures(mode: Any) -> list[Any]:
    """For bench/run.py: this module in its own process (the harness process never imports
    torch), ``--smoke`` / ``--quick`` / full as run.py's mode; figures at the largest M run,
    before and after side by side."""
    import tempfile

    from bench.harness import Figure

    with tempfile.TemporaryDirectory(prefix="ftb-sim-") as d:
        out = Path(d) / "sim.json"
        flag = {"smoke": ["--smoke"], "quick": ["--quick"], "full": []}[mode.name]
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *flag, "--out", str(out)],
                              capture_output=True, text=True, timeout=3600, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"bench/sim_nodes.py failed: {proc.stderr[-2000:]}")
        result = json.loads(out.read_text())
    rows = [r for r in result["rows"] if r.get("store", "tcp") == "tcp"]  # the figures are TCPStore's
    top = max(r["nodes"] for r in rows)
    figs: list[Any] = []
    for proto in ("before", "after"):
        row = next((r for r in rows if r["protocol"] == proto and r["nodes"] == top), None)
        if row is None:
            continue
        count = len(next(x for x in result["runs"] if x["protocol"] == proto and x["nodes"] == top)["incidents"])
        details = {"how": f"bench/sim_nodes.py: {top} simulated nodes against one TCPStore, medians of "
                          f"{count} incidents", "rows": [r for r in rows if r["protocol"] == proto],
                   "loadavg": [result["loadavg_start"], result["loadavg_end"]]}
        p = f"scale.nodes.{proto}"
        figs += [
            Figure(f"{p}.roll_call_beyond_slowest", f"roll call complete beyond the slowest answer, M={top} ({proto})",
                   "s", [row["roll_call_beyond_slowest_s"]], target="<= 1 s", limit=1.0, details=details),
            Figure(f"{p}.hang_decision", f"hang-record exchange + first-hang decision, M={top} ({proto})", "s",
                   [row["hang_decision_s"]]),
            Figure(f"{p}.ops_per_node", f"store ops per node per incident, M={top} ({proto})", "ops",
                   [row["incident_ops_per_node"]]),
            Figure(f"{p}.idle_ops", f"store ops/s while training runs (all nodes), M={top} ({proto})", "ops/s",
                   [row["idle_ops_per_s"]]),
            Figure(f"{p}.step_ops", f"slow-rank exchange: store ops (all nodes), M={top} ({proto})", "ops",
                   [row["step_ops"]]),
            Figure(f"{p}.rendezvous", f"rendezvous round (torch c10d), M={top} ({proto})", "s", [row["rendezvous_s"]]),
            Figure(f"{p}.keys_left", f"our keys left in the store per incident, M={top} ({proto})", "keys",
                   value=row["keys_left_ours"], judge="value", target="0" if proto == "after" else "-",
                   limit=0 if proto == "after" else None),
            Figure(f"{p}.agreed", f"first hang agreed by all, every answer in (M={top}, {proto})", "bool",
                   value=row["all_agreed"] and row["all_answered"], met=row["all_agreed"] and row["all_answered"]),
        ]
    return figs

def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(nodes: list[int], incidents: int, ranks_per_node: int, idle_s: float, protocols: list[str],
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
        partial: Path | None = None, incidents_at: dict[int, int] | None = None,
        rendezvous: str = "c10d", stores: tuple[str, ...] = ("tcp",)) -> dict[str, Any]:
    """Every M, each store and both protocols side by side; a job that fails is recorded (its
    error) and the others go on; ``partial``: the JSON so far, rewritten after each job."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as ft-launcher sets it
    import logging

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("ft_monitor").setLevel(logging.ERROR)
    protos = []
    for name in protocols:
        p = protocol_before() if name == "before" else protocol_after()
        if p is not None:
            protos.append(p)
    runs = []
    load_start = loadavg()
    for m, store, p in ((m, store, p) for m in nodes for store in stores for p in protos):  # side by side
        t = time.monotonic()
        log(f"sim_nodes: M={m} {store} {p.name} ... (load {loadavg()})")
        try:
            r = run_nodes(m, p, (incidents_at or {}).get(m, incidents), ranks_per_node, idle_s,
                          rendezvous=rendezvous, store=store)
        except Exception as e:  # noqa: BLE001 - one M that the machine cannot host ends only its job
            log(f"sim_nodes: M={m} {store} {p.name} failed: {type(e).__name__}: {e}")
            runs.append({"nodes": m, "protocol": p.name, "store": store, "failed": f"{type(e).__name__}: {e}"[:2000],
                         "wall_s": time.monotonic() - t, "loadavg": loadavg()})
            continue
        r["wall_s"] = time.monotonic() - t
        r["loadavg"] = loadavg()
        runs.append(r)
        if partial is not None:
            partial.write_text(json.dumps({"runs": runs, "rows": [summarize(x) for x in runs if "failed" not in x]},
                                          indent=1, default=str) + "\n")
    rows = [summarize(r) for r in runs if "failed" not in r]
    return {"runs": runs, "rows": rows, "loadavg_start": load_start, "loadavg_end": loadavg(),
            "uptime": Path("/proc/uptime").read_text().split()[0], "before": BEFORE}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/sim_nodes.py", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="M up to 32, 2 incidents")
    size.add_argument("--smoke", action="store_true", help="M = 2, 1 incident (tests; figures meaningless)")
    p.add_argument("--nodes", default=None, help="comma-separated M values (default 2,4,...,128)")
    p.add_argument("--incidents", type=int, default=None)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--idle", type=float, default=None, help="seconds of idle monitor loops per M")
    p.add_argument("--protocols", default="before,after")
    p.add_argument("--rendezvous", choices=("c10d", "given"), default="c10d",
                   help="torch's dynamic rendezvous (default: c10d's, etcd-v2's on etcd), or none: each node's rank "
                        "given, as a static rendezvous")
    p.add_argument("--stores", default="tcp",
                   help="comma-separated: tcp (a TCPStore, torch's c10d backend), etcd (a real etcd the bench "
                        "starts, torch's etcd-v2 backend and EtcdStore)")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="folder for sim_nodes.png (default: none)")
    args = p.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    nodes = [int(x) for x in args.nodes.split(",")] if args.nodes else \
        {"full": [2, 4, 8, 16, 32, 64, 128], "quick": [2, 4, 8, 16, 32], "smoke": [2]}[mode]
    incidents = args.incidents or {"full": 3, "quick": 2, "smoke": 1}[mode]
    idle_s = args.idle if args.idle is not None else {"full": 6.0, "quick": 2.0, "smoke": 1.0}[mode]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"sim_nodes-{mode}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    at = {128: 2} if mode == "full" and args.incidents is None else None  # each 128-node round takes minutes here
    stores = tuple(args.stores.split(","))
    if set(stores) - {"tcp", "etcd"}:
        p.error(f"--stores: tcp or etcd, not {args.stores}")
    result = run(nodes, incidents, args.ranks_per_node, idle_s, args.protocols.split(","),
                 partial=out.with_suffix(".partial.json"), incidents_at=at, rendezvous=args.rendezvous,
                 stores=stores)
    result["rendezvous"] = args.rendezvous
    result["stores"] = list(stores)
    result["mode"] = mode
    text = table(result["rows"])
    print(text)
    for r in result["runs"]:
        if "failed" in r:
            print(f"\nM={r['nodes']} {r.get('store', 'tcp')} {r['protocol']}: failed after {r['wall_s']:.0f} s "
                  f"(load {r['loadavg']}): "
                  f"{r['failed'][:300]}")
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"sim_nodes: JSON written to {out}", file=sys.stderr)
    if args.plot:
        for f in plot(result["rows"], Path(args.plot), f"load {result['loadavg_start']} -> {result['loadavg_end']}"):
            print(f"sim_nodes: plot written to {f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
