"""The launcher's closing summary as text: aligned ``key : value`` lines (pure).

`rows` reads the summary in its JSON form, the very dict ``--ft-summary-json`` writes
(main.py builds it once, from the hangs as `decide.with_diagnosis` decided them, the
restart timings, the in-process rows, the diagnoses and the telemetry's summary), so
the text says nothing the JSON does not and recomputes nothing: the culprit, the verdict
and the counts are the incident decision's. The one thing read from elsewhere is the
frame a stack dump's main thread was in (``where``), through the `Evidence` seam, whose
real reader (`read_evidence`) reads the dump the decision names.

`format_rows` aligns the keys; a None row is a blank line between incidents. Every value
a rank, a monitor or a peer chose (messages, section names, paths) is shown through
`server_log.printable`, so no escape sequence reaches the operator's terminal.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_monitor.core.server_log import printable
from ft_monitor.launcher.incident.crash import UNSEEN

Row = tuple[str, str] | None
"""A ``key : value`` line, or None for a blank line."""

HEADING = "ft-launcher summary:"

PROCESS_PHASES = ("notify", "to_stop", "stop", "rendezvous", "worker_start", "first_step")
"""A process restart's phases, in order (`restarts.RestartTiming.breakdown`)."""

MAX_DUMP_BYTES = 1 << 20
"""How much of a stack dump (its end: the newest dump) is read for ``where``."""


@dataclass(frozen=True)
class Evidence:
    """What the summary reads from files the run wrote (a seam: tests pass their own)."""

    where: Callable[[str], str | None]
    """A stack dump's path -> the innermost frame of its main thread's own code, or None."""
    report_dump: Callable[[str], str | None]
    """A hang report's path -> the stack dump it names, or None."""


NO_EVIDENCE = Evidence(lambda _path: None, lambda _path: None)


def read_evidence() -> Evidence:
    """The real readers: bounded reads of files of ours; whatever is unreadable or not what
    our writers write is None (the line is left out)."""
    from ft_client.safefiles import read_bounded
    from ft_monitor.forensics import stacks

    def where(path: str) -> str | None:
        try:
            text = read_bounded(path, MAX_DUMP_BYTES)
        except (OSError, ValueError):
            return None
        return stacks.where(stacks.main_thread(stacks.parse(text)))

    def report_dump(path: str) -> str | None:
        try:
            data = json.loads(read_bounded(path, MAX_DUMP_BYTES))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("stack_dump_captured") is not True:
            return None
        dump = data.get("stack_dump")
        return dump if isinstance(dump, str) else None

    return Evidence(where, report_dump)


def _secs(v: Any, digits: int = 2, unit: str = " s") -> str:
    return f"{float(v):.{digits}f}{unit}"


def phases_text(phases: Mapping[str, Any], order: Sequence[str] | None = None, digits: int = 3) -> str:
    """``notify 0.113s, to_stop 0.153s, ...``: the phases that were timed, in order."""
    names = order if order is not None else [k for k in phases if k != "total"]
    return ", ".join(f"{k} {_secs(phases[k], digits, 's')}" for k in names if phases.get(k) is not None)


def _pids(attempts: Iterable[Mapping[str, Any]]) -> str:
    parts = []
    for a in attempts:
        pids = a.get("pids") or {}
        ordered = [str(p) for _, p in sorted(pids.items(), key=lambda kv: int(kv[0]))]
        parts.append(f"attempt {a.get('attempt')}: {', '.join(ordered) or '-'}")
    return "; ".join(parts)


