"""`ft-monitor report` opened in headless Chromium, as a person would open it (issue 29).

Three real runs, as the demo makes them: the process restart (rank 1 hangs at step 12;
Flight Recorder on, warm restart), the in-process restart (``--ft-on-hang inprocess``)
and two launchers on one rendezvous (rank 3 of node 1 hangs; the page is made from both
nodes' run folders). Each page is opened in Chromium (Debian's ``chromium`` package;
scripts/setup-env installs it where apt-get can) over the DevTools protocol
(tests/browser.py) and must:

* log nothing at level error to the console, and fetch nothing;
* show the verdict line the launcher decided and the culprit it named, in the header;
* draw a lane for every rank of the job, and the restart phases of the kind of restart
  that happened, with that kind's legend (and no other's);
* link only to files that exist, by relative links, among them the evidence the launcher
  wrote (diagnosis.json, the stack dumps, the hang reports, error.json, events.jsonl);
* hold no Python repr, no empty bullet, nothing wider than the window; print to PDF.

The three tests run their launchers in parallel under xdist (one run each, about as long
as the demo's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

from ft_monitor.launcher.telemetry.events import RESTART_PHASES
from tests.browser import Page, chromium, open_page
from tests.launchers import Launcher, two_nodes
from tests.procs import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400),
              pytest.mark.skipif(chromium() is None, reason="no chromium: scripts/setup-env installs Debian's chromium "
                                                           "package where apt-get runs as root; the page is not "
                                                           "opened in a browser here")]

FR = ("--ft-flight-recorder-entries", "2000")
DEMO = ("--max-restarts", "2", *FR, "--ft-warm-restart", "--ft-preload", "auto")
"""The demo's flags (scripts/demo), less its ports and output files."""
INPROCESS = ("--ft-on-hang", "inprocess", "--ft-inprocess-restart-timeout", "5")


def _report(*run_dirs: Path) -> Path:
    out = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "report", *map(str, run_dirs)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def _targets(page: Page, html_file: Path) -> set[Path]:
    """Every link's target: relative in the page, a file that exists."""
    found = set()
    for link in page.dom["links"]:
        raw, href = link["raw"], link["href"]
        assert not urlparse(raw).scheme and not raw.startswith("/"), f"not a relative link: {raw}"
        target = Path(unquote(urlparse(href).path))
        assert target.is_file(), f"link {raw!r} ({link['text']!r}) points at nothing"
        assert target == (html_file.parent / unquote(raw)).resolve()
        found.add(target)
    return found


def _incidents(*summaries: dict[str, Any]) -> int:
    """The incidents the launchers recorded: each hang (once, by its culprit), and each failed
    attempt that restarted the job (a busy machine sometimes adds one: a worker that could not
    bind its store's port, say); the page must show them all."""
    hangs = {(h["attempt"], h["rank"]) for s in summaries for h in s["hangs"] if h.get("victim_of") is None}
    hangs |= {(r["attempt"], r["rank"]) for s in summaries for r in s.get("inprocess_restarts", [])}
    failures = {r["attempt"] for s in summaries for r in s["restarts"] if r["cause"] == "failure"}
    return len(hangs) + len(failures)


def _common_checks(page: Page, ranks: list[int], mode: str, incidents: int) -> None:
    assert page.console == [], page.console
    assert page.requests == [], page.requests  # self-contained: nothing fetched
    dom = page.dom
    assert sorted(map(int, dom["lanes"])) == ranks, dom["lanes"]
    assert [lane["mode"] for lane in dom["restartLanes"]] == [mode]
    (drawn,) = dom["restartLanes"]
    assert drawn["phases"] and set(drawn["phases"]) <= set(RESTART_PHASES[mode])
    assert [(lg["mode"], lg["items"]) for lg in dom["legends"]] == [(mode, list(RESTART_PHASES[mode]))]
    body = dom["body"]
    assert "{'" not in body and "': " not in body, "a Python repr on the page"
    assert dom["emptyItems"] == 0 and not dom["wide"]
    assert dom["ticks"] > 0 and dom["hangs"] == 1 and dom["incidents"] == incidents
    assert page.screenshot.startswith(b"\x89PNG") and page.pdf.startswith(b"%PDF")


def _evidence_named(summary_files: list[str], targets: set[Path]) -> None:
    for f in summary_files:
        assert Path(f).resolve() in targets, f"{f} is not linked"


