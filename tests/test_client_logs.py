"""The client's warnings name their rank when the script has not configured logging, and go
once, in the script's format, when it has (ft_client/logs.py). In a new interpreter: pytest
configures logging itself."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import ROOT

SCRIPT = """
import logging
import ft_client.client.control  # any client module that logs installs the handler
logging.getLogger("ft_client.inprocess").warning("the monitor asks for an in-process restart")
logging.getLogger("ft_client").info("not shown: below WARNING, as Python's own last resort")
logging.basicConfig(format="SCRIPT %(name)s %(message)s")
logging.getLogger("ft_client.snapshot").warning("no snapshot to restore")
"""


def run(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 0, done
    return done.stderr.splitlines()


def test_a_client_warning_names_its_rank_then_follows_the_scripts_logging() -> None:
    # each in-process restart printed bare client lines on stderr, from every rank alike
    assert run({"RANK": "3"}) == ["[rank 3] ft_client.inprocess WARNING: the monitor asks for an in-process restart",
                                  "SCRIPT ft_client.snapshot no snapshot to restore"]
    assert run({})[0] == "ft_client.inprocess WARNING: the monitor asks for an in-process restart"  # no torchrun
