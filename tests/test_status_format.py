"""`ft-monitor status` text output, from hand-built status maps (no daemon)."""

from __future__ import annotations

from typing import Any

from ft_monitor.core.status import format_status


def timeouts(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "initial_rank_heartbeat_timeout": 60.0,
        "rank_heartbeat_timeout": 5.0,
        "rank_section_timeouts": {"step": 30.0, "ckpt": None},
        "rank_out_of_section_timeout": None,
        "learned": [],
    }
    base.update(changes)
    return base


def idle_status(**changes: Any) -> dict[str, Any]:
    st: dict[str, Any] = {
        "monitor_pid": 4321,
        "socket": "/run/ft/rank0.sock",
        "uptime_s": 12.345,
        "sessions": 0,
        "hangs_detected": 0,
        "timeouts": timeouts(),
        "connected": False,
    }
    st.update(changes)
    return st


def connected_status(**changes: Any) -> dict[str, Any]:
    st = idle_status(sessions=2)
    st.update({
        "connected": True,
        "rank": 3,
        "pid": 777,
        "phase": "active",
        "session_age_s": 100.04,
        "heartbeats": 41,
        "since_last_heartbeat_s": 0.26,
        "open_sections": [
            {"name": "step", "elapsed_s": 2.5, "timeout_s": 30.0, "warmup": False},
            {"name": "fwd", "elapsed_s": 1.0, "timeout_s": None, "warmup": False},
        ],
        "out_of_section_s": None,
        "steps_started": 7,
        "iteration": 1234,
        "events": 99,
        "next_deadline": {"reason": "section", "section": "step", "in_s": 27.5, "timeout_s": 30.0},
    })
    st.update(changes)
    return st


def test_not_connected() -> None:
    text = format_status(idle_status())
    lines = text.splitlines()
    assert lines[0] == "monitor pid 4321 on /run/ft/rank0.sock, up 12.3s, 0 session(s), 0 hang(s) detected"
    assert "rank: not connected" in lines
    assert "timeouts in force:" in lines
    assert "  initial heartbeat 60s, heartbeat 5s, out of section off" in lines
    assert "  section 'ckpt': off" in lines
    assert "  section 'step': 30s" in lines
    assert lines.index("  section 'ckpt': off") < lines.index("  section 'step': 30s")  # sorted by name
    assert "last hang" not in text
    assert "next deadline" not in text


def test_connected_with_open_sections() -> None:
    text = format_status(connected_status())
    assert ("rank 3 pid 777 (active), connected 100.0s ago, 41 heartbeat(s), last 0.3s ago, iteration 1234"
            in text)
    assert "  section 'step' open 2.5s, timeout 30.0s\n" in text
    assert "  section 'fwd' open 1.0s, timeout off\n" in text
    assert "  next deadline: section 'step' in 27.5s" in text
    assert "no section open" not in text
    assert "2 session(s)" in text


def test_connected_before_first_heartbeat_no_sections() -> None:
    st = connected_status(heartbeats=0, since_last_heartbeat_s=None, open_sections=[], out_of_section_s=3.21,
                          iteration=None,
                          next_deadline={"reason": "initial_heartbeat", "section": None, "in_s": 56.8,
                                         "timeout_s": 60.0})
    text = format_status(st)
    assert "0 heartbeat(s), last - ago" in text
    assert "iteration" not in text
    assert "  no section open (for 3.2s)" in text
    assert "  next deadline: initial_heartbeat in 56.8s" in text


def test_nothing_timed() -> None:
    st = connected_status(next_deadline=None, open_sections=[], out_of_section_s=1.0,
                          timeouts=timeouts(initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
                                            rank_section_timeouts={}))
    text = format_status(st)
    assert "next deadline" not in text
    assert "  initial heartbeat off, heartbeat off, out of section off" in text
    assert "section '" not in text


def test_learned_marks() -> None:
    t = timeouts(rank_heartbeat_timeout=7.25, rank_out_of_section_timeout=120.0,
                 rank_section_timeouts={"step": 42.5, "ckpt": 300.0},
                 learned=["rank_heartbeat_timeout", "rank_out_of_section_timeout", "section:step"])
    text = format_status(idle_status(timeouts=t))
    assert "initial heartbeat 60s, heartbeat 7.25s (learned), out of section 120s (learned)" in text
    assert "  section 'step': 42.5s (learned)" in text
    assert "  section 'ckpt': 300s\n" in text + "\n"
    assert text.count("(learned)") == 3


def test_warmup_section() -> None:
    st = connected_status(
        open_sections=[{"name": "step", "elapsed_s": 50.0, "timeout_s": 600.0, "warmup": True}],
        timeouts=timeouts(rank_section_timeouts={"step": 30.0, "warmup": 600.0}),
        steps_started=1,
    )
    text = format_status(st)
    assert "  section 'step' open 50.0s, timeout 600.0s (warm-up)" in text
    assert "  section 'warmup': 600s" in text