def _hang_rows(hang: Mapping[str, Any], restart: Mapping[str, Any] | None, evidence: Evidence) -> list[Row]:
    waiting = hang.get("waiting")
    here: Mapping[str, Any] = waiting if isinstance(waiting, Mapping) else hang  # a culprit elsewhere: ours waited
    who = f"rank {here.get('rank')} (local rank {here.get('local_rank')}, pid {here.get('pid')})"
    out: list[Row] = []
    victim = hang.get("victim_of") is not None
    if victim:  # what this node saw is its waiting rank's: said under that name, never as the culprit's
        out.append(("hung rank", f"rank {hang['victim_of']} (another node) in attempt {hang.get('attempt')}"))
        out.append(("waiting here", f"{who}: {printable(hang.get('message', ''))}"))
    else:
        out.append(("hung rank", f"{who} in attempt {hang.get('attempt')}"))
        out.append(("what", printable(hang.get("message", ""))))
        late_ms = (float(hang.get("elapsed_s") or 0.0) - float(hang.get("timeout_s") or 0.0)) * 1000
        out.append(("caught", f"{late_ms:.1f} ms after the {float(hang.get('timeout_s') or 0.0):.1f} s timeout "
                              "expired"))
    reporter = hang.get("reported_by")
    if isinstance(reporter, Mapping):
        out.append(("reported by", f"rank {reporter.get('rank')}'s monitor, whose rank waited for it: "
                                   f"{printable(reporter.get('message', ''))}"))
    dump = hang.get("stack_dump") if hang.get("stack_dump_captured") else None
    where = evidence.where(str(dump)) if dump else None
    if where is not None:
        out.append(("waiting at" if victim else "where", printable(where)))
    if hang.get("verdict"):
        out.append(("verdict", printable(hang["verdict"])))
        out.append(("diagnosis", printable(hang.get("diagnosis"))))
    if dump:
        out.append(("waiting dump" if victim else "stack dump", printable(dump)))
    out.append(("error file", printable(hang.get("error_file"))))
    if restart is not None and restart.get("total") is not None:
        out.append(("restart", f"all ranks running again {_secs(restart['total'])} after detection "
                               f"({phases_text(restart, PROCESS_PHASES)})"))
    return out


def _failure_rows(restart: Mapping[str, Any]) -> list[Row]:
    """A failure's rows: its root (crash.py), then the ranks that failed because of it; a row of
    an older summary, without the verdict's fields, says its message."""
    if not restart.get("how"):
        out: list[Row] = [("failed", f"{printable(restart.get('message') or restart.get('cause'))} in attempt "
                                     f"{restart.get('attempt')}; the worker group restarted")]
    elif restart.get("root_host"):
        out = [("failed", f"{printable(restart['how'])} in attempt {restart.get('attempt')}, the root of the failure; "
                          "the worker group here restarted with it")]
    elif restart.get("root_seen", True):
        out = [("failed", f"{printable(restart['how'])} in attempt {restart.get('attempt')}, the root of the failure; "
                          "the worker group restarted")]
    else:
        out = [("failed", f"in attempt {restart.get('attempt')}, {UNSEEN} (every rank that failed here lost a "
                          "peer); the worker group restarted"),
               ("lost a peer", printable(restart["how"]))]
    if restart.get("error_file"):
        out.append(("error file", printable(restart["error_file"])))
    if restart.get("others_how"):
        out.append(("then", printable(restart["others_how"])))
    if restart.get("victims_how"):
        out.append(("because of it", printable(restart["victims_how"])))
    if restart.get("total") is not None:
        out.append(("restart", f"all ranks running again {_secs(restart['total'])} after it was seen "
                               f"({phases_text(restart, PROCESS_PHASES)})"))
    return out


def _inprocess_rows(row: Mapping[str, Any], evidence: Evidence) -> list[Row]:
    out: list[Row] = [("fault", f"rank {row.get('rank')} (pid {row.get('pid')}) in attempt {row.get('attempt')}: "
                                f"{printable(row.get('message', ''))}")]
    report = row.get("report")
    dump = evidence.report_dump(str(report)) if report else None
    where = evidence.where(dump) if dump else None
    if where is not None:
        out.append(("where", printable(where)))
    phases = row.get("phases") or {}
    restart = f"in-process restart {row.get('iteration')} (same processes)"
    if phases.get("total") is not None:
        restart += (f", all ranks back in their step loop {_secs(phases['total'])} after the fault "
                    f"({phases_text(phases)})")
    out.append(("restart", restart))
    if report:
        out.append(("hang report", printable(report)))
    reporter = row.get("reported_by")
    if isinstance(reporter, Mapping):  # a waiting rank's monitor fired first: its evidence is the incident's
        out.append(("reported by", f"rank {reporter.get('rank')}'s monitor, whose rank waited for it: "
                                   f"{printable(str(reporter.get('message') or ''))}"))
        if reporter.get("report"):
            out.append(("its report", printable(str(reporter["report"]))))
    return out


