"""The live view's layout (pure): the table fitted to a terminal's width, a view to its height,
columns aligned by display width, names escaped (tests/test_live_view_tmux.py checks the same
in a real terminal)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_client.timeouts import Timeouts
from ft_monitor.core.settings import Settings
from ft_monitor.views.live_view import HEADER, Row, clip, display_width, format_table, view_lines
from tests.test_observability import FakeMonitors, _stepped


def rows(section: str = "step", long_names: int = 0) -> list[Row]:
    mon = FakeMonitors()
    names = {f"section_with_a_long_name_{i}": 60 for i in range(long_names)}
    mon.timeouts = Timeouts.from_config(Settings(rank_section_timeouts={"step": 60, "data": 60, section: 60,
                                                                        **names}))
    _stepped(mon, 40, 2)
    mon.sessions[1].open_section(section, 0.0)  # type: ignore[union-attr]
    mon.now = 1.5
    out = [Row(f"/run/monitor{lr}.sock", st) for lr, st in mon.statuses().items()]
    out.append(Row("/run/monitor2.sock", None, "no answer: [Errno 111] Connection refused"))
    return out


def columns(table: str) -> list[int]:
    """Where each column starts, from the header (columns are two spaces apart)."""
    return [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", table.splitlines()[0])]


@pytest.mark.parametrize("width", [40, 60, 80, 120, 200])
def test_the_table_fits_the_terminal_and_stays_aligned(width: int) -> None:
    table = format_table(rows(long_names=3), width)
    lines = table.splitlines()
    assert all(display_width(line) <= width for line in lines), table
    starts = columns(table)
    assert len(starts) == len(HEADER) or width < 80  # every column from 80 on; narrower, lines are cut
    for line in lines[1:]:  # every cell holds text, starting under its header
        assert all(line[s - 1] == " " and line[s] != " " for s in starts[1:] if s < len(line)), table


def test_the_wide_columns_give_way_in_order_and_say_so() -> None:
    full = format_table(rows(long_names=3))
    assert "…" not in full and "section_with_a_long_name_2=60" in full
    at_120 = format_table(rows(long_names=3), 120)
    assert "step (1.5s/60.0s)" in at_120  # the timeouts gave way first
    assert all(line.endswith("…") for line in at_120.splitlines()[1:3]), at_120
    at_80 = format_table(rows("a_section_with_a_long_name", long_names=3), 80, mark="~")
    assert "a_section_w~  " in at_80 and "…" not in at_80  # the section cut to its least, 12


def test_wide_characters_count_two_columns() -> None:
    table = format_table(rows("ステップ"), 200)  # printable, two columns each
    starts = columns(table)
    row = table.splitlines()[2]
    end = row.index("ステップ (1.5s/60.0s)") + len("ステップ (1.5s/60.0s)")
    last_hb = end + len(row[end:]) - len(row[end:].lstrip())  # where the next cell starts, in characters
    assert display_width(row[:last_hb]) == starts[4] and last_hb == starts[4] - 4
    assert display_width("e\u0301") == 1 and display_width("ab") == 2


def test_names_that_do_not_print_are_escaped_everywhere() -> None:
    evil = "\x1b]0;owned\x07\r\n9 999 active"
    lines = view_lines([(f"/tmp/ft-launcher-\x1b[2J{evil}", rows(evil))], 200, heading="h")
    text = "\n".join(lines)
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert lines[0] == "h" and lines[1].startswith("'/tmp/ft-launcher-\\x1b[2J") and len(lines) == 6


def test_a_view_taller_than_the_window_is_cut_to_it_and_says_so() -> None:
    views = [(f"/run/{i}", rows()) for i in range(4)]  # 4 x 5 lines + 3 blank
    full = view_lines(views, 100, None, "heading")
    assert len(full) == 1 + 4 * 5 + 3
    cut = view_lines(views, 100, 10, "heading")
    assert len(cut) == 10 and cut[0] == "heading" and cut[:9] == full[:9]
    assert cut[-1] == f"… {len(full) - 9} more line(s): a taller window shows them, --json gives all"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.integers(0, 50))
def test_clip_never_exceeds_its_width(text: str, width: int) -> None:
    out = clip(text, width)
    assert display_width(out) <= width or (width == 0 and out == "")
    assert out == text or out.endswith("…") or width == 0


def test_status_lists_running_launchers_only_and_takes_the_runs_log_folder(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A new user's ``ft-launcher status`` listed other jobs' folders left by killed launchers as
    ``down ... Connection refused`` rows, and ``ft-launcher status RUN_DIR`` took another folder
    than ``ft-monitor report RUN_DIR``: now only folders whose sockets listen are listed, and the
    run's log folder leads to its launcher's."""
    import json
    import socket

    from ft_monitor.launcher.main import status_main
    from ft_monitor.views.live_view import find_run_dirs, listening_sockets, run_dir_of_log_folder

    live, stale = tmp_path / "ft-launcher-live", tmp_path / "ft-launcher-stale"
    live.mkdir(mode=0o700)
    stale.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live / "monitor0.sock"))
    listener.listen()
    gone = socket.socket(socket.AF_UNIX)
    gone.bind(str(stale / "monitor0.sock"))  # bound, never listening, closed: a file with no server, as after kill -9
    gone.close()
    try:
        assert str(live / "monitor0.sock") in listening_sockets()
        assert str(stale / "monitor0.sock") not in listening_sockets()
        assert find_run_dirs(str(tmp_path)) == [live]
        assert find_run_dirs(str(tmp_path), listening=set()) == [live, stale]  # no table: nothing passed over
        logs = tmp_path / "run_abc"  # the run's log folder, which the running launcher names in its own
        logs.mkdir()
        (logs / "events.jsonl").write_text(json.dumps({"kind": "launcher_start"}) + "\n")
        (live / "log-folder").write_text(str(logs))
        (live / "log-folder").chmod(0o600)
        assert run_dir_of_log_folder(logs, base=str(tmp_path)) == live
        assert run_dir_of_log_folder(tmp_path, base=str(tmp_path)) is None
        assert status_main([str(logs)]) == 1  # under /tmp, no running launcher names it
        assert f"no running launcher of yours writes to {logs} (it has exited)" in capsys.readouterr().err
    finally:
        listener.close()
