"""What bench/sim_nodes.py makes of its runs: one row of medians per M, store and protocol, the
markdown table, and the curves against M (docs/images/sim_nodes.png)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _median(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    inc = run["incidents"]
    m = run["nodes"]
    row = {"protocol": run["protocol"], "store": run.get("store", "tcp"), "nodes": m,
           "first_rendezvous_s": run.get("first_rendezvous_s")}
    for key in ("hang_decision_s", "roll_call_s", "roll_call_beyond_slowest_s", "rendezvous_s", "step_exchange_s",
                "incident_ops", "incident_bytes", "tidy_ops", "rendezvous_ops", "rendezvous_bytes", "step_ops",
                "step_ops_first", "step_bytes", "keys_left_ours", "keys_added_total", "store_cpu_s",
                "incident_requests", "rendezvous_requests", "rendezvous_response_bytes"):
        row[key] = _median(i.get(key) for i in inc)
    for key in ("incident_ops", "incident_bytes", "incident_requests"):
        row[f"{key}_per_node"] = row[key] / m if row[key] is not None else None
    row["all_agreed"] = all(i["agreed"] and i["owners"] == 1 for i in inc)
    row["all_answered"] = all(i["answered_nodes"] == m and i["missing_ranks"] == 0 for i in inc)
    row["errors"] = sum(len(i["errors"]) for i in inc)
    idle_ = run.get("idle") or {}
    row["idle_ops_per_s"] = idle_.get("ops_per_s")
    row["idle_ops_per_s_per_node"] = idle_.get("ops_per_s_per_node")
    row["idle_store_cpu_share"] = idle_.get("store_cpu_share")
    row["idle_torch_ops_per_s"] = idle_.get("torch_ops_per_s")
    row["idle_torch_bytes_per_s"] = idle_.get("torch_bytes_per_s")
    row["idle_requests_per_s"] = idle_.get("requests_per_s")
    return row


COLUMNS = [("protocol", "protocol", "{}"), ("store", "store", "{}"), ("nodes", "M", "{}"),
           ("hang_decision_s", "hang+decision s", "{:.3f}"),
           ("roll_call_beyond_slowest_s", "roll call beyond slowest s", "{:.3f}"),
           ("step_exchange_s", "slow-rank exch. s", "{:.3f}"), ("first_rendezvous_s", "first rdzv s", "{:.3f}"),
           ("rendezvous_s", "rendezvous s", "{:.3f}"),
           ("incident_ops_per_node", "ops/node/incident", "{:.0f}"),
           ("incident_requests_per_node", "etcd req/node/incident", "{:.0f}"),
           ("incident_bytes_per_node", "bytes/node/incident", "{:.0f}"), ("step_ops", "step-exch. ops", "{:.0f}"),
           ("rendezvous_ops", "rdzv ops", "{:.0f}"), ("rendezvous_requests", "rdzv etcd req", "{:.0f}"),
           ("keys_left_ours", "our keys left", "{:.0f}"),
           ("keys_added_total", "keys added (all)", "{:.0f}"), ("store_cpu_s", "store CPU s/incident", "{:.3f}"),
           ("idle_ops_per_s", "idle ops/s", "{:.0f}"), ("idle_torch_ops_per_s", "idle torch ops/s", "{:.0f}"),
           ("idle_requests_per_s", "idle etcd req/s", "{:.0f}"),
           ("idle_store_cpu_share", "idle store CPU", "{:.1%}"),
           ("all_agreed", "agreed", "{}"), ("all_answered", "all answered", "{}")]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = r.get(key)
            cells.append("-" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], directory: Path, load: str) -> list[str]:
    """Curves against M, before and after: one PNG of four panels. The file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("incident_ops_per_node", "store ops per node per incident"),
              ("idle_ops_per_s", "store ops/s while training runs (all nodes)"),
              ("roll_call_beyond_slowest_s", "roll call: s beyond the slowest answer"),
              ("hang_decision_s", "hang exchange + first-hang decision, s"),
              ("step_ops", "slow-rank exchange: ops (all nodes)"),
              ("rendezvous_s", "rendezvous round (torch's c10d or etcd-v2), s")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    stores = sorted({r.get("store", "tcp") for r in rows}, reverse=True)  # tcp, then etcd
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for (proto, style), store in ((p, s) for p in (("before", "o--"), ("after", "s-")) for s in stores):
            pts = sorted((r["nodes"], r[key]) for r in rows
                         if r["protocol"] == proto and r.get("store", "tcp") == store and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style if store == "tcp" else style[0] + ":",
                        label=proto if stores == ["tcp"] else f"{proto}, {store}")
        ax.set_xscale("log", base=2)
        if key in ("incident_ops_per_node", "idle_ops_per_s", "step_ops"):
            ax.set_yscale("log")
        ax.set_xlabel("simulated nodes M")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    against = "one TCPStore" if stores == ["tcp"] else "one TCPStore (c10d) or one etcd (etcd-v2)"
    fig.suptitle(f"ft-launcher's store protocols against {against}, M simulated nodes (issue 28; {load})",
                 fontsize=11)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sim_nodes.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [str(path)]

