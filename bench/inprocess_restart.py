"""In-process restart under ft-launcher: hang detected -> all ranks back in their step
loop, in the same processes. Run by bench/restart.py, each run right after a process
restart run, so the two are measured side by side in the same conditions.

Each run is the in-process demo (scripts/demo --inprocess, second half):

    ft-launcher --standalone --nproc-per-node 2 --max-restarts 1 --ft-on-hang inprocess ... \\
        examples/train_ddp.py --inprocess --ckpt-dir D/ckpt --hang rank=1,step=12,attempt=0

Rank 1 hangs at step 12 inside its `step` section (learned timeout 2 s); its daemon
dumps its stack and pushes ABORT; every rank aborts its collectives, leaves its
training function, meets the others and re-enters it (re-initialising the process
group, restoring the last checkpoint from memory). The run must finish in its first
attempt. One sample per run, from the summary JSON's ``inprocess_restarts[0]``: the
job-wide phase breakdown (`ft_client.inprocess.timeline`), wall clock, from the
monitor's verdict to every rank's first progress after re-entry. Target (DESIGN.md):
<= 0.5 s median.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import PY, ROOT, Figure, cleanup, launcher_run, private_dir, summarize
from ft_client.inprocess.timeline import PHASES

TARGET_S = 0.5
LINE = re.compile(r"all ranks back in their step loop (?P<total>[\d.]+)s after rank (?P<rank>\d+)'s fault")
"""The launcher's timing line (agent.py `_note_inprocess`)."""
WHAT = {
    "notify": "every rank knows of the fault (notify)",
    "abort": "abort hooks done: collectives freed (abort)",
    "interrupt": "main threads out of the training function (interrupt)",
    "finalize": "process groups released, garbage collected, finalize + health check (finalize)",
    "barrier": "every rank at the restart barrier (barrier)",
    "reinit": "re-entered, init_process_group done (reinit)",
    "first_step": "first progress after re-entry (first_step)",
}


def launcher_argv(d: Path, flags: Sequence[str] = ()) -> list[str]:
    """The in-process demo's command line; ``flags``: more ft-launcher options."""
    exe = Path(PY).parent / "ft-launcher"
    head = [str(exe)] if exe.exists() else [PY, "-m", "ft_monitor.launcher.main"]
    return [*head, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(d / "logs"),
            "--ft-cfg-path", str(ROOT / "examples" / "ft.yaml"), "--ft-on-hang", "inprocess",
            "--ft-summary-json", str(d / "summary.json"), *flags, str(ROOT / "examples" / "train_ddp.py"),
            "--inprocess", "--ckpt-dir", str(d / "ckpt"), "--hang", "rank=1,step=12,attempt=0"]


def one(i: int, flags: Sequence[str] = ()) -> dict[str, Any]:
    d = private_dir()
    try:
        return sample(*launcher_run(launcher_argv(d, flags), d, f"in-process run {i}"), i)
    finally:
        cleanup(d)


def sample(summary: dict[str, Any], text: str, i: int) -> dict[str, Any]:
    rows = summary.get("inprocess_restarts") or []
    if len(rows) != 1 or not (rows[0].get("phases") or {}).get("total"):
        raise RuntimeError(f"in-process run {i}: expected one complete in-process restart, got {summary}:\n"
                           f"{text[-6000:]}")
    finished = text.count("finished 30 steps")
    if finished != 2:
        raise RuntimeError(f"in-process run {i}: {finished} of 2 ranks finished:\n{text[-4000:]}")
    phases = rows[0]["phases"]
    m = LINE.search(text)
    return {**phases, "line_total": None if m is None else float(m["total"]),
            "same_pids": not summary.get("restarts") and len(summary.get("attempts") or []) == 1}


def figures(samples: list[dict[str, Any]], process_totals: list[float], loop: str) -> list[Figure]:
    n = len(samples)
    how = (f"{n} run(s) of the in-process demo under ft-launcher (2 ranks, --ft-on-hang inprocess, rank 1 hangs "
           "at step 12), each right after a process-restart run; from --ft-summary-json inprocess_restarts[0] "
           "(wall clock, the monitor's verdict -> every rank's first progress after re-entry)")

    def col(key: str, scale: float = 1.0) -> list[float]:
        return [x[key] * scale for x in samples if x.get(key) is not None]

    totals = col("total")
    out = [Figure(id="inprocess.total", what="in-process restart: hang detected -> all ranks back in their step loop "
                                             "(same processes)", unit="s", samples=totals,
                  target=f"<= {TARGET_S:g} s", limit=TARGET_S, loop=loop,
                  details={"how": how, "launcher_line_totals": [x["line_total"] for x in samples]}),
           Figure(id="inprocess.process_total", what="process restart in the same run (restart.total, for comparison)",
                  unit="s", samples=list(process_totals), loop=loop,
                  details={"how": "restart.total of the process-restart runs interleaved with the in-process ones"})]
    ratio = (statistics.median(process_totals) / statistics.median(totals)) if totals and process_totals else None
    out.append(Figure(id="inprocess.speedup", what="process restart median / in-process restart median", unit="x",
                      value=None if ratio is None else round(ratio, 1), loop=loop,
                      details={"how": "ratio of the two medians above"}))
    out.append(Figure(id="inprocess.same_pids", what="in-process runs that kept every worker process", unit="",
                      value=f"{sum(x['same_pids'] for x in samples)}/{n}", target="all",
                      met=bool(n) and all(x["same_pids"] for x in samples), loop=loop))
    for key, _ in PHASES:
        out.append(Figure(id=f"inprocess.{key}", what=f"in-process restart: {WHAT[key]}", unit="ms",
                          samples=col(key, 1000), loop=loop, details={"how": how + f"; phase {key!r}"}))
    if totals:
        out[0].details["summary"] = summarize(totals)
    return out
