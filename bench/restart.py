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
import json
import os
import re
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import inprocess_restart
from bench.harness import (
    PY,
    ROOT,
    Figure,
    Mode,
    clean_env,
    cleanup,
    launcher_run,
    private_dir,
    read_kb,
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


def run(mode: Mode) -> list[Figure]:
    """Process-restart runs, each followed by an in-process restart run
    (bench/inprocess_restart.py): the two side by side, in the same conditions."""
    runs = mode.pick(5, 2, 1)
    samples, inprocess = [], []
    for i in range(runs):
        samples.append(_one(i))
        inprocess.append(inprocess_restart.one(i))
    loop = resolve_loop("auto")
    return figures(samples, loop) + inprocess_restart.figures(inprocess, [s["total"] for s in samples], loop)


def _one(i: int) -> dict[str, Any]:
    d = private_dir()
    try:
        return _sample(*launcher_run(launcher_argv(d), d, f"restart run {i}"), i)
    finally:
        cleanup(d)


def _sample(summary: dict[str, Any], text: str, i: int, steps: int = 30,
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


# -- warm restarts (issue 27) ----------------------------------------------------------------
WARM_TARGET_S = 0.5
WARM = "--ft-warm-restart"
CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {  # name -> (workload, ft-launcher flags)
    "cold": ("demo", ()),
    "auto": ("demo", (WARM, "--ft-preload", "auto")),
    "torch": ("demo", (WARM,)),
    "heavy_cold": ("heavy", ()),
    "heavy_auto": ("heavy", (WARM, "--ft-preload", "auto")),
}
CONFIG_WHAT = {
    "cold": "demo, cold restart (today)",
    "auto": "demo, --ft-warm-restart --ft-preload auto",
    "torch": "demo, --ft-warm-restart (torch only)",
    "heavy_cold": "demo + 5 s import, cold restart",
    "heavy_auto": "demo + 5 s import, --ft-warm-restart --ft-preload auto",
}
TEMPLATE_MODULE = "ft_monitor.launcher.warm.template"
AFTER_RESTART_S = (0.5, 3.0)
"""When, after the launcher's "all ranks running again" line, attempt 1's memory is read (the
figure is the last: forked workers share fewer of the template's pages as they run)."""


def warm_plan(mode: Mode) -> tuple[int, list[str], dict[str, int], float]:
    """(rounds, configurations, hang step per workload, heavy import seconds). The hang comes late
    (after ~10 s of training, full and quick) so that the `auto` template, made again once the
    first workers have reported their modules (it then imports them: ~5 s, ~10 s with the heavy
    module), is ready: the restart measures the steady state. --smoke: one heavy auto run with a
    0.2 s import and the demo's early hang (the template may still be importing: figures mean
    nothing)."""
    if mode.name == "smoke":
        return 1, ["heavy_auto"], {"demo": 12, "heavy": 12}, 0.2
    return mode.pick(5, 2, 1), list(CONFIGS), {"demo": 180, "heavy": 240}, 5.0


def run_warm(mode: Mode) -> list[Figure]:
    """Every configuration of `CONFIGS` in turn, run after run (cold, auto, torch, heavy cold,
    heavy auto, cold, ...), so that all see the same load."""
    rounds, configs, hang_steps, heavy_s = warm_plan(mode)
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        for c in configs:
            samples[c].append(_warm_one(c, r, hang_steps[CONFIGS[c][0]], heavy_s))
    return warm_figures(samples, hang_steps, heavy_s)


def _warm_one(config: str, i: int, hang_step: int, heavy_s: float) -> dict[str, Any]:
    workload, flags = CONFIGS[config]
    steps = hang_step + 70  # >= 3.5 s of steps after the restart: attempt 1's memory is read while they run
    d = private_dir()
    what = f"warm-restart bench, {config} run"
    try:
        argv = launcher_argv(d, flags, workload, hang_step, steps)
        out_path = d / "launcher.out"
        load = os.getloadavg()[0]
        with open(out_path, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=clean_env({"BENCH_HEAVY_IMPORT_S": f"{heavy_s:g}"}))
        script = next(a for a in argv if a.endswith((f"{os.sep}train_ddp.py", f"{os.sep}warm_train.py")))
        watch = _Watch(proc.pid, out_path, script)
        watch.start()
        try:
            rc = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        finally:
            watch.stop()
        text = out_path.read_text()
        summary_path = d / "summary.json"
        if rc != 0 or not summary_path.exists():
            raise RuntimeError(f"{what} {i}: ft-launcher exited with {rc}:\n{text[-4000:]}")
        summary = json.loads(summary_path.read_text())
        s = _sample(summary, text, i, steps, what)
        s["loadavg"] = load
        warm = summary.get("warm_restarts") or {}
        s["forked"] = "1" in (warm.get("forked") or {})
        s["fallbacks"] = warm.get("fallbacks") or []
        s["preloaded"] = len(warm.get("preload") or [])
        detected = float(summary["hangs"][0]["detected_time"])
        templates = watch.templates
        s["templates"] = [{**t, "ready_before_detection_s": None if t["ready"] is None else detected - t["ready"]}
                          for t in templates]
        last = templates[-1] if templates else None
        s["template_import_s"] = None if last is None or last["ready"] is None else last["ready"] - last["started"]
        s["template_ready_before_detection"] = None if last is None else \
            last["ready"] is not None and last["ready"] < detected
        for key in ("rss_kb", "pss_kb", "uss_kb"):
            s[f"template_{key}"] = None if last is None else last.get(key)
        s["after"] = watch.after
        return s
    finally:
        cleanup(d)


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks since boot) of /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def _memory_kb(pid: int) -> dict[str, int | None]:
    """VmRSS, and Pss and USS (Private_*) of /proc/PID/smaps_rollup (None where unreadable)."""
    out: dict[str, int | None] = {"rss_kb": None, "pss_kb": None, "uss_kb": None}
    try:
        out["rss_kb"] = read_kb(pid)
    except (OSError, KeyError):
        return out
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
    except (OSError, ValueError, IndexError):
        return out
    out["pss_kb"] = fields.get("Pss")
    out["uss_kb"] = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return out


class _Watch(threading.Thread):
    """Watches one ft-launcher run from outside, every 0.1 s: its worker templates (children
    running `TEMPLATE_MODULE`, one per --socket path: a forked worker keeps its template's
    command line, so the first pid seen with a path is the template), when each was started
    (/proc/PID/stat) and ready (its socket exists: it binds it once its imports are done), and
    its memory 0.5 s after ready (idle, before any fork); and, at each of AFTER_RESTART_S after
    the launcher's "all ranks running again" line, the memory of attempt 1: its workers (forked:
    the template's command line, another pid; cold: the script's) and the templates alive."""

    def __init__(self, launcher: int, out_path: Path, script_mark: str) -> None:
        super().__init__(daemon=True)
        self.launcher = launcher
        self.out_path = out_path
        self.script = script_mark
        self.btime = _boot_time()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.templates: list[dict[str, Any]] = []
        self._by_socket: dict[str, dict[str, Any]] = {}
        self.after: dict[str, Any] = {}
        self._restarted_at: float | None = None
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    def run(self) -> None:
        while not self._done.wait(0.1):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - a bench watcher: never kill the run; say it in the JSON
                self.after["error"] = f"{type(e).__name__}: {e}"
                return

    def _children(self) -> list[tuple[int, int, list[str]]]:
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            st = _proc_stat(int(name))
            if st is not None and st[0] == self.launcher:
                out.append((int(name), st[1], _cmdline(int(name))))
        return out

    def _tick(self) -> None:
        now = time.time()
        children = self._children()
        for pid, started, argv in children:
            if TEMPLATE_MODULE in argv and "--socket" in argv and self._restarted_at is None:
                sock = argv[argv.index("--socket") + 1]
                if sock not in self._by_socket:
                    preload = argv[argv.index("--preload") + 1].split(",") if "--preload" in argv else []
                    t = {"pid": pid, "socket": sock, "modules": len(preload),
                         "started": self.btime + started / self.tick, "ready": None,
                         "rss_kb": None, "pss_kb": None, "uss_kb": None}
                    self._by_socket[sock] = t
                    self.templates.append(t)
        for t in self.templates:
            if t["ready"] is None and os.path.exists(t["socket"]):
                t["ready"] = now
            elif t["ready"] is not None and t["rss_kb"] is None and now - t["ready"] >= 0.5 \
                    and self._restarted_at is None:
                t.update(_memory_kb(t["pid"]))
        if self._restarted_at is None:
            try:
                if "all ranks running again" in self.out_path.read_text(errors="replace"):
                    self._restarted_at = now
            except OSError:
                pass
            return
        due = [t for t in AFTER_RESTART_S if f"{t:g}" not in self.after and now - self._restarted_at >= t]
        if due:
            tpids = {t["pid"] for t in self.templates}
            socks = set(self._by_socket)
            workers = [pid for pid, _, argv in children if pid not in tpids and (
                self.script in argv or (TEMPLATE_MODULE in argv and socks.intersection(argv)))]
            alive = [pid for pid, _, _ in children if pid in tpids]
            mem = {pid: _memory_kb(pid) for pid in workers + alive}

            def total(pids: list[int], key: str) -> int | None:
                vals = [mem[p][key] for p in pids]
                return None if not vals or any(v is None for v in vals) else sum(v for v in vals if v is not None)

            self.after[f"{due[0]:g}"] = {"at_s": round(now - self._restarted_at, 2), "workers": len(workers),
                                           "templates_alive": len(alive),
                                           "workers_rss_kb": total(workers, "rss_kb"),
                                           "workers_pss_kb": total(workers, "pss_kb"),
                                           "templates_pss_kb": total(alive, "pss_kb") if alive else 0}


def _round(v: float | None, digits: int = 2) -> float | None:
    return None if v is None else round(v, digits)


def warm_figures(samples: dict[str, list[dict[str, Any]]], hang_steps: dict[str, int],
                 heavy_s: float) -> list[Figure]:
    loop = resolve_loop("auto")
    how = ("runs of the demo under ft-launcher (2 ranks, --max-restarts 1, rank 1 hangs at step {step} of attempt "
           "0; {n} run(s) of this configuration, the configurations alternated run by run); one sample per run, "
           "from --ft-summary-json restarts[0] (wall clock)")
    out: list[Figure] = []

    def col(c: str, key: str, scale: float = 1.0) -> list[float]:
        return [x[key] * scale for x in samples[c] if x.get(key) is not None]

    def med(c: str, key: str = "total") -> float | None:
        v = col(c, key)
        return statistics.median(v) if v else None

    for c, (workload, flags) in CONFIGS.items():
        n = len(samples[c])
        h = how.format(step=hang_steps[workload], n=n) + (f"; {' '.join(flags)}" if flags else "; cold") + (
            f"; bench/warm_train.py --heavy: bench.warm_heavy burns {heavy_s:g} s of CPU at import"
            if workload == "heavy" else "")
        per_run = [{**{k: x[k] for k in KEYS}, "loadavg_1min": round(x["loadavg"], 2),
                    "template_import_s": _round(x.get("template_import_s")),
                    "template_ready_before_detection_s": _round(
                        x["templates"][-1]["ready_before_detection_s"] if x.get("templates") else None)}
                   for x in samples[c]]
        details: dict[str, Any] = {"how": h, "runs": n, "per_run": per_run,
                                   "loadavg_1min": [x["loadavg"] for x in samples[c]],
                                   "launcher_line_matches_json": [x["line_matches_json"] for x in samples[c]]}
        if flags:
            details.update({
                "forked": [x["forked"] for x in samples[c]], "fallbacks": [x["fallbacks"] for x in samples[c]],
                "modules_preloaded": [x["preloaded"] for x in samples[c]],
                "template_import_s": [x["template_import_s"] for x in samples[c]],
                "template_ready_before_detection": [x["template_ready_before_detection"] for x in samples[c]],
                "templates": [x["templates"] for x in samples[c]]})
        target = f"<= {WARM_TARGET_S:g} s" if c == "auto" else "-"
        out.append(Figure(id=f"warm.{c}.total", what=f"restart, {CONFIG_WHAT[c]}: hang detected -> all ranks "
                          "stepping (total)", unit="s", samples=col(c, "total"), target=target,
                          limit=WARM_TARGET_S if c == "auto" else None, loop=loop, details=details))
        for key in WHAT:
            out.append(Figure(id=f"warm.{c}.{key}", what=f"restart, {CONFIG_WHAT[c]}: {key}", unit="ms",
                              samples=col(c, key, 1000), loop=loop, details={"how": h + f"; breakdown key {key!r}"}))
        last = f"{AFTER_RESTART_S[-1]:g}"
        after = [a for x in samples[c] for a in [x["after"].get(last)] if a and a.get("workers_pss_kb") is not None]
        out.append(Figure(
            id=f"warm.{c}.node_pss", what=f"restart, {CONFIG_WHAT[c]}: attempt 1's memory (PSS of its workers "
            "+ the template's, if any)", unit="MB", loop=loop,
            samples=[(a["workers_pss_kb"] + (a["templates_pss_kb"] or 0)) / 1024 for a in after],
            details={"how": f"/proc/PID/smaps_rollup Pss, {last} s after the launcher's 'all ranks "
                            "running again' line: attempt 1's workers and the live worker template(s)",
                     "after": [x.get("after") for x in samples[c]]}))

    def ratio(a: str, b: str) -> float | None:
        ma, mb = med(a), med(b)
        return None if ma is None or mb is None or mb <= 0 else round(ma / mb, 1)

    def saving(a: str, b: str) -> float | None:
        ma, mb = med(a), med(b)
        return None if ma is None or mb is None else round(ma - mb, 2)

    for name, a, b in (("auto", "cold", "auto"), ("torch", "cold", "torch"), ("heavy", "heavy_cold", "heavy_auto")):
        out.append(Figure(id=f"warm.ratio.{name}", what=f"restart median, {CONFIG_WHAT[a]} / {CONFIG_WHAT[b]}",
                          unit="x", value=ratio(a, b), loop=loop, details={"how": "ratio of the medians of total"}))
        out.append(Figure(id=f"warm.saving.{name}", what=f"restart median, {CONFIG_WHAT[a]} - {CONFIG_WHAT[b]}",
                          unit="s", value=saving(a, b), loop=loop,
                          details={"how": "difference of the medians of total"}))
    warm_runs = [x for c, (_, flags) in CONFIGS.items() if flags for x in samples[c]]
    forked = sum(x["forked"] for x in warm_runs)
    out.append(Figure(id="warm.forked", what="warm runs whose restart forked its workers from the template",
                      unit="", value=f"{forked}/{len(warm_runs)}", target="all",
                      met=bool(warm_runs) and forked == len(warm_runs), loop=loop,
                      details={"fallbacks": [x["fallbacks"] for x in warm_runs if x["fallbacks"]]}))
    auto_runs = [x for c in ("auto", "heavy_auto") for x in samples[c]]
    ready = sum(bool(x["template_ready_before_detection"]) for x in auto_runs)
    out.append(Figure(id="warm.template_ready", what="auto runs whose template (made again with the workers' "
                      "modules) was ready before the hang was detected", unit="", value=f"{ready}/{len(auto_runs)}",
                      target="all (steady state)", met=bool(auto_runs) and ready == len(auto_runs), loop=loop,
                      details={"how": "ready = its socket exists (bound after its imports), polled every 0.1 s"}))
    for c in ("auto", "heavy_auto"):
        out.append(Figure(id=f"warm.{c}.template_import", what=f"{CONFIG_WHAT[c]}: the auto template's start -> "
                          "ready (its imports)", unit="s", samples=col(c, "template_import_s"), loop=loop,
                          details={"how": "/proc/PID/stat start time (10 ms) -> its socket exists (0.1 s polls)",
                                   "modules": [x["templates"][-1]["modules"] if x["templates"] else None
                                               for x in samples[c]]}))
    for c, what in (("torch", "torch only"), ("auto", "auto: torch + the demo's workers' modules"),
                    ("heavy_auto", "auto, with the heavy import")):
        for key, label in (("rss_kb", "RSS"), ("pss_kb", "PSS"), ("uss_kb", "USS")):
            out.append(Figure(id=f"warm.template.{c}.{key[:3]}", what=f"idle worker template, {what}: {label}",
                              unit="MB", samples=[v / 1024 for v in col(c, f"template_{key}")], loop=loop,
                              details={"how": "VmRSS of /proc/PID/status; Pss and Private_* of "
                                              "/proc/PID/smaps_rollup; 0.5 s after the template is ready, before "
                                              "the restart forks from it"}))
    out.append(Figure(id="warm.loadavg", what="warm-restart bench: 1-minute load average at each run's start",
                      unit="", samples=[x["loadavg"] for c in CONFIGS for x in samples[c]], loop=loop))
    return out
