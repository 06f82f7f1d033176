"""A hang's roll call: verdict -> diagnosis.json written, 2 and 8 ranks on one machine,
and what the Flight Recorder costs a collective.

Each run is the demo's training (examples/train_ddp.py, DDP on gloo) under ft-launcher
with the Flight Recorder on and no restart allowed:

    ft-launcher --standalone --nproc-per-node N --max-restarts 0 --log-dir D/logs \\
        --ft-cfg-path examples/ft.yaml --ft-flight-recorder-entries 2000 --ft-summary-json D/summary.json \\
        examples/train_ddp.py --ckpt-dir D/ckpt --hang rank=1,step=12,attempt=0

Rank 1 hangs in step 12; its monitor's verdict (``detected_time``) starts the clock.
From the summary's ``diagnoses[0]`` and the daemon's monitor.log:

* verdict -> written: ``written_time - detected_time``: the hung rank's stack-dump wait
  (as today), the hang notice and the launcher's pick-up at its next tick (as today),
  then the roll call and writing diagnosis.json (new);
* roll call: its own duration, which is what the kill is delayed by, against its bound
  ``roll_call_timeout`` (5 s by default);
* dump wait: the hung rank's stack-dump wait, the part that exists today (the "stack
  dump written" line of its monitor.log - detected_time).

The Flight Recorder's cost: one process, a gloo group of one, ``all_reduce`` of 4 floats
3000 times, with ``TORCH_FR_BUFFER_SIZE`` 0 and 2000, median of 5 repetitions each.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

from bench.harness import PY, ROOT, Figure, Mode, clean_env, cleanup, private_dir
from bench.restart import SMOKE_FLAGS, _monitor_log

ROLL_CALL_TIMEOUT = 5.0
FR_PROBE = """
import os, statistics, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
t, n, out = torch.ones(4), int(sys.argv[2]), []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    out.append((time.perf_counter() - t0) / n * 1e6)
print(statistics.median(out), flush=True)
dist.destroy_process_group()
os._exit(0)  # gloo's teardown at interpreter exit can abort ("terminate called without an active exception")
"""


def launcher_argv(d: Path, nproc: int, quick: bool = False) -> list[str]:
    """The demo's run; ``quick`` (smoke): a fixed 1 s step timeout and a hang at step 3, so
    the run takes seconds, and the workers forked from the launcher's worker template instead of
    new interpreters (the figures then mean nothing)."""
    exe = Path(PY).parent / "ft-launcher"
    head = [str(exe)] if exe.exists() else [PY, "-m", "ft_monitor.launcher.main"]
    short = ["--ft-rank-section-timeouts", "step:1", *SMOKE_FLAGS] if quick else []
    return [*head, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
            "--log-dir", str(d / "logs"), "--ft-cfg-path", str(ROOT / "examples" / "ft.yaml"), *short,
            "--ft-flight-recorder-entries", "2000", "--ft-roll-call-timeout", str(ROLL_CALL_TIMEOUT),
            "--ft-summary-json", str(d / "summary.json"), str(ROOT / "examples" / "train_ddp.py"),
            "--ckpt-dir", str(d / "ckpt"), "--hang", f"rank=1,step={3 if quick else 12},attempt=0",
            *(["--ckpt-every", "100", "--step-time", "0.01"] if quick else [])]


def one(nproc: int, i: int, quick: bool = False) -> dict[str, Any]:
    d = private_dir()
    try:
        out_path = d / "launcher.out"
        with open(out_path, "w") as out:
            subprocess.run(launcher_argv(d, nproc, quick), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                           env=clean_env(), timeout=300)
        summary_path = d / "summary.json"
        if not summary_path.exists():
            raise RuntimeError(f"diagnosis run {i} ({nproc} ranks): no summary:\n{out_path.read_text()[-4000:]}")
        summary = json.loads(summary_path.read_text())
        rows, hangs = summary.get("diagnoses") or [], summary.get("hangs") or []
        if len(rows) != 1 or len(hangs) != 1:
            raise RuntimeError(f"diagnosis run {i} ({nproc} ranks): expected one diagnosis, got {summary}")
        row, hang = rows[0], hangs[0]
        doc = json.loads(Path(row["diagnosis"]).read_text())
        detected = float(row["detected_time"])
        events = _monitor_log(Path(hang["report"]).parent / "monitor.log", hang["rank"])
        return {"verdict_to_written": float(doc["written_time"]) - detected,
                "roll_call": float(doc["roll_call"]["duration_s"]),
                "dump_wait": None if "dump" not in events else events["dump"] - detected,
                "answered": sum(1 for r in doc["ranks"] if r["status"] == "answered"),
                "ranks": len(doc["ranks"]), "behind": doc["verdict"]["behind"], "basis": doc["verdict"]["basis"]}
    finally:
        cleanup(d)


def fr_cost(n: int, rounds: int) -> dict[str, list[float]]:
    """µs per all_reduce with the Flight Recorder off ("0") and on ("2000"), one process per
    measurement, alternating off and on ``rounds`` times (the difference is about a tenth of
    the collective: each round's pair is compared, not two far-apart runs)."""
    out: dict[str, list[float]] = {"0": [], "2000": []}
    for _ in range(rounds):
        for entries in ("0", "2000"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc = subprocess.run([PY, "-c", FR_PROBE, str(port), str(n)], capture_output=True, text=True,
                                  timeout=120, env=clean_env({"TORCH_FR_BUFFER_SIZE": entries}), cwd=ROOT)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"Flight Recorder probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
            out[entries].append(float(lines[-1]))
    return out


def run(mode: Mode) -> list[Figure]:
    figures: list[Figure] = []
    for nproc in mode.pick((2, 8), (2, 8), (2,)):
        samples = [one(nproc, i, mode.name == "smoke") for i in range(mode.pick(3, 1, 1))]
        for key, what, unit_note in (
            ("verdict_to_written", "verdict -> diagnosis.json written", ""),
            ("roll_call", "roll call (the delay it adds to the kill)", ""),
            ("dump_wait", "hung rank's stack-dump wait (as before)", ""),
        ):
            values = [s[key] * 1000 for s in samples if s[key] is not None]
            limit = ROLL_CALL_TIMEOUT * 1000 if key == "roll_call" else None
            figures.append(Figure(
                id=f"diagnosis.n{nproc}.{key}", what=f"{what}, {nproc} ranks{unit_note}", unit="ms",
                samples=values, target=f"<= roll_call_timeout ({ROLL_CALL_TIMEOUT:.0f} s)" if limit else "-",
                limit=limit, details={"runs": samples} if key == "verdict_to_written" else {}))
        figures.append(Figure(id=f"diagnosis.n{nproc}.all_answered", what=f"every rank answered, {nproc} ranks",
                              unit="", value=all(s["answered"] == s["ranks"] == nproc for s in samples),
                              target="yes", met=all(s["answered"] == s["ranks"] == nproc and s["behind"] == [1]
                                                    for s in samples)))
    cost = fr_cost(mode.pick(3000, 2000, 100), mode.pick(5, 3, 1))
    figures.append(Figure(id="fr.overhead", what="Flight Recorder cost per all_reduce (gloo, 1 rank, 2000 entries)",
                          unit="us", samples=[on - off for off, on in zip(cost["0"], cost["2000"], strict=True)],
                          details={"off_us": cost["0"], "on_us": cost["2000"],
                                   "how": "per round: on - off, each the median of 5 timed blocks in its own process"}))
    return figures