def test_the_demos_process_restart_page(workdir: Path) -> None:
    la = Launcher(workdir, *DEMO, train_args=("--hang", "rank=1,step=12,attempt=0"), warm=False)  # the demo's own
    summary = la.succeed()
    (hang,) = summary["hangs"]
    page_file = _report(Path(summary["observability"]["events"]).parent)
    page = open_page(page_file)
    _common_checks(page, [0, 1], "process", _incidents(summary))
    assert page.dom["verdict"] == f"verdict: {hang['verdict']}"
    assert page.dom["headline"].startswith("Rank 1 hung at iteration 12 in attempt 0, in train_ddp.py:")
    assert "the job restarted its processes" in page.dom["headline"] and "exit code 0" in page.dom["headline"]
    culprit, waiting = page.dom["stacks"]
    assert (culprit["ranks"], waiting["ranks"]) == ([1], [0]) and "write_metrics_to_stuck_filesystem" in culprit["text"]
    targets = _targets(page, page_file)
    _evidence_named([hang["diagnosis"], hang["stack_dump"], hang["report"], hang["error_file"],
                     summary["observability"]["events"]], targets)
    names = {t.name for t in targets}
    assert any(n.startswith("rank0-") and n.endswith("-stack.txt") for n in names)  # the waiting rank's, too


def test_the_demos_inprocess_restart_page(workdir: Path) -> None:
    la = Launcher(workdir, *DEMO, *INPROCESS, train_args=("--inprocess", "--hang", "rank=1,step=12,attempt=0"),
                  warm=False)
    summary = la.succeed()
    (row,) = summary["inprocess_restarts"]
    page_file = _report(Path(summary["observability"]["events"]).parent)
    page = open_page(page_file)
    _common_checks(page, [0, 1], "inprocess", _incidents(summary))
    headline = page.dom["headline"]
    assert headline.startswith("Rank 1 hung at iteration 12 in attempt 0, in train_ddp.py:"), headline
    assert "restarted the training function in their own processes" in headline
    assert page.dom["restartLanes"][0]["phases"] == [p for p in RESTART_PHASES["inprocess"]
                                                     if row["phases"].get(p) is not None]
    (culprit,) = page.dom["stacks"]
    assert culprit["ranks"] == [1] and "write_metrics_to_stuck_filesystem" in culprit["text"]
    targets = _targets(page, page_file)
    _evidence_named([row["report"], summary["observability"]["events"]], targets)
    assert any(t.name == f"rank1-pid{row['pid']}-stack.txt" for t in targets)


def test_two_launchers_make_one_page(workdir: Path) -> None:
    a, b = two_nodes(workdir, "ft-report-page", "--max-restarts", "1", *FR,
                     train_args=("--hang", "rank=3,step=12,attempt=0"))
    hangs = a.summary()["hangs"] + b.summary()["hangs"]
    culprit = next(h for h in hangs if h.get("victim_of") is None)
    assert culprit["rank"] == 3
    folders = [Path(la.summary()["observability"]["events"]).parent for la in (a, b)]
    page_file = _report(*folders)
    assert page_file == workdir / "report.html"  # beside both nodes' log directories
    page = open_page(page_file)
    _common_checks(page, [0, 1, 2, 3], "process", _incidents(a.summary(), b.summary()))
    assert page.dom["verdict"] == f"verdict: {culprit['verdict']}"
    assert page.dom["headline"].startswith("Rank 3 (node 1) hung at iteration 12 in attempt 0"), page.dom["headline"]
    targets = _targets(page, page_file)
    _evidence_named([culprit["diagnosis"], culprit["stack_dump"], culprit["error_file"],
                     *(la.summary()["observability"]["events"] for la in (a, b))], targets)
    doc = json.loads(Path(culprit["diagnosis"]).read_text())
    culprit_stack, *waiting = page.dom["stacks"]
    assert culprit_stack["ranks"] == [3] and "write_metrics_to_stuck_filesystem" in culprit_stack["text"]
    assert sorted(r for s in waiting for r in s["ranks"]) == doc["verdict"]["waiting"] == [0, 1, 2]


def test_the_browser_check_sees_console_errors_and_fetches(tmp_path: Path) -> None:
    """The harness itself: a page that logs an error, throws, and fetches an image is caught
    on all three counts (so an empty list above means none happened)."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><title>t</title></head><body><p class="headline">x</p>'
                   '<img src="missing.png"><script>console.error("boom"); null.x;</script></body></html>')
    page = open_page(bad)
    assert any("console.error: boom" in c for c in page.console), page.console
    assert any(c.startswith("exception:") for c in page.console), page.console
    assert any("missing.png" in c for c in page.console), page.console  # the failed load, logged
    assert any(r.endswith("/missing.png") for r in page.requests), page.requests
    assert page.dom["headline"] == "x"
