"""Figure 3: what importing the client costs a training process.

Each run is a fresh interpreter (`python -c`) that times, with
time.perf_counter_ns inside the process, ``import ft_client`` and then
``from ft_client import RankMonitorClient`` (the first use, which loads the
client module), and reports whether torch, asyncio or pydantic got imported.
"""

from __future__ import annotations

import json
import subprocess

from bench.harness import PY, ROOT, Figure, Mode, clean_env

TARGET_MS = 30.0
HEAVY = ("torch", "asyncio", "pydantic")

_PROBE = """
import sys, time, json
c0 = time.process_time_ns()
t0 = time.perf_counter_ns()
import ft_client
t1 = time.perf_counter_ns()
after_pkg = {m: m in sys.modules for m in %r}
from ft_client import RankMonitorClient
t2 = time.perf_counter_ns()
c2 = time.process_time_ns()
after_client = {m: m in sys.modules for m in %r}
print(json.dumps({"pkg_ns": t1 - t0, "client_ns": t2 - t0, "client_cpu_ns": c2 - c0, "after_pkg": after_pkg,
                  "after_client": after_client}))
""" % (HEAVY, HEAVY)


def run(mode: Mode) -> list[Figure]:
    runs = mode.pick(30, 10, 3)
    pkg, client, client_cpu = [], [], []
    heavy: dict[str, bool] = {m: False for m in HEAVY}
    for _ in range(runs):
        out = subprocess.run([PY, "-c", _PROBE], capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                             timeout=60, check=True)
        r = json.loads(out.stdout)
        pkg.append(r["pkg_ns"] / 1e6)
        client.append(r["client_ns"] / 1e6)
        client_cpu.append(r["client_cpu_ns"] / 1e6)
        for m, v in r["after_client"].items():
            heavy[m] |= v
    imported = [m for m, v in heavy.items() if v]
    how = f"{runs} fresh interpreters, timed inside the process"
    return [
        Figure(id="import.ft_client", what="import ft_client", unit="ms", samples=pkg,
               target=f"<= {TARGET_MS:g} ms", limit=TARGET_MS, details={"how": how}),
        Figure(id="import.client", what="import ft_client + RankMonitorClient", unit="ms", samples=client,
               target=f"<= {TARGET_MS:g} ms", limit=TARGET_MS, details={"how": how}),
        Figure(id="import.client_cpu", what="import ft_client + RankMonitorClient, CPU time", unit="ms",
               samples=client_cpu, details={"how": how + "; time.process_time_ns(): what a busy machine's "
                                                         "preemptions do not inflate"}),
        Figure(id="import.heavy", what="torch/asyncio/pydantic imported by the client", unit="",
               value=", ".join(imported) or "none", target="none", met=not imported, details=heavy),
    ]
