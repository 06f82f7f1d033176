"""Warm restarts (issue 27): figure 12, hang detected -> all ranks stepping, cold against
``--ft-warm-restart`` under ft-launcher, five configurations alternated run by run (the demo
cold, with ``--ft-preload auto``, torch only, and bench/warm_train.py --heavy cold and auto),
each run watched from outside (bench/restart_watch.py) for its worker templates and memory.
Run by bench/run.py as ``warm_restart``; bench/warm_vs_cold.py runs `_warm_one` itself."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from typing import Any

from bench.harness import ROOT, Figure, Mode, clean_env, cleanup, private_dir, resolve_loop
from bench.restart import KEYS, WHAT, launcher_argv, sample
from bench.restart_watch import AFTER_RESTART_S, Watch

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
    # --smoke: attempt 0's workers forked from the template too (its figures mean nothing; a new
    # interpreter per worker is most of its CPU)
    extra = ("--ft-warm-start",) if mode.name == "smoke" else ()
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        for c in configs:
            samples[c].append(_warm_one(c, r, hang_steps[CONFIGS[c][0]], heavy_s, extra))
    return warm_figures(samples, hang_steps, heavy_s)


def _warm_one(config: str, i: int, hang_step: int, heavy_s: float, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run of ``config``; ``extra``: more ft-launcher options."""
    workload, flags = CONFIGS[config]
    flags = (*flags, *extra)
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
        watch = Watch(proc.pid, out_path, script)
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
        s = sample(summary, text, i, steps, what)
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
