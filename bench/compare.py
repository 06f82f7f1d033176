#!/usr/bin/env python3
"""Before and after in one run: `bench/run.py` on two trees, alternated, compared by figure.

    bench/compare.py --before HEAD~3 --rounds 5 --only client_cost,ingest
    bench/compare.py --before-json 'b*.json' --after-json 'a*.json'   # compare saved runs only

The ``--before`` commit is checked out into a temporary git worktree; each round runs
`bench/run.py` once there and once in this tree, the order alternating (ABBA), so that the
machine's load falls on both alike. Each tree's code is the one imported: the run's
``PYTHONPATH`` leads with the tree, ahead of the editable install. Per figure the table gives
the median over the rounds of each round's median, and after / before; the summary gives the
geometric mean of the ratios by kind (the figure id's first part). A round trip waits for
another process to be scheduled, so on a loaded machine those rows swing most: quote medians
and ratios, never one round.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_tree(tree: Path, out: Path, only: str, quick: bool) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    args = [sys.executable, str(tree / "bench" / "run.py"), "--only", only, "--out", str(out)]
    subprocess.run([*args, "--quick"] if quick else args, cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL)


def medians(paths: list[str]) -> dict[str, tuple[str, str, list[float]]]:
    """Figure id -> (what, unit, each run's median)."""
    found: dict[str, tuple[str, str, list[float]]] = {}
    for path in paths:
        for fig in json.loads(Path(path).read_text()).get("figures", []):
            value = fig.get("median")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            key = f"{fig['id']}@{fig.get('loop', '')}"
            found.setdefault(key, (fig.get("what", fig["id"]), fig.get("unit", ""), []))[2].append(float(value))
    return found


def compare(before: list[str], after: list[str]) -> dict[str, Any]:
    b, a = medians(before), medians(after)
    rows: list[dict[str, Any]] = []
    for key in sorted(b.keys() & a.keys()):
        what, unit, bv = b[key]
        mb, ma = statistics.median(bv), statistics.median(a[key][2])
        rows.append({"id": key, "what": what, "unit": unit, "before": mb, "after": ma,
                     "ratio": ma / mb if mb > 0 else None, "runs": (len(bv), len(a[key][2]))})
    kinds: dict[str, list[float]] = {}
    for row in rows:
        if isinstance(row["ratio"], float) and row["ratio"] > 0:
            kinds.setdefault(str(row["id"]).split(".")[0], []).append(row["ratio"])
    summary = {k: {"rows": len(v), "geomean": math.exp(statistics.fmean(math.log(r) for r in v)),
                   "median": statistics.median(v)} for k, v in sorted(kinds.items())}
    return {"rows": rows, "by_kind": summary, "before": before, "after": after}


def table(result: dict[str, Any]) -> str:
    lines = ["| figure | before | after | after / before |", "|---|---|---|---|"]
    for row in result["rows"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        unit = row["unit"]
        lines.append(f"| {row['what']} | {row['before']:.3g} {unit} | {row['after']:.3g} {unit} | {ratio} |")
    lines.append("")
    for kind, s in result["by_kind"].items():
        lines.append(f"{kind}: geometric mean of after/before {s['geomean']:.3f} over {s['rows']} rows "
                     f"(median {s['median']:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="commit to compare this tree against (checked out into a worktree)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="client_cost,ingest")
    p.add_argument("--quick", action="store_true", help="bench/run.py --quick in each round")
    p.add_argument("--before-json", help="glob of saved JSON files: compare these, run nothing")
    p.add_argument("--after-json", help="glob of saved JSON files (with --before-json)")
    p.add_argument("--out", type=Path, help="where to keep every run's JSON and compare.json (default: a temp dir)")
    args = p.parse_args(argv)
    if args.before_json or args.after_json:
        if not (args.before_json and args.after_json):
            p.error("--before-json and --after-json go together")
        before, after = sorted(glob.glob(args.before_json)), sorted(glob.glob(args.after_json))
    else:
        if not args.before:
            p.error("--before COMMIT (or --before-json and --after-json)")
        out = args.out or Path(tempfile.mkdtemp(prefix="ft-compare-"))
        out.mkdir(parents=True, exist_ok=True)
        tree = Path(tempfile.mkdtemp(prefix="ft-before-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), args.before],
                       check=True, capture_output=True)
        before, after = [], []
        try:
            for i in range(args.rounds):
                order = [("b", tree), ("a", ROOT)] if i % 2 == 0 else [("a", ROOT), ("b", tree)]
                for tag, where in order:
                    path = out / f"{tag}{i}.json"
                    run_tree(where, path, args.only, args.quick)
                    (before if tag == "b" else after).append(str(path))
                print(f"compare: round {i + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)
        args.out = out
    result = compare(before, after)
    print(table(result))
    if args.out:
        (args.out / "compare.json").write_text(json.dumps(result, indent=1))
        print(f"\nJSON: {args.out / 'compare.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
