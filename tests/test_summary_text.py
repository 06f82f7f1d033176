"""The launcher's closing summary as text (summary_text.py, pure): aligned ``key : value``
lines from the summary's JSON form, no Python reprs, peer text escaped."""

from __future__ import annotations

import re
from typing import Any

from ft_monitor.launcher.telemetry import summary_text
from ft_monitor.launcher.telemetry.summary_text import Evidence

LOGS = "/tmp/run/logs/job"
HANG = {"rank": 1, "local_rank": 1, "pid": 4080, "attempt": 0, "message": "section 'step' open for 2.0 s, timeout 2.0 s",
        "elapsed_s": 2.0003, "timeout_s": 2.0, "victim_of": None, "stack_dump_captured": True,
        "stack_dump": f"{LOGS}/attempt_0/1/rank1-pid4080-stack.txt", "error_file": f"{LOGS}/attempt_0/1/error.json",
        "verdict": "rank 1 never entered all_reduce #23 on the default group (train.py:68 in f); rank 0 waits in "
                   "all_reduce #23", "diagnosis": f"{LOGS}/attempt_0/diagnosis.json"}
RESTART = {"cause": "hang", "rank": 1, "attempt": 0, "message": "", "notify": 0.113, "to_stop": 0.153, "stop": 0.221,
           "rendezvous": 2.292, "worker_start": 13.888, "first_step": 0.265, "total": 16.932}
OBS = {"events": f"{LOGS}/events.jsonl", "metrics_url": "http://127.0.0.1:39319/metrics",
       "metrics_textfile": "/tmp/run/ft.prom", "goodput": 0.0342, "productive_s": 1.84, "wall_s": 53.8, "lost_s": 19.1,
       "incidents": [{"rank": 1}], "slow_ranks": [3, 5]}
WARM = {"forked": {"1": [11, 12], "2": [13, 14]}, "fallbacks": [], "preload": ["torch"]}
EVIDENCE = Evidence(where=lambda p: "train.py:68 in f" if p == HANG["stack_dump"] else None,
                    report_dump=lambda p: "/r/stack.txt" if p == "/r/report.json" else None)


def summary(**changes: Any) -> dict[str, Any]:
    base = {"exit_code": 0, "hangs": [HANG], "restarts": [RESTART], "inprocess_restarts": [],
            "attempts": [{"attempt": 0, "pids": {"1": 4080, "0": 4079}}, {"attempt": 1, "pids": {"0": 4581, "1": 4584}}],
            "diagnoses": [], "monitor_restarts": 0, "outcome": "", "warm_restarts": WARM, "observability": OBS}
    return {**base, **changes}


def text(data: dict[str, Any]) -> str:
    return summary_text.format_rows(summary_text.rows(data, EVIDENCE))


def fields(out: str) -> list[tuple[str, str]]:
    """Every ``key : value`` line, checking that the colons share one column."""
    lines = [line for line in out.splitlines()[1:] if line]
    columns = {line.index(" : ") for line in lines}
    assert len(columns) == 1, out
    return [(k.strip(), v) for k, v in (line.split(" : ", 1) for line in lines)]


def test_a_hang_restarted_reads_as_aligned_key_value_lines() -> None:
    out = text(summary())
    assert out.splitlines()[0] == "ft-launcher summary:"
    got = dict(fields(out))
    assert got["hung rank"] == "rank 1 (local rank 1, pid 4080) in attempt 0"
    assert got["what"] == HANG["message"]
    assert got["caught"] == "0.3 ms after the 2.0 s timeout expired"
    assert got["where"] == "train.py:68 in f"
    assert got["verdict"] == HANG["verdict"] and got["diagnosis"] == HANG["diagnosis"]
    assert got["stack dump"] == HANG["stack_dump"] and got["error file"] == HANG["error_file"]
    assert got["restart"] == ("all ranks running again 16.93 s after detection (notify 0.113s, to_stop 0.153s, "
                              "stop 0.221s, rendezvous 2.292s, worker_start 13.888s, first_step 0.265s)")
    assert got["worker pids"] == "attempt 0: 4079, 4080; attempt 1: 4581, 4584"
    assert got["warm restarts"] == "attempt 1 (2 forked), attempt 2 (2 forked)"
    assert got["goodput"] == "0.034 (1.8 s productive step time of 53.8 s wall time; 19.1 s lost to hangs and crashes)"
    assert got["slow ranks"] == "3, 5"
    assert got["report"] == f"ft-monitor report {LOGS}"
    assert got["exit code"] == "0"
    # the incident, a blank line, then the run
    assert out.index("error file") < out.index("\n\n") < out.index("worker pids")


