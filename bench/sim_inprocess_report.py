"""What bench/sim_inprocess.py shows of its rows: the markdown table and the curves against N
(docs/images/sim_inprocess.png), with issue 28's targets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TARGETS = {"notify_ms": 50.0, "barrier_ms": 200.0, "total_ms": 500.0}
"""At N = 1,024 (issue 28)."""

COLUMNS = (("N", "n", "{:.0f}"), ("notify ms", "notify_ms", "{:.1f}"), ("fan-out ms", "floor_ms", "{:.1f}"),
           ("barrier ms", "barrier_ms", "{:.1f}"), ("span ms", "barrier_span_ms", "{:.1f}"),
           ("total ms", "total_ms", "{:.1f}"), ("calls", "calls", "{:.0f}"), ("calls/rank", "calls_per_rank", "{:.2f}"),
           ("busiest", "calls_busiest_rank", "{:.0f}"), ("bytes/rank", "bytes_per_rank", "{:.0f}"),
           ("store CPU ms", "server_cpu_s", "{:.0f}"), ("keys held", "keys_held", "{:.0f}"),
           ("of past iterations", "keys_past", "{:.0f}"),
           ("keys +/incident", "keys_growth", "{:.0f}"), ("quiet calls", "quiet_calls", "{:.0f}"),
           ("RSS/rank KiB", "rss_per_rank_kb", "{:.0f}"))


def table(rows: list[dict[str, Any]]) -> str:
    head = ["protocol", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["protocol"]]
        for _, k, fmt in COLUMNS:
            v = r[k] * 1000 if k == "server_cpu_s" else r[k]
            cells.append(fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    styles = {p: s for p, s in zip(protocols, ("--", "-"), strict=False)} if len(protocols) > 1 else {protocols[0]: "-"}
    panels = (
        (axes[0][0], "time per incident (ms)", (("notify_ms", "fault -> every rank notified"),
                                                ("barrier_ms", "barrier (last in -> last out)"),
                                                ("total_ms", "total store protocol"),
                                                ("floor_ms", "store fan-out: one set, N waiters"))),
        (axes[0][1], "store calls per rank per incident", (("calls_per_rank", "mean"),
                                                           ("calls_busiest_rank", "busiest rank"))),
        (axes[1][0], "payload bytes per rank per incident", (("bytes_per_rank", "keys + values"),)),
        (axes[1][1], "store host CPU per incident (ms)", (("server_cpu_s", "TCPStore server process"),)),
    )
    for ax, label, series in panels:
        for i, (k, name) in enumerate(series):
            for p in protocols:
                mine = sorted((r for r in rows if r["protocol"] == p), key=lambda r: r["n"])
                ys = [r[k] * (1000 if k == "server_cpu_s" else 1) for r in mine]
                ax.plot([r["n"] for r in mine], ys, styles[p], color=f"C{i}", marker="o", markersize=3,
                        label=f"{name} ({p})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].axhline(TARGETS["notify_ms"], color="grey", lw=0.8, ls=":")
    axes[0][0].axhline(TARGETS["total_ms"], color="grey", lw=0.8, ls=":")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

