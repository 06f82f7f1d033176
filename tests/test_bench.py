"""bench/ stays runnable: `bench/run.py --smoke` runs every benchmark with minimal
iterations against real processes and writes the JSON the full set writes.
Nothing here asserts on the figures themselves (those are for bench/, not tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import Figure, summarize
from bench.report import markdown_table
from tests import zygote
from tests.procs import ROOT, slack

FIGURE_KEYS = {"id", "what", "loop", "unit", "n", "median", "p99", "min", "max", "percentiles", "value", "target",
               "met", "details"}
MACHINE_KEYS = {"cpu_model", "cores", "python", "torch", "loop", "loops", "uvloop", "msgpack", "kernel"}
EXPECTED_IDS = {  # the figures each group of benchmarks writes (bench/run.py --only GROUP)
    "import_time,startup,stalled,ingest": {
        "import.ft_client", "import.client", "import.client_cpu", "import.heavy", "daemon.ready", "daemon.ready_cpu",
        "daemon.rss_ready", "daemon.no_torch", "daemon.rss_after_events", "daemon.rss_growth",
        "stalled.call", "stalled.not_blocked", "ingest.one", "ingest.one.no_loss", "ingest.pairs", "ingest.pairs.no_loss",
    },
    "client_cost": set(),  # checked by CLIENT_KEYS
    "detection,idle_cpu": {
        *(f"detect.{p}.{k}.{v}" for p in ("record", "socket") for k in ("heartbeat", "section", "out_of_section")
          for v in ("default", "no_dump", "daemon")),
        "idle.record.tick25ms", "idle.record.tick1ms", "idle.socket",
    },
    "restart": {
        "restart.total", "restart.total_minus_first_step", "restart.detection", "restart.dump_wait",
        "restart.notify", "restart.to_stop", "restart.stop", "restart.rendezvous", "restart.worker_start",
        "restart.first_step",
        "inprocess.total", "inprocess.process_total", "inprocess.speedup", "inprocess.same_pids",
        *(f"inprocess.{k}" for k in ("notify", "abort", "interrupt", "finalize", "barrier", "reinit", "first_step")),
    },
    "warm_restart": {  # smoke: one heavy auto run (the other configurations' figures are there, empty)
        *(f"warm.{c}.{k}" for c in ("cold", "auto", "torch", "heavy_cold", "heavy_auto")
          for k in ("total", "notify", "to_stop", "stop", "rendezvous", "worker_start", "first_step", "node_pss")),
        *(f"warm.{k}.{c}" for k in ("ratio", "saving") for c in ("auto", "torch", "heavy")),
        *(f"warm.template.{c}.{m}" for c in ("torch", "auto", "heavy_auto") for m in ("rss", "pss", "uss")),
        "warm.forked", "warm.template_ready", "warm.auto.template_import", "warm.heavy_auto.template_import",
        "warm.loadavg",
    },
    "rdzv_restart": {"rdzv.torch", "rdzv.ft"},
    "step_overhead": {f"step.{p}.{v}.{k}" for p in ("record", "socket") for v in ("b2b", "gap")
                      for k in ("bare", "client", "calls", "noise", "overhead")},
    "diagnosis": {*(f"diagnosis.n2.{k}" for k in ("verdict_to_written", "roll_call", "dump_wait", "all_answered")),
                  "fr.overhead"},
    "sim_nodes": {f"scale.nodes.{p}.{k}" for p in ("before", "after") for k in (
        "roll_call_beyond_slowest", "hang_decision", "ops_per_node", "idle_ops", "step_ops", "rendezvous", "keys_left",
        "agreed")},
    "snapshot": {f"snap.1MB.{k}" for k in (
        "step.none", "step.every10", "step.every1", "added.every10", "added.every1", "noise", "copy", "copy_memfd",
        "crc32", "save_call", "save_wait", "torch_save", "dcp_save", "restore", "torch_load", "dcp_load",
        "restore_vs_torch_load", "restore_vs_dcp_load", "restored_equal", "lost.k1", "peer.local", "peer.with_copy",
        "peer.transfer")},
    "fsdp2_snapshot": {f"fsdp2snap.4MB.{k}" for k in ("save", "save_call", "restore", "dcp_save", "dcp_load",
                                                      "save_vs_dcp", "restore_vs_dcp")},
    "lightning_cost": {"lightning.step.bare", "lightning.step.callback", "lightning.callback.hooks",
                       "lightning.callback.cost_pct"},
    "sim_inprocess": {f"sim.inprocess.n{n}.{k}" for n in (8, 16)
                      for k in ("notify", "barrier", "total", "calls_per_rank", "keys_growth", "quiet_calls")},
}
CLIENT_KEYS = {"heartbeat.b2b", "section.b2b", "unmonitored.b2b", "heartbeat.paced", "section.paced",
               "unmonitored.paced", "ping.b2b", "set_timeouts.b2b", "ping.paced"}


def test_the_smoke_groups_cover_every_benchmark() -> None:
    from bench.run import BENCHMARKS

    grouped = [name for group in EXPECTED_IDS for name in group.split(",")]
    assert sorted(grouped) == sorted(BENCHMARKS)


@pytest.mark.e2e
@pytest.mark.parametrize("group", list(EXPECTED_IDS))
def test_smoke_run_writes_the_expected_json(tmp_path: Path, group: str) -> None:
    """One group per test, so that pytest-xdist runs the groups side by side."""
    out = tmp_path / "bench.json"
    proc = zygote.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--only", group, "--out", str(out)],
                      capture_output=True, text=True, cwd=ROOT, timeout=110 * slack())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("| what | median | p99 | min-max | target | met? |"), proc.stdout

    data = json.loads(out.read_text())
    assert data["schema"] == 1 and data["mode"] == "smoke"
    assert MACHINE_KEYS <= set(data["machine"]), data["machine"]
    assert data["machine"]["loop"] in ("uvloop", "asyncio")
    figures = data["figures"]
    for f in figures:
        assert set(f) == FIGURE_KEYS, f
        assert f["met"] in (True, False, None)
    ids = {f["id"] for f in figures}
    assert EXPECTED_IDS[group] <= ids, (EXPECTED_IDS[group] - ids, proc.stderr[-3000:])  # a sweep says why
    by_id = {f["id"]: f for f in figures}
    if group == "client_cost":
        for progress in ("record", "socket"):
            client = {i.split(".", 3)[3] for i in ids if i.startswith(f"client.{progress}.")}
            assert CLIENT_KEYS <= client, (progress, CLIENT_KEYS - client)
    if group == "restart":
        restart = by_id["restart.total"]  # one real ft-launcher run with a hang and a restart
        assert restart["n"] == 1 and restart["details"]["launcher_line_matches_json"] == [True], restart
        assert by_id["inprocess.total"]["n"] == 1 and by_id["inprocess.same_pids"]["met"] is True
    if group == "warm_restart":  # one real ft-launcher run whose restart forks its workers from the template
        warm = by_id["warm.heavy_auto.total"]
        assert warm["n"] == 1 and warm["details"]["launcher_line_matches_json"] == [True], warm
        assert by_id["warm.forked"]["met"] is True, by_id["warm.forked"]
        assert by_id["warm.heavy_auto.node_pss"]["n"] == 1, by_id["warm.heavy_auto.node_pss"]
    if group == "step_overhead":
        assert all(by_id[f"step.{p}.{v}.overhead"]["n"] >= 1 for p in ("record", "socket") for v in ("b2b", "gap"))
    if group == "diagnosis":
        assert by_id["diagnosis.n2.roll_call"]["n"] == 1 and by_id["diagnosis.n2.all_answered"]["met"] is True
    if group == "snapshot":  # 1 MB: a real daemon, a kill -9 restored, two ranks copying to each other
        assert by_id["snap.1MB.restored_equal"]["met"] is True and by_id["snap.1MB.lost.k1"]["n"] == 1
        assert by_id["snap.1MB.peer.transfer"]["n"] == 1 and by_id["snap.1MB.peer.transfer"]["met"] is not False
    measured = [f for f in figures if f["n"]]
    assert measured and all(f["median"] is not None and f["min"] <= f["median"] <= f["max"] for f in measured)


def test_percentiles_interpolate_between_ranks() -> None:
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert s == {"n": 4, "median": 2.5, "p99": pytest.approx(3.97), "min": 1.0, "max": 4.0}
    assert summarize([])["median"] is None


def test_table_marks_missed_targets() -> None:
    ok = Figure(id="a", what="fast", unit="us", samples=[1.0, 2.0], target="p50 <= 2 us", limit=2.0)
    slow = Figure(id="b", what="slow", unit="us", samples=[3.0], target="p50 <= 2 us", limit=2.0)
    rate = Figure(id="c", what="rate", unit="ev/s", samples=[400_000.0], target=">= 300k", limit=300_000, op=">=")
    flag = Figure(id="d", what="flag", unit="", value="none", target="none", met=True)
    table = markdown_table([ok, slow, rate, flag]).splitlines()
    assert table[2] == "| fast | 1.50 us | 1.99 us | 1.00 us-2.00 us | p50 <= 2 us | yes |"
    assert table[3].endswith("| **NO** |")
    assert table[4].endswith("| yes |")
    assert table[5] == "| flag | none | - | - | none | yes |"


def _documented_commands() -> list[str]:
    """Every `bench/X.py` the docs tell users to type at the start of a line."""
    found: set[str] = set()
    for doc in [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found.update(re.findall(r"(?m)^\s*(?:\./)?(bench/\w+\.py)\b", doc.read_text()))
    return sorted(found)


def test_the_docs_name_the_bench_scripts_they_run() -> None:
    assert {"bench/run.py", "bench/soak.py"} <= set(_documented_commands())


@pytest.mark.parametrize("script", _documented_commands())
def test_every_bench_script_the_docs_run_as_a_command_is_executable(script: str) -> None:
    """docs/reliability.md writes `bench/soak.py --seconds 600`; it had no shebang and mode 0644
    ("Permission denied")."""
    path = ROOT / script
    assert os.access(path, os.X_OK), f"{script}: not executable (chmod +x), yet the docs run it as a command"
    assert path.read_text().startswith("#!/usr/bin/env python3\n"), f"{script}: no shebang"
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr
