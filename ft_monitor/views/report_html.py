"""`ft-monitor report RUN_DIR`: a run's events as one self-contained HTML page (no server, no script).

Reads ``RUN_DIR/events.jsonl`` (ft-launcher's event stream, launcher/events.py,
each line checked against the schema) and renders (`render`, pure) one page: the
run's outcome and goodput, a timeline (SVG) of the attempts, the hangs (from the
hung rank's last progress to detection), the stop and each restart phase, step time
per rank from the last ``stats`` event, and a table of the incidents. All text is
escaped; styles are inline; nothing is fetched from anywhere.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ft_client.errors import FtError
from ft_monitor.launcher.events import EVENTS_FILE, read_events

REPORT_FILE = "report.html"
PHASES = ("notify", "to_stop", "stop", "rendezvous", "worker_start", "first_step")
PHASE_COLORS = {"notify": "#e6550d", "to_stop": "#fd8d3c", "stop": "#fdae6b", "rendezvous": "#9e9ac8",
                "worker_start": "#756bb1", "first_step": "#bcbddc"}
WIDTH = 960
LEFT = 150


class ReportError(FtError, ValueError):
    """A run directory without events to render."""


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _fmt(v: float | None, unit: str = " s", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _events_path(run_dir: str | os.PathLike[str]) -> Path:
    """The events file: ``run_dir`` itself, ``run_dir/events.jsonl``, or, given the log
    directory (``--log-dir``) that holds one run folder, that folder's; several run
    folders there are listed in the refusal, for the caller to pick one."""
    p = Path(run_dir)
    if p.is_file():
        return p
    own = p / EVENTS_FILE
    if own.exists() or not p.is_dir():
        return own
    below = sorted(q for q in p.glob(f"*/{EVENTS_FILE}") if q.is_file())
    if len(below) == 1:
        return below[0]
    if below:
        folders = ", ".join(str(q.parent) for q in below)
        raise ReportError(f"{p} holds {len(below)} run folders with {EVENTS_FILE}: {folders}; "
                          "give one of them as RUN_DIR")
    return own


def write_report(run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Path:
    src = _events_path(run_dir)
    if not src.exists():
        raise ReportError(f"{src} does not exist: RUN_DIR is the run's log directory, where ft-launcher writes "
                          f"{EVENTS_FILE} (the summary line 'events: ...' names it)")
    events = read_events(src)
    if not events:
        raise ReportError(f"{src} holds no events")
    out = Path(output) if output else src.parent / REPORT_FILE
    out.write_text(render(events, title=str(src.parent)), encoding="utf-8")
    return out


def _svg_timeline(events: Sequence[Mapping[str, Any]]) -> str:
    t0 = min(e["time"] for e in events)
    t1 = max(e["time"] for e in events)
    span = max(t1 - t0, 1e-3)
    scale = (WIDTH - LEFT - 10) / span

    def x(t: float) -> float:
        return float(LEFT + (t - t0) * scale)

    rows: list[str] = []
    y = 10
    lanes: list[tuple[str, list[str]]] = []
    attempts: list[str] = []
    starts = {e["attempt"]: e["time"] for e in events if e["kind"] == "attempt_start"}
    ends = {e["attempt"]: e for e in events if e["kind"] == "attempt_end"}
    for a, start in sorted(starts.items()):
        end = ends.get(a)
        stop = end["time"] if end else t1
        state = end["state"] if end else "RUNNING"
        color = {"SUCCEEDED": "#31a354", "FAILED": "#de2d26"}.get(state, "#74a9cf")
        attempts.append(f'<rect class="attempt" x="{x(start):.1f}" width="{max(1.0, (stop - start) * scale):.1f}" '
                        f'height="14" fill="{color}"><title>attempt {a}: {_e(state)}</title></rect>'
                        f'<text x="{x(start) + 3:.1f}" y="11" font-size="10" fill="#fff">attempt {a}</text>')
    lanes.append(("attempts", attempts))
    incidents: list[str] = []
    for e in events:
        if e["kind"] == "hang":
            onset, det = e["onset_time"] or e["detected_time"], e["detected_time"] or e["time"]
            incidents.append(f'<rect class="hang" x="{x(onset):.1f}" width="{max(2.0, (det - onset) * scale):.1f}" '
                             f'height="14" fill="#de2d26"><title>rank {e["rank"]} hung: {_e(e["message"])}'
                             f'</title></rect>')
        elif e["kind"] == "kill":
            incidents.append(f'<rect class="kill" x="{x(e["began"]):.1f}" '
                             f'width="{max(2.0, e["duration_s"] * scale):.1f}" height="14" fill="#636363">'
                             f'<title>workers stopped ({_e(e["cause"])}) in {e["duration_s"]:.2f} s</title></rect>')
        elif e["kind"] in ("slow_rank", "slow_rank_cleared"):
            incidents.append(f'<circle class="slow" cx="{x(e["time"]):.1f}" cy="7" r="5" '
                             f'fill="{"#fdd0a2" if e["kind"] == "slow_rank_cleared" else "#e6550d"}"><title>'
                             f'{_e(e["kind"])}: rank {e["rank"]} {e["ratio"]:.2f}x</title></circle>')
    lanes.append(("hangs, stops", incidents))
    restarts: list[str] = []
    for e in events:
        if e["kind"] != "restart" or e["mode"] != "process":
            continue
        phases = e["phases"]
        total = phases.get("total")
        if total is None:
            continue
        t = e["time"] - total if e["time"] - total >= t0 else t0
        hang = next((h for h in events if h["kind"] == "hang" and h["rank"] == e["rank"] and h["time"] <= e["time"]),
                    None)
        if hang is not None and e["cause"] == "hang":
            t = hang["detected_time"]
        for name in PHASES:
            d = phases.get(name)
            if d is None:
                continue
            restarts.append(f'<rect class="phase" x="{x(t):.1f}" width="{max(1.0, d * scale):.1f}" height="14" '
                            f'fill="{PHASE_COLORS[name]}"><title>{_e(name)} {d:.3f} s</title></rect>')
            t += d
    lanes.append(("restart phases", restarts))
    for label, shapes in lanes:
        rows.append(f'<g transform="translate(0,{y})"><text x="0" y="11" font-size="12">{_e(label)}</text>'
                    + "".join(shapes) + "</g>")
        y += 24
    ticks = []
    step = _tick_step(span)
    k = 0.0
    while k <= span + 1e-9:
        ticks.append(f'<line x1="{x(t0 + k):.1f}" x2="{x(t0 + k):.1f}" y1="{y}" y2="{y + 4}" stroke="#999"/>'
                     f'<text x="{x(t0 + k):.1f}" y="{y + 16}" font-size="10" text-anchor="middle">{k:g} s</text>')
        k += step
    y += 22
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{WIDTH}" height="{y}" '
            f'role="img" aria-label="timeline">' + "".join(rows) + "".join(ticks) + "</svg>")


def _tick_step(span: float) -> float:
    for step in (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400):
        if span / step <= 12:
            return float(step)
    return span / 10


def _step_table(stats: Mapping[str, Any] | None) -> str:
    if stats is None:
        return "<p>No step times were recorded (no <code>stats</code> event).</p>"
    ranks = stats["ranks"]
    sections = sorted({name for r in ranks.values() for name in (r.get("sections") or {})})
    if not sections:
        return "<p>No timed sections: only sections listed in rank_section_timeouts reach the monitors.</p>"
    medians = [s.get("median_s") or 0.0 for r in ranks.values() for s in (r.get("sections") or {}).values()]
    top = max(medians) if medians and max(medians) > 0 else 1.0
    head = "".join(f"<th>{_e(s)} median</th><th>{_e(s)} count</th>" for s in sections)
    body = []
    for rank, r in sorted(ranks.items(), key=lambda kv: int(kv[0])):
        cells = []
        for s in sections:
            v = (r.get("sections") or {}).get(s) or {}
            m = v.get("median_s")
            bar = "" if m is None else (f'<svg width="120" height="10"><rect width="{120 * m / top:.1f}" height="10" '
                                        f'fill="#3182bd"/></svg> ')
            cells.append(f"<td class=\"median\">{bar}{_fmt(m, ' s', 4)}</td><td>{_e(v.get('count', '-'))}</td>")
        body.append(f"<tr class=\"rank\"><td>{_e(rank)}</td><td>{_e(r.get('iteration', '-'))}</td>"
                    + "".join(cells) + "</tr>")
    return (f'<table class="steps"><tr><th>rank</th><th>iteration</th>{head}</tr>' + "".join(body) + "</table>")


def _incident_rows(events: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    restarts = [e for e in events if e["kind"] == "restart"]
    diagnoses = [e for e in events if e["kind"] == "diagnosis"]
    for h in (e for e in events if e["kind"] == "hang"):
        r = next((x for x in restarts if x["rank"] == h["rank"] and x["time"] >= h["time"]), None)
        phases = "-" if r is None else ", ".join(f"{k} {v:.3f} s" for k, v in r["phases"].items()
                                                 if v is not None and k != "total")
        d = next((x for x in diagnoses if x["attempt"] == h["attempt"] and x["rank"] == h["rank"]), None)
        what = _e(h["message"]) + ("" if d is None else f'<div class="verdict">verdict: {_e(d["verdict"])}</div>')
        rows.append(f"<tr class=\"incident\"><td>{h['attempt']}</td><td>{h['rank']}</td><td>{what}</td>"
                    f"<td>{_e(h['action'])}</td><td>{_fmt(None if r is None else r['phases'].get('total'))}</td>"
                    f"<td>{_e(phases)}</td><td>{_fmt(None if r is None else r['lost_s'])}</td></tr>")
    if not rows:
        return "<p>No hangs.</p>"
    return ("<table class=\"incidents\"><tr><th>attempt</th><th>rank</th><th>what</th><th>action</th>"
            "<th>restart</th><th>phases</th><th>time lost</th></tr>" + "".join(rows) + "</table>")


def render(events: Sequence[Mapping[str, Any]], title: str = "") -> str:
    """The page (pure)."""
    end = next((e for e in reversed(events) if e["kind"] == "job_end"), None)
    stats = next((e for e in reversed(events) if e["kind"] == "stats"), None)
    gp_src: Mapping[str, Any] | None = end or stats
    goodput = None if gp_src is None else gp_src.get("goodput")
    summary = [f"<li>host <b>{_e(events[0]['host'])}</b>, {len(events)} events</li>"]
    if end is not None:
        summary.append(f"<li>exit code <b>{end['exit_code']}</b>{' — ' + _e(end['outcome']) if end['outcome'] else ''}"
                       f"; {end['hangs']} hang(s); restarts {_e(end['restarts'])}</li>")
    else:
        summary.append("<li>the run had not ended when these events were read</li>")
    if gp_src is not None:
        wall, prod, lost = gp_src["wall_s"], gp_src.get("productive_s"), gp_src["lost_s"]
        summary.append(f"<li>goodput <b class=\"goodput\">{_fmt(goodput, '', 3)}</b>: {_fmt(prod)} productive step "
                       f"time of {_fmt(wall)} wall time; {_fmt(lost)} lost to hangs</li>")
        if wall > 0 and prod is not None:
            p, lo = min(1.0, prod / wall), min(1.0, lost / wall)
            summary.append(
                f'<li><svg class="goodput-bar" width="400" height="14"><rect width="{400 * p:.1f}" height="14" '
                f'fill="#31a354"><title>productive</title></rect><rect x="{400 * p:.1f}" width="{400 * lo:.1f}" '
                f'height="14" fill="#de2d26"><title>lost to hangs</title></rect><rect x="{400 * (p + lo):.1f}" '
                f'width="{max(0.0, 400 * (1 - p - lo)):.1f}" height="14" fill="#d9d9d9"><title>other (start-up, '
                f'data loading, checkpoints, outside the step)</title></rect></svg></li>')
    slow = sorted({e["rank"] for e in events if e["kind"] == "slow_rank"})
    if slow:
        summary.append(f"<li>slow rank(s) flagged: {_e(', '.join(map(str, slow)))}</li>")
    legend = " ".join(f'<span style="background:{c};padding:0 6px">{_e(n)}</span>' for n, c in PHASE_COLORS.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ft-monitor report: {_e(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}} table{{border-collapse:collapse;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}} h2{{font-size:16px;margin-top:1.5em}}
</style></head><body>
<h1>ft-monitor report</h1><p><code>{_e(title)}</code></p>
<ul class="summary">{"".join(summary)}</ul>
<h2>Timeline</h2>
{_svg_timeline(events)}
<p>Restart phases: {legend}. A hang bar runs from the hung rank's last progress to its detection.</p>
<h2>Incidents</h2>
{_incident_rows(events)}
<h2>Step time per rank</h2>
{_step_table(stats)}
</body></html>
"""
