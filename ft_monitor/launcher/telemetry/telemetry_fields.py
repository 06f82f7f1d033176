"""The fields of the telemetry's events and summary, made from what it was told (pure): a
``hang`` event's fields from a summary row (`hang_fields`), an in-process hang's notice once the
ranks name its culprit (`culprit_notice`), which timeouts changed (`timeouts_changed`), a
section's recent median and the summary's incident rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ft_monitor.core.section_stats import SectionHistogram, median
from ft_monitor.launcher.telemetry.goodput import Incident


def recent_median(h: SectionHistogram | None) -> float | None:
    return None if h is None else median(h.recent)


def hang_fields(s: Mapping[str, Any], action: str) -> dict[str, Any]:
    """A ``hang`` event's fields from a summary row. A row whose culprit is on another node
    names the culprit as ``rank`` (and ``victim_of``), as every output of the incident does;
    this node's rank that waited for it is ``waiting`` (its rank, local rank and pid), and the
    timer, report and dump are that waiting rank's."""
    waiting = s.get("waiting")
    if isinstance(waiting, Mapping):
        own = hang_fields({**s, **waiting, "waiting": None}, action)
        return {**own, "rank": int(s["rank"]), "local_rank": None, "pid": None,
                "waiting": {"rank": own["rank"], "local_rank": own["local_rank"], "pid": own["pid"]}}
    return {"attempt": int(s.get("attempt") or 0), "rank": int(s["rank"]), "local_rank": s.get("local_rank"),
            "pid": int(s.get("pid") or 0), "reason": str(s.get("reason") or "unknown"), "section": s.get("section"),
            "message": str(s.get("message") or ""), "elapsed_s": float(s.get("elapsed_s") or 0.0),
            "timeout_s": float(s.get("timeout_s") or 0.0), "onset_time": float(s.get("onset_time") or 0.0),
            "detected_time": float(s.get("detected_time") or 0.0), "iteration": s.get("iteration"),
            "action": action, "report": s.get("report"), "stack_dump": s.get("stack_dump"),
            "error_file": s.get("error_file"), "victim_of": s.get("victim_of")}


def culprit_notice(notice: Mapping[str, Any], row: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An in-process hang's notice as its ``hang`` event tells it, once the ranks are back and
    their ``row`` (`InprocessLedger`'s) names the culprit: the culprit's, where another rank was
    reported first (it waited for the culprit: the second value, ``reported_by``); else as it
    was, with None."""
    culprit = row.get("rank")
    if culprit is None or culprit == notice.get("rank"):
        return dict(notice), None
    reported_by = {"rank": notice.get("rank"), "pid": notice.get("pid"), "message": notice.get("message"),
                   "report": notice.get("report"), "stack_dump": notice.get("stack_dump")}
    return {**notice, "rank": culprit, "pid": row.get("pid") or 0, "message": row.get("message") or "",
            "local_rank": None, "report": None, "stack_dump": None, "error_file": None}, reported_by


def timeouts_changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The timeouts that differ between a monitor's two STATUS (``learned`` left out), each
    section's as ``section:NAME``."""
    changed = sorted(k for k in set(before) | set(now) if k != "learned" and before.get(k) != now.get(k))
    sections_before = before.get("rank_section_timeouts") or {}
    sections_now = now.get("rank_section_timeouts") or {}
    changed += sorted(f"section:{n}" for n in set(sections_before) | set(sections_now)
                      if sections_before.get(n) != sections_now.get(n))
    return [c for c in changed if c != "rank_section_timeouts"]


def incident_rows(incidents: Sequence[Incident]) -> list[dict[str, Any]]:
    """The summary JSON's ``incidents``."""
    return [{"rank": i.rank, "onset": i.onset, "running_again": i.running_again,
             "iteration_before": i.iteration_before, "resumed_from": i.resumed_from,
             "redone_iterations": i.redone_iterations, "step_median_s": i.step_median_s,
             "lost_s": i.lost_s} for i in incidents]