def test_warmup_section_with_timeout_off() -> None:
    st = connected_status(open_sections=[{"name": "step", "elapsed_s": 5.0, "timeout_s": None, "warmup": True}])
    assert "  section 'step' open 5.0s, timeout off (warm-up)" in format_status(st)


def test_hung_phase_and_last_hang() -> None:
    st = connected_status(
        phase="hung",
        hangs_detected=1,
        last_hang={"rank": 3, "pid": 777, "message": "section 'step' open for 30.0 s, timeout 30.0 s",
                   "report": "/var/ft/reports/hang-rank3-pid777.json"},
    )
    text = format_status(st)
    assert "1 hang(s) detected" in text
    assert "rank 3 pid 777 (hung)" in text
    assert text.splitlines()[-1] == ("last hang: rank 3 pid 777: section 'step' open for 30.0 s, timeout 30.0 s "
                                     "(report /var/ft/reports/hang-rank3-pid777.json)")


def test_last_hang_while_not_connected() -> None:
    st = idle_status(hangs_detected=2, sessions=2,
                     last_hang={"rank": 0, "pid": 5, "message": "no heartbeat for 5.1 s, heartbeat timeout 5.0 s",
                                "report": "/r/x.json"})
    text = format_status(st)
    assert "rank: not connected" in text
    assert "rank: not connected (its last session ended at iteration 17)" in format_status({**st, "last_iteration": 17})
    assert "last hang: rank 0 pid 5: no heartbeat for 5.1 s, heartbeat timeout 5.0 s (report /r/x.json)" in text


def test_status_from_a_real_timeouts_map() -> None:
    from ft_client.timeouts import Timeouts

    t = Timeouts(rank_heartbeat_timeout=5.0, rank_section_timeouts={"step": 10.0},
                 learned=frozenset({"section:step"})).to_wire()
    text = format_status(idle_status(timeouts=t))
    assert "  initial heartbeat off, heartbeat 5s, out of section off" in text
    assert "  section 'step': 10s (learned)" in text


def test_the_last_exit_and_last_gone_travel_in_status_and_anything_else_there_is_none() -> None:
    from ft_client.timeouts import Timeouts
    from ft_monitor.core.status import ExitSummary, MonitorStatus, build_status

    exit_ = ExitSummary(4242, "RuntimeError: bad batch", 123.5)
    st = build_status(now=200.0, monitor_pid=1, socket="/s", started_at=100.0, sessions=1, timeouts=Timeouts(),
                      iteration_high=None, session=None, hangs=[], last_exit=exit_)
    assert MonitorStatus.from_wire(st.to_wire()).last_exit == exit_
    gone = ExitSummary(4243, "connection closed in phase active", 124.0)
    st = build_status(now=200.0, monitor_pid=1, socket="/s", started_at=100.0, sessions=1, timeouts=Timeouts(),
                      iteration_high=None, session=None, hangs=[], last_exit=exit_, last_gone=gone)
    assert MonitorStatus.from_wire(st.to_wire()).last_gone == gone
    assert MonitorStatus.from_wire({k: v for k, v in st.to_wire().items() if k != "last_gone"}).last_gone is None
    for bad in ("x", {"pid": True, "reason": "r", "at": 1.0}, {"pid": 1, "reason": 7, "at": 1.0},
                {"pid": 1, "reason": "r", "at": "soon"}, None):
        assert MonitorStatus.from_wire({**st.to_wire(), "last_exit": bad}).last_exit is None
        assert MonitorStatus.from_wire({**st.to_wire(), "last_gone": bad}).last_gone is None


def test_snapshot_memory_is_one_line_and_absent_from_an_older_monitor() -> None:
    mib = 1 << 20
    assert not any(line.startswith("snapshots:") for line in format_status(idle_status()).splitlines())
    held = {"held": 4 * 100 * mib, "limit": 16 << 30, "own": {"bytes": 100 * mib, "buffers": 2, "step": 120},
            "peer": {"bytes": 100 * mib, "buffers": 2, "step": None}}
    assert "snapshots: 2 x 100.0 MiB own (step 120), 2 x 100.0 MiB peer, 400.0 MiB held of 16.0 GiB" in \
        format_status(idle_status(snapshots=held)).splitlines()
    none = {"held": 0, "limit": 16 << 30, "own": None, "peer": None}
    assert "snapshots: none held" in format_status(connected_status(snapshots=none)).splitlines()
    off = {"held": 0, "limit": 0, "own": None, "peer": None}
    assert "snapshots: off (snapshot_max_bytes is 0)" in format_status(idle_status(snapshots=off)).splitlines()
    # what is not a snapshot map is read as none sent (a reader never fails on it)
    for odd in ({"held": -1, "limit": 0}, {"held": True, "limit": 1}, [], "x"):
        assert "snapshots:" not in format_status(idle_status(snapshots=odd))
    odd_pair = {"held": 1, "limit": 2, "own": {"bytes": "x", "buffers": 2}, "peer": {"bytes": 4096, "buffers": 2,
                                                                                    "step": True}}
    assert "snapshots: 2 x 4.0 KiB peer, 1 bytes held of 2 bytes" in format_status(idle_status(snapshots=odd_pair))