def test_no_python_repr_reaches_the_text() -> None:
    data = summary(monitor_restarts=2, outcome="no progress in 3 restarts",
                   diagnoses=[{"action": "dump", "rank": 2, "attempt": 0, "verdict": "v", "diagnosis": "/d.json"}],
                   inprocess_restarts=[{"rank": 1, "pid": 7, "attempt": 0, "iteration": 1, "message": "m",
                                        "report": "/r/report.json",
                                        "phases": {"notify": 0.03, "abort": 0.01, "total": 0.04}}],
                   restarts=[RESTART, {"cause": "failure", "attempt": 1, "message": "rank 0 (pid 9) exited with code 1",
                                       "total": None}])
    out = text(data)
    assert not re.search(r"[{}\[\]]|'\w+': ", out), out
    got = fields(out)
    keys = [k for k, _ in got]
    assert keys.count("verdict") == 2 and ("monitors restarted", "2") in got
    assert ("stopped", "no progress in 3 restarts") in got
    assert ("failed", "rank 0 (pid 9) exited with code 1 in attempt 1; the worker group restarted") in got
    assert ("restart", "in-process restart 1 (same processes), all ranks back in their step loop 0.04 s after the "
                       "fault (notify 0.030s, abort 0.010s)") in got
    assert ("where", "train.py:68 in f") in got and ("hang report", "/r/report.json") in got
    assert ("diagnosed", "rank 2 in attempt 0, left running (on_hang: dump)") in got


def test_a_victim_and_a_reporter_are_named_as_the_decision_named_them() -> None:
    victim = {**HANG, "victim_of": 3, "stack_dump_captured": False}
    reported = {**HANG, "reported_by": {"rank": 0, "message": "section 'step' open for 2.1 s"}}
    got = fields(text(summary(hangs=[victim, reported], restarts=[RESTART, RESTART])))
    assert ("hung rank", "rank 3 (another node) in attempt 0") in got
    # the waiting rank's own timer and frame are said under its name, never under the culprit's "what"/"where"
    assert ("waiting here", f"rank 1 (local rank 1, pid 4080): {HANG['message']}") in got
    assert [k for k, _ in got].count("what") == 1  # the reporter's incident only
    assert ("reported by", "rank 0's monitor, whose rank waited for it: section 'step' open for 2.1 s") in got
    assert [k for k, _ in got].count("restart") == 2 and [k for k, _ in got].count("caught") == 1


def test_text_a_rank_chose_cannot_reach_the_terminal_raw() -> None:
    evil = "step\x1b[2J\x1b[31m\nFAKE : line\r"
    out = text(summary(hangs=[{**HANG, "message": evil, "verdict": evil}]))
    assert "\x1b" not in out and "\r" not in out and "FAKE : line" not in out.splitlines()[2:]
    assert all(line == "" or " : " in line for line in out.splitlines()[1:])


def test_evidence_that_cannot_be_read_leaves_its_line_out(tmp_path: Any) -> None:
    real = summary_text.read_evidence()
    assert real.where(str(tmp_path / "missing.txt")) is None
    junk = tmp_path / "report.json"
    junk.write_text("[1, 2")
    assert real.report_dump(str(junk)) is None
    junk.write_text('{"stack_dump_captured": true, "stack_dump": 5}')
    assert real.report_dump(str(junk)) is None
    dump = tmp_path / "stack.txt"
    dump.write_text('Current thread 0x00007f (most recent call first):\n'
                    '  File "/w/train.py", line 68 in write_metrics\n  File "/w/train.py", line 90 in <module>\n')
    junk.write_text(f'{{"stack_dump_captured": true, "stack_dump": "{dump}"}}')
    assert real.report_dump(str(junk)) == str(dump)
    assert real.where(str(dump)) == "train.py:68 in write_metrics"
    got = dict(fields(summary_text.format_rows(summary_text.rows(summary(hangs=[{**HANG, "stack_dump": str(dump)}]),
                                                                 real))))
    assert got["where"] == "train.py:68 in write_metrics"


def test_timeouts_in_force_read_as_name_seconds_pairs() -> None:
    from ft_client.timeouts import Timeouts

    t = Timeouts(initial_rank_heartbeat_timeout=120, rank_heartbeat_timeout=60.0,
                 rank_section_timeouts={"step": 2.0, "ckpt": 0.25, "data": None, "bad\x1b[2J": 5.0},
                 learned=frozenset({"section:step"}))
    assert t.describe() == ("step=2.0s ckpt=0.25s data=off 'bad\\x1b[2J'=5.0s heartbeat=60.0s "
                            "initial_heartbeat=120.0s out_of_section=off")
