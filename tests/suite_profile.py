"""Where the suite's time and CPU go: a pytest plugin that records, for every test, its wall
time and the CPU it cost (this process's user+system time and that of every child process it
waited for, grandchildren included, from getrusage), phase by phase.

    FT_TEST_PROFILE=/tmp/prof scripts/test          # one JSON file per xdist worker there
    .venv/bin/python -m tests.suite_profile /tmp/prof  # the tables of docs/testing.md

The rusage of children counts only those reaped: a process a test leaves running is not
counted (and the leak check says so). The numbers are a sampler's, not a benchmark's: the
suite runs four tests at once on two cores, so a test's wall time holds its neighbours' too.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

ENV = "FT_TEST_PROFILE"


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Profiler:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict[str, Any]] = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        wall0, cpu0, start = time.monotonic(), _cpu(), time.time()
        try:
            return (yield)
        finally:
            self.rows.append({"nodeid": item.nodeid, "file": item.nodeid.split("::", 1)[0],
                              "wall": time.monotonic() - wall0, "cpu": _cpu() - cpu0,
                              "e2e": item.get_closest_marker("e2e") is not None, "start": start,
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")})

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (self.out / f"{worker}.json").write_text(json.dumps(self.rows))


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get(ENV)
    if out:
        config.pluginmanager.register(Profiler(Path(out)), "ft-suite-profile")


def tables(folder: Path, top: int = 40) -> str:
    rows = _rows(folder)
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        f = per_file[r["file"]]
        f[0] += 1
        f[1] += r["wall"]
        f[2] += r["cpu"]
    wall = sum(r["wall"] for r in rows)
    cpu = sum(r["cpu"] for r in rows)
    e2e = [r for r in rows if r["e2e"]]
    out = [f"{len(rows)} tests: {wall:.0f} s of test wall time (summed over workers), {cpu:.0f} s CPU; "
           f"e2e: {len(e2e)} tests, {sum(r['wall'] for r in e2e):.0f} s wall, {sum(r['cpu'] for r in e2e):.0f} s CPU",
           "", "| file | tests | wall s | CPU s |", "|---|---:|---:|---:|"]
    for name, (n, w, c) in sorted(per_file.items(), key=lambda kv: -kv[1][2]):
        out.append(f"| {name} | {n:.0f} | {w:.1f} | {c:.1f} |")
    out += ["", f"| the {top} slowest tests (wall) | wall s | CPU s |", "|---|---:|---:|"]
    for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
        out.append(f"| {r['nodeid']} | {r['wall']:.1f} | {r['cpu']:.1f} |")
    return "\n".join(out)


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [r for p in sorted(folder.glob("*.json")) for r in json.loads(p.read_text())]


def _kinds(sampled: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A sampler's totals with every launcher in one row (older samples named a launcher run
    as ``python .../bin/ft-launcher`` by its path)."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in sampled.items():
        name = "launcher" if k.endswith(("/ft-launcher", "/ft_launcher")) else k
        row = out.setdefault(name, {"processes": 0, "cpu": 0.0})
        row["processes"] += v["processes"]
        row["cpu"] += v["cpu"]
    return out


def compare(before: Path, after: Path, top: int = 40, files: int = 20) -> str:
    """Before and after side by side: per file (the ``files`` heaviest in CPU before), the ``top``
    slowest tests of each run, and, where both folders hold a sampler's ``cpu.json``, CPU by
    process kind."""
    b, a = _rows(before), _rows(after)

    def per_file(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for r in rows:
            f = out[r["file"].rsplit("/", 1)[-1]]
            f[0] += 1
            f[1] += r["wall"]
            f[2] += r["cpu"]
        return out

    fb, fa = per_file(b), per_file(a)
    out = ["| file | tests | wall s before | wall s after | CPU s before | CPU s after |",
           "|---|---:|---:|---:|---:|---:|"]
    for name in sorted(fb, key=lambda n: -fb[n][2])[:files]:
        x, y = fb[name], fa.get(name, [0.0, 0.0, 0.0])
        out.append(f"| {name} | {x[0]:.0f} -> {y[0]:.0f} | {x[1]:.0f} | {y[1]:.0f} | {x[2]:.0f} | {y[2]:.0f} |")

    def total(rows: list[dict[str, Any]], key: str) -> float:
        return float(sum(r[key] for r in rows))

    out.append(f"| **all {len(fb)} -> {len(fa)} files** | {len(b)} -> {len(a)} | {total(b, 'wall'):.0f} | "
               f"{total(a, 'wall'):.0f} | {total(b, 'cpu'):.0f} | {total(a, 'cpu'):.0f} |")
    for label, rows in (("before", b), ("after", a)):
        out += ["", f"The {top} slowest tests {label}:", "", "| test | wall s | CPU s |", "|---|---:|---:|"]
        for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
            out.append(f"| {r['nodeid'].removeprefix('tests/')} | {r['wall']:.1f} | {r['cpu']:.1f} |")
    sb, sa = before / "cpu.json.sample", after / "cpu.json.sample"
    if sb.exists() and sa.exists():
        kb, ka = _kinds(json.loads(sb.read_text())), _kinds(json.loads(sa.read_text()))
        out += ["", "| process (by command line) | processes before | CPU s before | processes after | CPU s after |",
                "|---|---:|---:|---:|---:|"]
        zero = {"processes": 0, "cpu": 0.0}
        for k in sorted(set(kb) | set(ka), key=lambda k: -max(kb.get(k, zero)["cpu"], ka.get(k, zero)["cpu"])):
            p, q = kb.get(k, zero), ka.get(k, zero)
            if max(p["cpu"], q["cpu"]) >= 5:
                out.append(f"| {k} | {p['processes']} | {p['cpu']:.0f} | {q['processes']} | {q['cpu']:.0f} |")
        out.append(f"| **all** | {sum(v['processes'] for v in kb.values())} | {sum(v['cpu'] for v in kb.values()):.0f} | "
                   f"{sum(v['processes'] for v in ka.values())} | {sum(v['cpu'] for v in ka.values()):.0f} |")
    return "\n".join(out)


def kind(cmdline: list[str]) -> str:
    """What a process is, from its command line: the categories of the CPU table."""
    if not cmdline:
        return "? (gone)"
    exe = cmdline[0].rsplit("/", 1)[-1]
    args = [a for a in cmdline[1:] if a not in ("-u", "-B", "-I")]
    if not exe.startswith("python") and exe not in ("ft-launcher", "ft_launcher", "ft-monitor"):
        return exe
    first = args[1] if args[:1] == ["-m"] and len(args) > 1 else args[0] if args else ""
    if exe in ("ft-launcher", "ft_launcher") or first == "ft_monitor.launcher.main" \
            or first.endswith(("/ft-launcher", "/ft_launcher")):
        return "launcher"
    if exe == "ft-monitor" or first == "ft_monitor.cli":
        return "monitor"
    if first == "ft_monitor.launcher.warm.template":
        return "template"
    if first in ("torch.distributed.run", "torchrun"):
        return "torchrun"
    if "xdist" in " ".join(args) or first == "pytest":
        return "pytest"
    if first.startswith(("examples/", "tests/", "bench/")) or "/examples/" in first or "/tests/" in first \
            or "/bench/" in first:
        part = first.split("/examples/")[-1].split("/tests/")[-1].split("/bench/")[-1]
        where = "examples" if "examples" in first else "bench" if "bench" in first else "tests"
        return f"{where}/{part.rsplit('/', 1)[-1]}"
    if first == "-c":
        return "python -c"
    return "python " + first[:40]


def sample(out: Path, interval: float = 0.05) -> None:
    """Until SIGTERM: every process's CPU (utime+stime) by its command line, sampled every
    ``interval`` s; what it last had is its total (a process shorter than ``interval`` is missed)."""
    import signal

    tick = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[int, int], tuple[str, float]] = {}
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    me = os.getpid()
    before: dict[tuple[int, int], float] = {}  # the CPU of processes already running at the start: not counted
    first = True
    while not stop:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                key = (int(entry), int(fields[19]))
                cpu = (int(fields[11]) + int(fields[12])) / tick
                if first:
                    before[key] = cpu
                if key not in seen:
                    with open(f"/proc/{entry}/cmdline", "rb") as raw:
                        cmd = [a.decode(errors="replace") for a in raw.read().split(b"\0") if a]
                    seen[key] = (kind(cmd), cpu)
                else:
                    seen[key] = (seen[key][0], cpu)
            except (OSError, IndexError, ValueError):
                continue
        first = False
        time.sleep(interval)
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for key, (name, cpu) in seen.items():
        totals[name][0] += key not in before
        totals[name][1] += cpu - before.get(key, 0.0)
    out.write_text(json.dumps({k: {"processes": v[0], "cpu": v[1]} for k, v in totals.items()}))


if __name__ == "__main__":
    if sys.argv[1] == "sample":
        sample(Path(sys.argv[2]))
    elif sys.argv[1] == "compare":
        print(compare(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 40))
    else:
        print(tables(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40))
