"""bench/sim_inprocess.py's harness side: the simulation's worker processes (this tree's
ft_client, or an older revision's from ``git archive``), N after N in turns, and the medians
of each N's incidents."""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import ROOT, end_by_stdin


class Worker:
    """A `worker` process: ft_client from ``tree`` (an older checkout) or this tree."""

    def __init__(self, ranks: int, tree: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "TORCHELASTIC_"))}
        env["PYTHONPATH"] = os.pathsep.join([*([str(tree)] if tree else []), str(ROOT)])
        env["FT_SIM_CHILD"] = "1"
        if os.environ.get("FT_SIM_SWITCH_INTERVAL"):
            env["FT_SIM_SWITCH_INTERVAL"] = os.environ["FT_SIM_SWITCH_INTERVAL"]
        self.log = tempfile.TemporaryFile("w+")  # torch's warnings: a pipe could fill up
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.sim_inprocess", "--worker", str(ranks)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=str(tree or ROOT))

    def recv(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the simulation worker gave no answer within {timeout:g} s (exit code "
                               f"{self.proc.poll()}): {self.log.read()[-3000:]}")
        return json.loads(line)  # type: ignore[no-any-return]

    def measure(self, n: int, incidents: int, timeout: float = 1800.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n} {incidents}\n")
        self.proc.stdin.flush()
        return self.recv(timeout)

    def close(self) -> None:
        end_by_stdin(self.proc, 60)
        self.log.close()


def baseline_tree(rev: str) -> Path:
    """ft_client as of ``rev``, in a temporary directory."""
    d = Path(tempfile.mkdtemp(prefix="ft-sim-base-"))
    archive = subprocess.run(["git", "--no-optional-locks", "archive", rev, "ft_client"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
    return d


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the incidents of one N."""
    rows = result["incidents"]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    out = {k: med(k) for k in ("notify_ms", "barrier_ms", "barrier_span_ms", "total_ms", "calls", "calls_per_rank",
                               "calls_busiest_rank", "bytes", "bytes_per_rank", "server_cpu_s",
                               "server_wire_bytes")}
    out.update(n=result["n"], keys_held=max(r["keys_held"] for r in rows), keys_past=max(r["keys_past"] for r in rows),
               keys_growth=max(r["keys_growth"] for r in rows[1:]) if len(rows) > 1 else rows[0]["keys_growth"],
               quiet_calls=max(q["calls"] for q in result["quiet"]),
               quiet_server_cpu_ms=max(q["server_cpu_s"] for q in result["quiet"]) * 1000,
               floor_ms=statistics.median(result["floor_ms"]),
               rss_per_rank_kb=result["rss_per_rank_kb"], server_rss_per_rank_kb=result["server_rss_per_rank_kb"],
               calls_by_op=rows[-1]["calls_by_op"], keys_held_names=rows[-1]["keys_held_names"])
    return out



def sweep(ns: list[int], incidents: int, baseline: str | None, old_incidents: int | None = None,
          old_max: int | None = None, progress: Any = None) -> list[dict[str, Any]]:
    """Every N (old then new where a baseline is named: one worker process each, both
    connected first, then taking turns N by N; the old one up to ``old_max`` ranks).
    ``progress(rows)`` after each N; a simulation that fails is reported and ends its
    protocol's sweep (the other goes on)."""
    trees: list[tuple[str, Path | None, int]] = [("new" if baseline else "this", None, max(ns))]
    if baseline:
        trees.insert(0, (f"old ({baseline[:10]})", baseline_tree(baseline), min(max(ns), old_max or max(ns))))
    workers = {name: (Worker(top, tree), top) for name, tree, top in trees}
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    try:
        for name, (w, top) in workers.items():
            print(f"sim_inprocess: {name}: {2 * top} connections in "
                  f"{w.recv(3600)['connect_s']:.0f} s", file=sys.stderr, flush=True)
        for n in ns:
            for name, (w, top) in workers.items():
                if n > top or name in failed:
                    continue
                k = old_incidents if old_incidents and name.startswith("old") else incidents
                print(f"sim_inprocess: N = {n} ({name}, {k} incidents) ...", file=sys.stderr, flush=True)
                try:
                    raw = w.measure(n, k)
                except RuntimeError as e:
                    failed[name] = f"N = {n}: {str(e)[-500:]}"
                    print(f"sim_inprocess: {name} failed at {failed[name]}", file=sys.stderr, flush=True)
                    continue
                rows.append({"protocol": name, **summary(raw), "raw": raw})
            if progress is not None:
                progress(rows)
    finally:
        for w, _ in workers.values():
            w.close()
    return rows
