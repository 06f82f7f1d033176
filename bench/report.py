"""What a benchmark run reports beside its figures: the machine it ran on and the markdown table
of its figures. `bench/run.py` (the whole set) and `bench/snapshot.py` (run alone) both print
and save them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT, Figure


# -- machine ---------------------------------------------------------------------
def machine_info(loops: list[str]) -> dict[str, Any]:
    from importlib import metadata

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "torch": version("torch"),  # from package metadata: importing torch here would skew nothing but time
        "uvloop": version("uvloop"),
        "msgpack": version("msgpack"),
        "pydantic": version("pydantic"),
        "kernel": platform.release(),
        "loop": loops[0],
        "loops": loops,
        "loadavg_start": loadavg(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": _git_dirty(),
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git(*args: str) -> str | None:
    try:  # read-only; --no-optional-locks: never touch the index
        out = subprocess.run(["git", "--no-optional-locks", *args], capture_output=True, text=True, cwd=ROOT,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_dirty() -> bool | None:
    out = git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out)


# -- table -----------------------------------------------------------------------
def markdown_table(figures: list[Figure]) -> str:
    rows = ["| what | median | p99 | min-max | target | met? |", "|---|---|---|---|---|---|"]
    for f in figures:
        s = f.stats()
        what = f.what + (f" [{f.loop}]" if f.loop else "")
        if s["n"]:
            med, p99 = _fmt(s["median"], f.unit), _fmt(s["p99"], f.unit)
            rng = f"{_fmt(s['min'], f.unit)}-{_fmt(s['max'], f.unit)}"
            if s["n"] == 1:
                p99 = rng = "-"
        else:
            med, p99, rng = str(f.value), "-", "-"
        met = f.verdict()
        rows.append(f"| {what} | {med} | {p99} | {rng} | {f.target} | "
                    f"{'-' if met is None else 'yes' if met else '**NO**'} |")
    return "\n".join(rows)


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ev/s":
        return f"{v / 1000:.0f}k ev/s"
    if unit == "us":
        return f"{v:.2f} us" if v < 100 else f"{v:.0f} us"
    if unit == "ms":
        return f"{v:.1f} ms"
    if unit == "s":
        return f"{v:.2f} s"
    if unit == "MB":
        return f"{v:.1f} MB"
    if unit == "%":
        return f"{v:.2f}%"
    return f"{v:g} {unit}".strip()



def write_standalone(name: str, mode: str, loop: str, started: float, t0: float, machine: dict[str, Any],
                     figures: list[Figure], plan: Any, out: str | None) -> None:
    """A bench module run on its own (``bench/snapshot.py``, ``bench/fsdp2_snapshot.py``): the
    table on stdout and the same JSON as `bench/run.py` writes, at ``out`` or
    ``bench/results/NAME-MODE-TIME.json``."""
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    table = markdown_table(figures)
    print(table)
    took = round(time.monotonic() - t0, 2)
    result = {"schema": 1, "mode": mode, "loop": loop, "loops": [loop],
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)), "duration_s": took,
              "benchmark_seconds": {name: took}, "machine": machine, "figures": [f.to_json() for f in figures],
              "table": table, "plan": plan}
    path = Path(out) if out else ROOT / "bench" / "results" / \
        f"{name}-{mode}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nbench: {len(figures)} figures in {took:.0f} s; JSON written to {path}", file=sys.stderr)