def _dump_rows(row: Mapping[str, Any]) -> list[Row]:
    return [("diagnosed", f"rank {row.get('rank')} in attempt {row.get('attempt')}, left running (on_hang: dump)"),
            ("verdict", printable(row.get("verdict", ""))),
            ("diagnosis", printable(row.get("diagnosis")))]


def _warm(warm: Mapping[str, Any]) -> str:
    """What --ft-warm-restart did: which attempts were forked, and why others were not."""
    forked = warm.get("forked") or {}
    text = ", ".join(f"attempt {a} ({len(p)} forked)" for a, p in sorted(forked.items(), key=lambda kv: int(kv[0])))
    parts = [text or "no attempt forked"]
    fallbacks = warm.get("fallbacks") or []
    if fallbacks:
        parts.append(f"started as usual: {printable(str(fallbacks[-1]).split('warm restart: ', 1)[-1])}")
    return "; ".join(parts)


def rows(summary: Mapping[str, Any], evidence: Evidence = NO_EVIDENCE) -> list[Row]:
    """The summary's lines, from its JSON form: each incident (hang, failure, in-process
    restart, dump-only diagnosis) a group, then the run's."""
    groups: list[list[Row]] = []
    hang_restarts = iter([r for r in summary.get("restarts", []) if r.get("cause", "hang") == "hang"])
    for hang in summary.get("hangs", []):
        groups.append(_hang_rows(hang, next(hang_restarts, None), evidence))
    groups.extend(_failure_rows(r) for r in summary.get("restarts", []) if r.get("cause") == "failure")
    groups.extend(_inprocess_rows(r, evidence) for r in summary.get("inprocess_restarts", []))
    groups.extend(_dump_rows(r) for r in summary.get("diagnoses", []) if r.get("action") == "dump")
    run: list[Row] = []
    if summary.get("attempts"):
        run.append(("worker pids", _pids(summary["attempts"])))
    if summary.get("warm_restarts") is not None:
        run.append(("warm restarts", _warm(summary["warm_restarts"])))
    if summary.get("monitor_restarts"):
        run.append(("monitors restarted", str(summary["monitor_restarts"])))
    obs = summary.get("observability") or {}
    if obs.get("goodput") is not None:
        run.append(("goodput", f"{obs['goodput']:.3f} ({obs['productive_s']:.1f} s productive step time of "
                               f"{obs['wall_s']:.1f} s wall time; {obs['lost_s']:.1f} s lost to hangs and crashes)"))
    if obs.get("slow_ranks"):
        run.append(("slow ranks", ", ".join(str(r) for r in obs["slow_ranks"])))
    if obs.get("metrics_url"):
        run.append(("metrics", f"{printable(obs['metrics_url'])} (served while the launcher ran)"))
    if obs.get("metrics_textfile"):
        run.append(("textfile", f"{printable(obs['metrics_textfile'])} (Prometheus text format, as node-exporter "
                                "reads it)"))
    if obs.get("events"):
        run.append(("events", printable(obs["events"])))
        run.append(("report", f"ft-monitor report {printable(Path(str(obs['events'])).parent)}"))
    if summary.get("outcome"):
        run.append(("stopped", printable(summary["outcome"])))
    run.append(("exit code", str(summary.get("exit_code"))))
    out: list[Row] = []
    for group in [*groups, run]:
        if out:
            out.append(None)
        out.extend(group)
    return out


def format_rows(lines: Sequence[Row], heading: str = HEADING) -> str:
    """The heading, then every ``key : value`` line with the colons in one column."""
    width = max((len(r[0]) for r in lines if r is not None), default=0)
    body = ["" if r is None else f"{r[0].ljust(width)} : {r[1]}" for r in lines]
    return "\n".join([heading, *body])
