"""The live views in a real terminal: `ft-monitor status --all DIR` and `ft-launcher status
--watch` run in tmux against a running ft-launcher job (two gloo ranks,
tests/workers/live_names.py), the screen read back with `tmux capture-pane -p`.

Checked as an operator would see it: the columns line up at 80 and at 200 columns (no line
wraps; cells that do not fit are cut); a section name holding escape sequences and a line
break (rank 1's) shows as harmless text (the screen is not cleared, the pane not retitled, no
row forged); `--watch` redraws in place: its first line stays its heading across redraws,
including after the window is widened, and tmux's history does not grow.

tmux comes from the system (scripts/setup-env installs it with apt where it runs as root);
without it the test is skipped and says why. Every wait polls the screen or the job for what
it waits for, bounded (scaled by `slack`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ft_monitor.launcher import exit_codes
from ft_monitor.views.live_view import HEADER, gather, to_json
from tests.launchers import Launcher
from tests.procs import ROOT, WORKERS, cleanup_dir, short_tmpdir, wait_until
from tests.workers.live_names import EVIL

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("tmux") is None,
                                 reason="tmux is not installed (scripts/setup-env installs it with apt where it runs "
                                        "as root): the live view cannot be checked in a real terminal")]

HEIGHT = 30


class Tmux:
    """A tmux server of the test's own (its own socket and config), stopped at the end."""

    def __init__(self, workdir: Path) -> None:
        self.socket = workdir / "tmux.sock"
        self.conf = workdir / "tmux.conf"
        # no status line: the pane is the whole window
        self.conf.write_text("set -g status off\nset -g history-limit 10000\n")
        # the pane's size must come from the terminal, not from variables the test run inherited
        self.env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}

    def __call__(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-S", str(self.socket), "-f", str(self.conf), *args], capture_output=True,
                              text=True, timeout=30, env=self.env)
        assert done.returncode == 0, (args, done.stderr)
        return done.stdout

    def start(self, name: str, argv: list[str], width: int) -> None:
        """``argv`` in a new session's pane, ``width`` columns by HEIGHT rows; then the shell says
        its exit status and waits (the pane stays, unchanged, until the server stops)."""
        command = f"{shlex.join(argv)}; echo \"exit status $?\"; exec sleep 3600"
        self("new-session", "-d", "-s", name, "-x", str(width), "-y", str(HEIGHT), "-c", str(ROOT),
             shlex.join(["bash", "--norc", "--noprofile", "-c", command]))

    def screen(self, name: str) -> list[str]:
        return self("capture-pane", "-p", "-t", name).splitlines()

    def get(self, name: str, fmt: str) -> str:
        return self("display-message", "-p", "-t", name, fmt).strip()

    def exit_status(self, name: str) -> int:
        """Wait for the pane's command to end; its exit status, as its shell printed it."""
        found: list[int] = []

        def ended() -> bool:
            found[:] = [int(m.group(1)) for line in self.screen(name) if (m := re.fullmatch(r"exit status (\d+)", line))]
            return bool(found)

        wait_until(ended, 60, f"{name}'s command to end", interval=0.1)
        return found[-1]

    def stop(self) -> None:
        subprocess.run(["tmux", "-S", str(self.socket), "kill-server"], capture_output=True, timeout=30, env=self.env)


def table(screen: list[str], width: int) -> list[list[str]]:
    """The live view's table on ``screen``, checked to be aligned: the header, then a line
    per rank, each no wider than ``width``, every column starting where its header does
    (after a space, with text there); returns each rank's cells."""
    (top,) = [i for i, line in enumerate(screen) if line.startswith("rank  ")]
    header, *rows = screen[top:top + 3]
    assert all(len(line) <= width for line in screen), screen
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", header)]
    labels = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
    assert len(starts) == len(HEADER) and all(h.startswith(label.rstrip("…~")) for h, label in zip(HEADER, labels)), \
        header
    cells = []
    for line in rows:
        assert all(line[s - 1] == " " and line[s] != " " for s in starts[1:]), (header, line)
        cells.append([line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])])
    assert [c[0] for c in cells] == ["0", "1"] and all(c[1].isdigit() and c[2] == "active" for c in cells), cells
    assert cells[0][6].isdigit() and cells[1][6] == "-" and all(c[7] == "0" for c in cells), cells  # rank 1: no step
    return cells


