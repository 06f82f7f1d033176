"""Restart time under ft-launcher: hang detected -> all ranks back in their step loop.

Each run is the demo (scripts/demo) with one restart allowed, in a fresh
directory, run as the user runs it:

    ft-launcher --standalone --nproc-per-node 2 --max-restarts 1 --log-dir D/logs \\
        --ft-cfg-path examples/ft.yaml --ft-summary-json D/summary.json \\
        examples/train_ddp.py --ckpt-dir D/ckpt --hang rank=1,step=12,attempt=0

Rank 1 hangs at step 12 of attempt 0 inside its `step` section (by then the
learned step timeout is in force: 2 s, the floor); its daemon detects it, dumps
its stack, tells the launcher, which stops the group, re-rendezvouses and starts
attempt 1; the run must then finish (exit code 0). One sample per run, from:

* the summary JSON's ``restarts[0]`` (`RestartTiming.breakdown()`, wall clock):
  notify (detected -> the launcher acts on the notice), to_stop, stop, rendezvous,
  worker_start (torch spawning the workers), first_step (workers started -> every
  rank's daemon has seen a step or heartbeat: the worker's own Python + torch
  import + process group + checkpoint load), total (detected -> first step);
* its ``hangs[0]``: detection delay = ``elapsed_s - timeout_s`` (the daemon's clock);
* the daemon's monitor.log beside the hang report (the attempt directory under
  --log-dir): the stack-dump wait = the "stack dump written" line - detected_time
  (the hang report itself has no timestamp for it), and the launcher's
  acknowledgement, which splits notify into dump wait, daemon -> launcher
  acknowledgement, and the launcher's pick-up at its next monitor tick.

The launcher's own timing line ("all ranks running again ...") is parsed from
its output and checked against the JSON. Target (DESIGN.md): <= 3 s plus worker
start; worker_start + first_step are the worker's own start-up, so total -
first_step is compared with 3 s. The launcher starts its daemons with ``--loop
auto``, whatever bench/run.py's --loop says.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import inprocess_restart
from bench.harness import (
    PY,
    ROOT,
    Figure,
    Mode,
    cleanup,
    launcher_run,
    private_dir,
    resolve_loop,
    summarize,
)

TARGET_S = 3.0
KEYS = ("notify", "to_stop", "stop", "rendezvous", "worker_start", "first_step", "total")
WHAT = {
    "notify": "restart: detected -> launcher acts on the notice (notify)",
    "to_stop": "restart: notice -> stop begins (to_stop)",
    "stop": "restart: stopping the worker group (stop)",
    "rendezvous": "restart: rendezvous",
    "worker_start": "restart: torch spawns the workers (worker_start)",
    "first_step": "restart: workers spawned -> every rank stepping (first_step)",
}
LINE = re.compile(
    r"all ranks running again (?P<total>[\d.]+)s after rank (?P<rank>\d+)'s hang was detected "
    r"\(notify (?P<notify>[\d.]+)s, to stop (?P<to_stop>[\d.]+)s, stop (?P<stop>[\d.]+)s, "
    r"rendezvous (?P<rendezvous>[\d.]+)s, worker start (?P<worker_start>[\d.]+)s, "
    r"first step (?P<first_step>[\d.]+)s\)")
"""The launcher's timing line (agent.py `_note_first_step`)."""
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ft-monitor\[\d+\] \w+ (.*)$")


def launcher_argv(d: Path, flags: Sequence[str] = (), workload: str = "demo", hang_step: int = 12,
                  steps: int = 30) -> list[str]:
    """The demo's command line (the defaults: as scripts/demo runs it); ``flags``: more
    ft-launcher options; ``workload`` ``heavy``: bench/warm_train.py --heavy (the demo after a
    slow import) instead of examples/train_ddp.py."""
    exe = Path(PY).parent / "ft-launcher"
    head = [str(exe)] if exe.exists() else [PY, "-m", "ft_monitor.launcher.main"]
    script = [str(ROOT / "examples" / "train_ddp.py")] if workload == "demo" else \
        [str(ROOT / "bench" / "warm_train.py"), "--heavy"]
    return [*head, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(d / "logs"),
            "--ft-cfg-path", str(ROOT / "examples" / "ft.yaml"), "--ft-summary-json", str(d / "summary.json"),
            *flags, *script, "--ckpt-dir", str(d / "ckpt"), *(["--steps", str(steps)] if steps != 30 else []),
            "--hang", f"rank=1,step={hang_step},attempt=0"]


SMOKE_FLAGS = ("--ft-warm-start", "--ft-preload",
               "torch.nn.parallel,torch._dynamo,torch.optim,ft_client,ft_client.inprocess")
"""--smoke (tests/test_bench.py: the bench runs and writes its JSON; its figures mean nothing):
every worker forked from the launcher's worker template, which imports torch and DDP once,
instead of a new interpreter per worker and attempt (a quarter of the CPU)."""


def run(mode: Mode) -> list[Figure]:
    """Process-restart runs, each followed by an in-process restart run
    (bench/inprocess_restart.py): the two side by side, in the same conditions."""
    runs = mode.pick(5, 2, 1)
    flags = SMOKE_FLAGS if mode.name == "smoke" else ()
    samples, inprocess = [], []
    for i in range(runs):
        samples.append(_one(i, flags))
        inprocess.append(inprocess_restart.one(i, flags))
    loop = resolve_loop("auto")
    return figures(samples, loop) + inprocess_restart.figures(inprocess, [s["total"] for s in samples], loop)


