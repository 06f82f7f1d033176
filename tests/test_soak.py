"""Soak (excluded by default; run with `pytest -m soak`): bench/soak.py for 20 s,
8 daemon/rank pairs with hangs and crashes injected; every check must hold."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.soak


@pytest.fixture(autouse=True)
def only_when_selected(request: pytest.FixtureRequest) -> None:
    """Runs only when the -m expression asks for soak (`-m soak`, `-m "soak or e2e"`),
    not under a plain `pytest` nor an unrelated `-m "not e2e"`."""
    if not re.search(r"(?<!not )\bsoak\b", request.config.getoption("markexpr") or ""):
        pytest.skip("soak test: run with `pytest -m soak`")


@pytest.mark.timeout(300)
def test_soak_20s(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--seconds", "20", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.exists(), run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["checks"] == {"every_hang_caught": True, "no_false_kill": True, "events_equal": True,
                                "rss_flat": True}, json.dumps(result, indent=2)
    assert result["injected_hangs"] > 0 and result["event_checks"] > 0
    assert run.returncode == 0