def harmless(screen: list[str], tmux: Tmux, name: str) -> None:
    """Rank 1's section name was shown as text: its escapes and line break did nothing."""
    assert not any(line.startswith("9 999") for line in screen), screen  # no forged row
    assert "pwned" not in tmux.get(name, "#{pane_title}")  # not retitled
    assert any("'evil\\x1b[" in line for line in screen), screen  # shown, escaped (the screen not cleared)


@pytest.fixture
def job() -> Iterator[tuple[Launcher, str, Path]]:
    workdir = short_tmpdir()
    stop = workdir / "stop"
    la = Launcher(workdir, "--max-restarts", "0", entry=(str(WORKERS / "live_names.py"),),
                  train_args=("--stop-file", str(stop)))
    try:
        m = wait_until(lambda: re.search(r"monitor\(s\) ready in (\S+)", la.output()), 120, "the launcher's monitors")
        run_dir = m.group(1)

        def both_ranks_in() -> bool:
            rows = to_json(gather(run_dir))
            return [r.get("rank") for r in rows] == [0, 1] and rows[1].get("section") == EVIL

        wait_until(both_ranks_in, 120, "both ranks connected, rank 1 in its oddly named section", interval=0.2)
        yield la, run_dir, workdir
        stop.touch()
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
        cleanup_dir(workdir)


def test_the_live_views_in_a_real_terminal(job: tuple[Launcher, str, Path]) -> None:
    _, run_dir, workdir = job
    tmux = Tmux(workdir)
    try:
        # ft-monitor status --all, once, in an 80- and a 200-column terminal
        for width in (80, 200):
            name = f"once{width}"
            tmux.start(name, [sys.executable, "-m", "ft_monitor.cli", "status", "--all", run_dir], width)
            status = tmux.exit_status(name)
            screen = tmux.screen(name)
            assert status == 0 and tmux.get(name, "#{history_size}") == "0", screen
            assert screen[0] == f"{run_dir}:", screen
            cells = table(screen, width)
            harmless(screen, tmux, name)
            if width == 80:  # the wide columns gave way: cut, marked
                assert cells[1][3].startswith("'evil\\x1b[") and cells[1][3][-1] in "…~", cells
            else:  # the whole name, escaped, with the section's age and timeout; the timeouts from the start
                assert cells[1][3].startswith(repr(EVIL) + " (") and cells[1][3].endswith("/600.0s)"), cells
                assert cells[0][8].startswith(f"ckpt=120 data=60 {EVIL!r}=600"), cells

        # ft-launcher status --watch: redrawn in place, at 80 columns and then widened to 200
        name = "watch"
        heading = re.compile(r"ft-launcher status: every 0\.2s, \d\d:\d\d:\d\d \(Ctrl-C stops\)$")
        tmux.start(name, [sys.executable, "-m", "ft_monitor.launcher.main", "status", run_dir, "--watch", "0.2"], 80)
        wait_until(lambda: heading.match(tmux.screen(name)[0]) and any(
            line.startswith("1  ") for line in tmux.screen(name)), 60, "the first view", interval=0.1)
        history = tmux.get(name, "#{history_size}")
        seen: set[str] = set()

        def redrawn(width: int, want: int) -> bool:
            screen = tmux.screen(name)
            assert heading.match(screen[0]), screen  # the heading stays the first line: nothing scrolled
            if tmux.screen(name) != screen:
                return False  # read while a view was being drawn over the last: read a settled one
            assert screen[1] == f"{run_dir}:", screen
            assert tmux.get(name, "#{history_size}") == history  # and nothing went into the history
            table(screen, width)
            harmless(screen, tmux, name)
            seen.add(screen[0])
            return len(seen) >= want

        wait_until(lambda: redrawn(80, 3), 60, "three redraws with new times at 80 columns", interval=0.1)
        tmux("resize-window", "-t", name, "-x", "200", "-y", str(HEIGHT))
        wait_until(lambda: any(len(line) > 80 for line in tmux.screen(name)), 60, "a redraw at 200 columns",
                   interval=0.1)
        want = len(seen) + 2
        wait_until(lambda: redrawn(200, want), 60, "two more redraws at 200 columns", interval=0.1)
        tmux("send-keys", "-t", name, "C-c")
        assert tmux.exit_status(name) == 0
        screen = tmux.screen(name)  # the last view stays, the shell's line below it
        assert heading.match(screen[0]) and tmux.get(name, "#{history_size}") == history, screen
    finally:
        tmux.stop()