def _one(i: int, flags: Sequence[str] = ()) -> dict[str, Any]:
    d = private_dir()
    try:
        return sample(*launcher_run(launcher_argv(d, flags), d, f"restart run {i}"), i)
    finally:
        cleanup(d)


def sample(summary: dict[str, Any], text: str, i: int, steps: int = 30,
            what: str = "restart run") -> dict[str, Any]:
    hangs, restarts = summary.get("hangs") or [], summary.get("restarts") or []
    if len(hangs) != 1 or len(restarts) != 1 or restarts[0].get("total") is None:
        raise RuntimeError(f"{what} {i}: expected one hang and one complete restart, got {summary}")
    hang, b = hangs[0], restarts[0]
    if hang.get("rank") != 1 or hang.get("attempt") != 0:
        raise RuntimeError(f"{what} {i}: the hang is not rank 1 in attempt 0: {hang}")
    finished = text.count(f"finished {steps} steps")
    if finished != 2:
        raise RuntimeError(f"{what} {i}: {finished} of 2 ranks finished after the restart:\n{text[-4000:]}")
    s: dict[str, Any] = {k: b[k] for k in KEYS}
    s["total_minus_first_step"] = b["total"] - b["first_step"]
    s["detection"] = hang["elapsed_s"] - hang["timeout_s"]
    s["stack_dump_captured"] = bool(hang.get("stack_dump_captured"))
    detected = float(hang["detected_time"])
    report_dir = Path(hang["report"]).parent
    events = _monitor_log(report_dir / "monitor.log", hang["rank"])
    s["dump_wait"] = None if "dump" not in events else events["dump"] - detected
    s["ack"] = None if "ack" not in events or "dump" not in events else events["ack"] - events["dump"]
    s["pickup"] = None if "ack" not in events else detected + b["notify"] - events["ack"]
    dump = Path(hang["stack_dump"]) if hang.get("stack_dump") else None
    s["dump_file_written"] = dump.stat().st_mtime - detected if dump and dump.exists() else None
    matches = list(LINE.finditer(text))
    m = matches[-1] if matches else None
    s["line"] = None if m is None else {k: float(v) for k, v in m.groupdict().items() if k != "rank"}
    # the line rounds total to 10 ms, the rest to 1 ms (as the JSON does)
    s["line_matches_json"] = m is not None and all(
        abs(s["line"][k] - b[k]) <= (0.0051 if k == "total" else 0.0011) for k in KEYS)
    return s


def _monitor_log(path: Path, rank: int) -> dict[str, float]:
    """Wall-clock times (ms resolution, local time as logging writes it) of the daemon's lines
    "stack dump written" and "launcher acknowledged"."""
    out: dict[str, float] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        m = LOG_TIME.match(line)
        if not m:
            continue
        msg = m.group(2)
        key = ("dump" if msg.startswith(f"rank {rank}: stack dump written") else
               "ack" if msg.startswith(f"rank {rank}: launcher acknowledged") else None)
        if key and key not in out:
            out[key] = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def figures(samples: list[dict[str, Any]], loop: str) -> list[Figure]:
    n = len(samples)
    how = (f"{n} run(s) of the demo under ft-launcher (2 ranks, --max-restarts 1, rank 1 hangs at step 12 of "
           "attempt 0); one sample per run, from --ft-summary-json restarts[0] (wall clock)")

    def col(key: str, scale: float = 1.0) -> list[float]:
        return [x[key] * scale for x in samples if x.get(key) is not None]

    net = col("total_minus_first_step")
    met = None if not net else bool(summarize(net)["median"] <= TARGET_S)
    common = {"runs": n, "launcher_line_matches_json": [x["line_matches_json"] for x in samples],
              "launcher_lines": [x["line"] for x in samples],
              "stack_dumps_captured": sum(x["stack_dump_captured"] for x in samples)}
    out = [
        Figure(id="restart.total", what="restart: hang detected -> all ranks back in their step loop (total)",
               unit="s", samples=col("total"), target=f"<= {TARGET_S:g} s + worker start", loop=loop,
               details={"how": how + "; judged by total - first_step (next row)", **common}),
        Figure(id="restart.total_minus_first_step",
               what="restart: hang detected -> workers spawned (total - first_step)", unit="s", samples=net,
               target=f"<= {TARGET_S:g} s", limit=TARGET_S, loop=loop,
               details={"how": how + "; first_step (Python, torch, process group, checkpoint) is the worker's "
                                     "own start-up", **common}),
        Figure(id="restart.detection", what="restart: hang -> detected (hang's elapsed_s - timeout_s)", unit="ms",
               samples=col("detection", 1000), loop=loop,
               details={"how": "the daemon's clock: how late its timer noticed the open step section"}),
        Figure(id="restart.dump_wait", what="restart: stack dump wait (detected -> dump written)", unit="ms",
               samples=col("dump_wait", 1000), loop=loop,
               details={"how": "monitor.log 'stack dump written' (ms resolution) - hang detected_time; the daemon "
                               "waits for the dump file to stop growing (2 polls of 10 ms)",
                        "dump_file_mtime_after_detection_ms": col("dump_file_written", 1000)}),
    ]
    for key, what in WHAT.items():
        details: dict[str, Any] = {"how": how + f"; breakdown key {key!r}"}
        if key == "notify":
            details.update({
                "split": "dump_wait + ack (dump written -> daemon has the launcher's acknowledgement) + pickup "
                         "(acknowledged -> the launcher acts, at its next monitor tick)",
                "ack_ms": col("ack", 1000), "pickup_ms": col("pickup", 1000)})
        out.append(Figure(id=f"restart.{key}", what=what, unit="ms", samples=col(key, 1000), loop=loop,
                          details=details))
    out[0].met = met
    return out
