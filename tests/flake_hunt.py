"""The flake hunter: run the suite (or a selection) K times and count failures per test.

    scripts/flake-hunt --runs 5 --busy 2 -- tests/test_inprocess.py -k exception

Each run is one `pytest -n W` in its own folder under ``--out``:

- ``run-I/pytest.log``: pytest's whole output;
- ``run-I/junit.xml``: the per-test outcomes the table is made from;
- ``run-I/failed/<test id>/``: the ``workdir`` of each failing test (daemon and launcher
  logs, hang reports, stack dumps, error files), kept by tests/conftest.py;
- ``run-I/tmp/``: pytest's ``tmp_path`` of each failing test (passing ones are removed).

``--busy N`` starts N processes that spin on a CPU for the whole of each run (a shared,
busy machine). The hunter prints one row per test that failed at least once (how many runs
it failed, the first line of its first failure, where its evidence is) and writes the same
as ``summary.json``; it exits 1 when any run failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"


@dataclass
class Run:
    index: int
    folder: Path
    rc: int = -1
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    """test id -> the first line of its failure (or error) message."""


def parse_junit(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """(outcome counts, failed test id -> first line of its message) of one pytest junit file."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures: dict[str, str] = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return counts, {"<junit>": f"no readable junit file: {e}"}
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test = f"{classname.replace('.', '/')}.py::{name}" if classname else name
        bad = [c for c in case if c.tag in ("failure", "error")]
        if bad:
            counts["failed" if bad[0].tag == "failure" else "error"] += 1
            text = (bad[0].get("message") or bad[0].text or "").strip().splitlines()
            failures.setdefault(test, text[0][:200] if text else bad[0].tag)
        elif any(c.tag == "skipped" for c in case):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures


def run_once(index: int, out: Path, workers: int, busy: int, pytest_args: list[str]) -> Run:
    folder = out / f"run-{index}"
    folder.mkdir(parents=True)
    run = Run(index, folder)
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    env = {**os.environ, "FT_TEST_KEEP_DIR": str(folder / "failed")}
    argv = [sys.executable, "-m", "pytest", "-n", str(workers), "-p", "no:cacheprovider",
            "--junitxml", str(folder / "junit.xml"), "--basetemp", str(folder / "tmp"), *pytest_args]
    start = time.monotonic()
    try:
        with open(folder / "pytest.log", "w") as log:
            run.rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    finally:
        run.seconds = time.monotonic() - start
        for s in spinners:
            s.kill()
            s.wait()
    run.counts, run.failures = parse_junit(folder / "junit.xml")
    if run.rc not in (0, 1) and not run.failures:  # interrupted, usage error, nothing collected (5)
        run.failures["<pytest>"] = f"pytest exited {run.rc} (see {folder / 'pytest.log'})"
    return run


def table(runs: list[Run]) -> str:
    per_test: dict[str, list[Run]] = {}
    for r in runs:
        for test in r.failures:
            per_test.setdefault(test, []).append(r)
    lines = ["| run | exit | passed | failed | errors | skipped | seconds |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        c = r.counts
        lines.append(f"| {r.index} | {r.rc} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('error', 0)} | "
                     f"{c.get('skipped', 0)} | {r.seconds:.0f} |")
    lines += ["", f"failures per test, {len(runs)} run(s):", ""]
    if not per_test:
        return "\n".join([*lines, "none"])
    lines += ["| test | failed | first message | evidence |", "|---|---|---|---|"]
    for test, failed in sorted(per_test.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        first = failed[0]
        message = first.failures[test].replace("|", "\\|")
        lines.append(f"| {test} | {len(failed)}/{len(runs)} (runs {', '.join(str(r.index) for r in failed)}) | "
                     f"{message} | {first.folder / 'failed'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/flake-hunt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", "-k", type=int, default=5, help="how many runs (default 5)")
    p.add_argument("--busy", type=int, default=0, help="busy CPU loops beside each run (default 0)")
    p.add_argument("--workers", "-n", type=int, default=int(os.environ.get("FT_TEST_WORKERS", "4")),
                   help="pytest-xdist workers (default FT_TEST_WORKERS or 4, as scripts/test)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the runs' logs and evidence (default /tmp/ft-flake-hunt-TIME)")
    p.add_argument("pytest_args", nargs="*", help="after --: a selection or other pytest arguments")
    args = p.parse_args(argv)
    if args.runs < 1 or args.busy < 0 or args.workers < 0:
        p.error("--runs must be >= 1, --busy and --workers >= 0")
    out = (args.out or Path(f"/tmp/ft-flake-hunt-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    for i in range(1, args.runs + 1):
        run = run_once(i, out, args.workers, args.busy, args.pytest_args)
        runs.append(run)
        print(f"flake-hunt: run {i}/{args.runs}: exit {run.rc}, {run.counts.get('passed', 0)} passed, "
              f"{len(run.failures)} failed, {run.seconds:.0f} s" + (f" ({', '.join(run.failures)})"
                                                                   if run.failures else ""), flush=True)
    text = table(runs)
    print()
    print(text)
    summary = {"runs": [{"index": r.index, "rc": r.rc, "seconds": round(r.seconds, 1), "counts": r.counts,
                         "failures": r.failures, "folder": str(r.folder)} for r in runs],
               "busy": args.busy, "workers": args.workers, "pytest_args": args.pytest_args}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(text + "\n")
    print(f"\nflake-hunt: logs and evidence in {out}")
    return 1 if any(r.failures or r.rc != 0 for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
