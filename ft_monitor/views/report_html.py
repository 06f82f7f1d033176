"""`ft-monitor report RUN_DIR [RUN_DIR ...]`: a run as one self-contained HTML page.

Reads the run folders (report_input.py: one per node, or the --log-dir their launchers
shared; their events merged), builds the page's content (report_model.py) and renders
it (`render`, pure) top down, as an operator asks:

1. what happened, in one sentence: the culprit, where, what it cost, how the job
   recovered, how it ended; then the verdict line of the roll call;
2. where the culprit and the ranks that waited for it were (their stacks' innermost
   frames), with links to every evidence file beside the page (diagnosis.json, stack
   dumps, hang reports, Flight Recorder traces, error.json, the monitors' logs, events);
3. the timeline (report_timeline.py): attempts, a lane per rank, the restarts' phases
   of each kind with its own legend;
4. the incidents of every attempt, each restart's phases at their own scale;
5. goodput per launcher and what it counts; step time per rank.

The culprit, the verdict and the counts are the launcher's records (its events and
diagnosis.json), never judged again here. All text is escaped; styles and pictures are
inline; nothing is fetched, and there is no script. Links are relative to the page, so
the folder can be copied or served as it is.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ft_client.safefiles import write_bytes_atomic
from ft_monitor.views import human
from ft_monitor.views.report_input import EvidenceFile, ReportError, ReportInput, StackTop, load
from ft_monitor.views.report_model import Incident, LauncherView, Model, build
from ft_monitor.views.report_timeline import KIND_TITLE, legend, marks_legend, phase_bar, timeline

__all__ = ["REPORT_FILE", "ReportError", "render", "write_report"]

REPORT_FILE = "report.html"
MAX_STACK_GROUPS = 6
"""Waiting ranks shown with their stack: grouped by where they wait, this many groups."""
MAX_FEATURED = 3
"""Incidents shown with their stacks and evidence at the top (all of them are in the table)."""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:1.5em auto;max-width:1040px;
 color:#222;padding:0 1em}
h1{font-size:20px;margin:.2em 0} h2{font-size:16px;margin:1.6em 0 .4em;border-bottom:1px solid #ddd}
h3{font-size:13px;margin:.6em 0 .2em}
.headline{font-size:16px;margin:.4em 0} .verdict{background:#fff5eb;border-left:4px solid #e6550d;
 padding:.4em .7em;margin:.5em 0;font-family:ui-monospace,monospace;font-size:13px;overflow-wrap:anywhere}
.meta{color:#555;font-size:13px} .meta code{font-size:12px}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
 font-size:13px;vertical-align:top} th{background:#f5f5f5} td.num{text-align:right;font-variant-numeric:tabular-nums}
pre.stack{background:#f7f7f7;border:1px solid #e5e5e5;padding:.4em .6em;margin:.2em 0 .8em;font-size:12px;
 white-space:pre-wrap;overflow-wrap:anywhere}
.stack-head{margin:.6em 0 0} .evidence a{font-family:ui-monospace,monospace;font-size:12px}
.evidence td{font-size:12px} .missing{color:#a50f15}
svg.timeline{width:100%;height:auto;font:11px system-ui,sans-serif} svg .lane-label{font-size:11px;fill:#333}
svg .on-bar{font-size:10px;fill:#fff} svg .axis{font-size:10px;fill:#555}
.legend ul{list-style:none;padding:0;margin:.2em 0;display:flex;flex-wrap:wrap;gap:.2em 1.2em;font-size:12px}
.legend h3{margin-top:.8em} .swatch{display:inline-block;width:12px;height:12px;margin-right:4px;
 vertical-align:-1px;border-radius:2px}
.legends{display:grid;grid-template-columns:1fr;gap:0 2em}
.goodput-bar{display:block;margin:.3em 0} svg.phase-bar{width:100%;height:auto;max-width:640px;display:block}
.restart p{margin:.5em 0 .1em} dl.counts{display:grid;grid-template-columns:max-content auto;
 gap:.1em 1em;margin:.3em 0} dl.counts dt{color:#555} dl.counts dd{margin:0}
footer{margin-top:2em;color:#777;font-size:12px}
@media print{body{margin:0;max-width:none;font-size:11px} a{color:inherit;text-decoration:none}
 h2{break-after:avoid} table,svg,pre,.legend,.verdict{break-inside:avoid}
 *{-webkit-print-color-adjust:exact;print-color-adjust:exact}}
"""


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


class _Links:
    """Paths as the page shows and links them: relative to the page's folder."""

    def __init__(self, page_dir: Path | None, data: ReportInput | None) -> None:
        self.page_dir = page_dir
        self.located: Mapping[str, Path] = data.located if data is not None else {}

    def rel(self, path: Path) -> str:
        if self.page_dir is None:
            return str(path)
        try:
            return os.path.relpath(os.path.abspath(path), os.path.abspath(self.page_dir))
        except ValueError:
            return str(path)

    def short(self, path: Path | str) -> str:
        """How a path is shown: relative to the page when below it, else as it is."""
        rel = self.rel(Path(path))
        return rel if not rel.startswith(os.pardir + os.sep) or self.page_dir is None else str(path)

    def folder(self, path: Path) -> str:
        """A run folder as the page names it: relative to the page, its own name when the page is in it."""
        rel = self.short(path)
        return Path(path).resolve().name if rel == os.curdir else rel

    def file(self, path: Path, label: str | None = None) -> str:
        href = quote(self.rel(path).replace(os.sep, "/"))
        return f'<a class="evidence-link" href="{_e(href)}">{_e(label or self.short(path))}</a>'

    def named(self, path: str, label: str | None = None) -> str:
        """A path an event names: linked where the file is, else said to be missing."""
        where = self.located.get(path)
        if where is None:
            return f'<span class="missing">{_e(label or path)} (not found)</span>'
        return self.file(where, label)


# -- the sentence ----------------------------------------------------------------------------------
def _recovery(i: Incident) -> str:
    r = i.restart
    if i.action == "dump":
        return "the job kept running (on_hang: dump)"
    if r is None and i.restarted_into is not None:
        return (f"the job restarted its processes into attempt {i.restarted_into}, but that restart was not "
                "measured: not every rank was stepping again before it ended")
    if r is None:
        return "the job was not restarted"
    took = f"{human.seconds(r.total)} from detection to every rank stepping again" if r.total is not None else \
        "the ranks' return was not measured"
    if r.mode == "inprocess":
        return f"the ranks restarted the training function in their own processes ({took})"
    redone = f", {human.plural(r.redone, 'iteration')} done again" if r.redone else ""
    kind = "fallback " if i.action == "inprocess" else ""
    return f"the job restarted its processes ({kind}process restart: {took}{redone})"


def _end(m: Model) -> str:
    if not m.ended:
        return "The run had not ended when these events were read."
    codes = sorted({int(la.end["exit_code"]) for la in m.launchers if la.end is not None})
    outcomes = sorted({str(la.end["outcome"]) for la in m.launchers if la.end is not None and la.end["outcome"]})
    why = f" ({'; '.join(outcomes)})" if outcomes else ""
    if codes == [0]:
        return "The job finished (exit code 0)."
    return f"The job ended with exit code {', '.join(map(str, codes))}{why}."


def headline(m: Model) -> str:
    """What happened, in a sentence or two (plain text)."""
    attempts = len(m.attempts)
    if not m.incidents:
        return (f"No hang and no failure in {human.plural(attempts, 'attempt')}. " + _end(m)).strip()
    i = m.incidents[0]
    more = ""
    if len(m.incidents) > 1:
        kinds = {k: sum(1 for x in m.incidents if x.kind == k) for k in ("hang", "failure")}
        parts = [human.plural(n, k) for k, n in kinds.items() if n]
        more = f"{human.plural(len(m.incidents), 'incident')} ({', '.join(parts)}); the first: "
    who = f"rank {i.rank}" if i.rank is not None else "a rank"
    if len(m.launchers) > 1 and i.node is not None:
        who += f" (node {i.node})"
    if i.kind == "hang":
        at = f" at iteration {human.count(i.iteration)}" if i.iteration is not None else ""
        where = i.culprit_stack.where if i.culprit_stack is not None and i.culprit_stack.where else None
        text = f"{who} hung{at} in attempt {i.attempt}" + (f", in {where}" if where else "") + f" ({i.what})"
        cost = f"; it cost {human.seconds(i.lost_s)}" if i.lost_s is not None else ""
        text += f"{cost}, and {_recovery(i)}."
    else:
        text = f"{who} {i.what} in attempt {i.attempt}; {_recovery(i)}."
    sentence = more + text
    return sentence[0].upper() + sentence[1:] + " " + _end(m)


# -- sections --------------------------------------------------------------------------------------
def _stack_block(top: StackTop, role: str, ranks: Sequence[int] | None = None) -> str:
    who = human.ranks(list(ranks)) if ranks else f"rank {top.rank}"
    where = f" at <code>{_e(top.where)}</code>" if top.where else ""
    state = "" if top.in_collective is None else (" (in a collective)" if top.in_collective
                                                  else " (not in a collective)")
    frames = "\n".join(top.frames) or "(no frames)"
    return (f'<p class="stack-head {role}"><b>{_e(who)}</b> — {_e(role)}{where}{_e(state)}</p>'
            f'<pre class="stack {role}" data-ranks="{",".join(map(str, ranks or [top.rank]))}">{_e(frames)}</pre>')


def _stacks(i: Incident) -> str:
    parts = []
    if i.culprit_stack is not None:
        parts.append(_stack_block(i.culprit_stack, "culprit"))
    groups: dict[tuple[str, ...], list[StackTop]] = {}
    for top in i.waiting_stacks:
        groups.setdefault(top.frames, []).append(top)
    for n, (_, tops) in enumerate(groups.items()):
        if n == MAX_STACK_GROUPS:
            rest = [t.rank for g in list(groups.values())[n:] for t in g]
            parts.append(f"<p>{_e(human.ranks(rest))} wait elsewhere: see diagnosis.json.</p>")
            break
        parts.append(_stack_block(tops[0], "waiting", [t.rank for t in tops]))
    waiting_without = [r for r in i.waiting if r not in {t.rank for t in i.waiting_stacks}]
    if waiting_without:
        parts.append(f"<p>{_e(human.ranks(waiting_without))} waiting, without a stack in the diagnosis.</p>")
    if not parts:
        return "<p>No stack was taken of this incident's ranks.</p>"
    if i.diagnosis is None and i.culprit_stack is not None:
        parts.append("<p class=\"note\">No roll call for this incident (the in-process restart takes none): only "
                     "the hung rank's stack was dumped.</p>")
    return "".join(parts)


def _incident_files(i: Incident, links: _Links) -> str:
    items = "".join(f"<li>{_e(label)}: {links.named(path)}</li>" for label, path in i.files
                    # an in-process restart fails no process: torch writes no error.json
                    if not (label == "error file" and i.action == "inprocess" and path not in links.located))
    return f'<ul class="incident-files">{items}</ul>' if items else ""


def _featured(m: Model, links: _Links) -> str:
    out = []
    top = next((x.verdict for x in m.incidents if x.verdict), None)
    for n, i in enumerate([x for x in m.incidents if x.kind == "hang"][:MAX_FEATURED]):
        who = f"rank {i.rank}" if i.rank is not None else "a rank"
        out.append(f'<section class="incident-detail" data-attempt="{i.attempt}" data-rank="{i.rank}">'
                   f"<h3>Attempt {i.attempt}: {_e(who)} hung</h3>"
                   + (f'<p class="verdict">verdict: {_e(i.verdict)}</p>' if i.verdict and (n or i.verdict != top)
                      else "")
                   + _stacks(i) + _incident_files(i, links) + "</section>")
    if not out:
        return ""
    return "<h2>Where the ranks were</h2>" + "".join(out)


def _evidence(files: Sequence[EvidenceFile], links: _Links) -> str:
    if not files:
        return ""
    run_level = [f for f in files if f.attempt is None]
    by_attempt: dict[int, list[EvidenceFile]] = {}
    for f in files:
        if f.attempt is not None:
            by_attempt.setdefault(f.attempt, []).append(f)
    kinds = ("diagnosis", "stack dump", "hang report", "Flight Recorder trace", "native stack", "error file",
             "monitor log", "other")
    parts = ['<h2>Evidence</h2><div class="evidence"><p>'
             + ", ".join(links.file(f.path, f"{links.short(f.path)}") for f in run_level) + "</p>"]
    for attempt, fs in sorted(by_attempt.items()):
        rows: dict[int | None, dict[str, list[EvidenceFile]]] = {}
        for f in fs:
            rows.setdefault(f.rank, {}).setdefault(f.kind, []).append(f)
        present = [k for k in kinds if any(k in r for r in rows.values())]
        head = "".join(f"<th>{_e(k)}</th>" for k in present)
        body = []
        for rank, cells in sorted(rows.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)):
            tds = "".join("<td>" + "<br>".join(links.file(f.path, f.path.name) for f in cells.get(k, [])) + "</td>"
                          for k in present)
            body.append(f"<tr><td>{'attempt' if rank is None else f'rank {rank}'}</td>{tds}</tr>")
        summary = f"Attempt {attempt}: {human.plural(len(fs), 'file')}"
        parts.append(f"<h3>{_e(summary)}</h3><table><tr><th></th>{head}</tr>{''.join(body)}</table>")
    return "".join(parts) + "</div>"


def _incident_table(m: Model) -> str:
    if not m.incidents:
        return "<h2>Incidents</h2><p>None: no hang was detected and no worker failed.</p>"
    rows = []
    for i in m.incidents:
        r = i.restart
        recovery = "–"
        if i.action == "dump":
            recovery = "none (on_hang: dump): the job kept running"
        elif r is not None:
            recovery = (f"{_e(KIND_TITLE.get(r.mode, r.mode))} in {_e(human.seconds(r.total))}: "
                        + _e(", ".join(f"{n} {human.seconds(d)}" for n, d in r.phases)))
        what = _e(i.what) + (f'<div class="verdict">verdict: {_e(i.verdict)}</div>' if i.verdict else "")
        if i.waited_on_other_nodes:
            what += f"<div>{_e(human.ranks(list(i.waited_on_other_nodes)))} on other nodes waited for it</div>"
        redone = r.redone if r is not None else None
        rows.append(f'<tr class="incident"><td class="num">{i.attempt}</td><td>{_e(i.kind)}</td>'
                    f"<td>{'–' if i.rank is None else _e(i.rank)}{'' if not i.host else ' (' + _e(i.host) + ')'}</td>"
                    f"<td>{what}</td><td>{recovery}</td><td class=\"num\">{_e(human.seconds(i.lost_s))}</td>"
                    f"<td class=\"num\">{_e(human.count(redone))}</td></tr>")
    return ("<h2>Incidents</h2><table class=\"incidents\"><tr><th>attempt</th><th>kind</th><th>rank</th>"
            "<th>what</th><th>recovery</th><th>time lost</th><th>iterations redone</th></tr>"
            + "".join(rows) + "</table>")


def _restart_bars(m: Model) -> str:
    if not m.restarts:
        return ""
    rows = []
    for r in m.restarts:
        cause = {"hang": "after a hang", "failure": "after a failure"}.get(r.cause, f"({r.cause})")
        into = f"attempt {r.attempt - 1} → {r.attempt}" if r.mode == "process" else f"within attempt {r.attempt}"
        who = f", rank {r.rank}" if r.rank is not None else ""
        rows.append(f'<div class="restart" data-mode="{r.mode}"><p>{_e(KIND_TITLE.get(r.mode, r.mode))} {_e(cause)}'
                    f"{_e(who)} ({_e(into)}): {_e(human.seconds(r.total))}</p>{phase_bar(r)}</div>")
    return "<h3>Each restart, phase by phase</h3>" + "".join(rows)


def _goodput_one(la: LauncherView) -> str:
    g = la.goodput
    if g is None:
        return "<p>No goodput recorded yet (no <code>stats</code> event).</p>"
    wall, prod, lost = float(g["wall_s"]), g.get("productive_s"), float(g["lost_s"])
    ratio = g.get("goodput")
    counts = [("goodput", f'<b class="goodput" data-ratio="{ratio if ratio is not None else ""}">'
                          f"{_e(human.percent(ratio))}</b>"),
              ("productive", f"{_e(human.seconds(prod))} of step time (the mean over the node's ranks of their "
                             "<code>step</code> sections, less the work done again after restarts)"),
              ("lost to hangs and crashes", f"{_e(human.seconds(lost))} (each incident's onset to every rank "
                                            "stepping again, plus the work done again)"),
              ("wall time", f"{_e(human.seconds(wall))} since the launcher started")]
    bar = ""
    if wall > 0 and prod is not None:
        p = min(1.0, max(0.0, float(prod) / wall))
        lo = min(1.0 - p, max(0.0, lost / wall))
        rest = max(0.0, 1 - p - lo)
        bar = (f'<svg class="goodput-bar" width="480" height="14" viewBox="0 0 480 14" role="img" '
               f'aria-label="goodput"><rect width="{480 * p:.1f}" height="14" fill="#31a354"><title>productive '
               f'{_e(human.seconds(prod))}</title></rect><rect x="{480 * p:.1f}" width="{480 * lo:.1f}" height="14" '
               f'fill="#de2d26"><title>lost to hangs and crashes {_e(human.seconds(lost))}</title></rect>'
               f'<rect x="{480 * (p + lo):.1f}" width="{480 * rest:.1f}" height="14" fill="#d9d9d9"><title>the rest: '
               f'start-up, data loading, checkpoints, time outside the step</title></rect></svg>'
               '<div class="legend"><ul><li><span class="swatch" style="background:#31a354"></span>productive</li>'
               '<li><span class="swatch" style="background:#de2d26"></span>lost to hangs and crashes</li>'
               '<li><span class="swatch" style="background:#d9d9d9"></span>the rest: start-up, data loading, '
               "checkpoints, outside the step</li></ul></div>")
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in counts)
    return f'<dl class="counts">{dl}</dl>{bar}'


def _launchers(m: Model) -> str:
    many = len(m.launchers) > 1
    parts = ["<h2>Outcome and goodput</h2>"]
    for la in m.launchers:
        end = la.end
        if many:
            node = f"node {la.node_rank}" if la.node_rank is not None else "node"
            parts.append(f"<h3>{_e(node)}: {_e(la.host)}, launcher pid {la.pid}, "
                         f"{_e(human.ranks(list(la.ranks)))}</h3>")
        if end is not None:
            restarts = end["restarts"]
            order = ["process", "inprocess", *sorted(k for k in restarts if k not in KIND_TITLE)]
            counted = ", ".join(f"{human.count(n)} {KIND_TITLE.get(k, k)}{'' if n == 1 else 's'}"
                                for k in order for n in [restarts.get(k)] if isinstance(n, int)) or "none"
            parts.append(f'<dl class="counts"><dt>exit code</dt><dd class="exit-code">{_e(end["exit_code"])}'
                         f'{" (" + _e(end["outcome"]) + ")" if end["outcome"] else ""}</dd>'
                         f"<dt>hangs handled</dt><dd>{_e(human.count(end['hangs']))}</dd>"
                         f"<dt>restarts</dt><dd>{_e(counted)}</dd></dl>")
        else:
            parts.append("<p>This launcher had not ended when its events were read.</p>")
        parts.append(_goodput_one(la))
    return "".join(parts)


def _step_table(stats: Mapping[str, Any]) -> str:
    if not stats:
        return "<p>No step times were recorded (no <code>stats</code> event).</p>"
    sections = sorted({name for r in stats.values() for name in (r.get("sections") or {})})
    if not sections:
        return "<p>No timed sections: only sections listed in rank_section_timeouts reach the monitors.</p>"
    medians = [v for r in stats.values() for s in (r.get("sections") or {}).values()
               for v in [s.get("median_s")] if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    top = max(medians) if medians else 1.0
    head = "".join(f"<th>{_e(s)} median</th><th>{_e(s)} count</th>" for s in sections)
    body = []
    for rank, r in sorted(stats.items(), key=lambda kv: int(kv[0])):
        cells = []
        for s in sections:
            v = (r.get("sections") or {}).get(s) or {}
            raw = v.get("median_s")
            med = float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
            bar = (f'<svg width="100" height="10"><rect width="{100 * min(1.0, max(0.0, med / top)):.1f}" '
                   f'height="10" fill="#3182bd"/></svg> ') if med is not None else ""
            cells.append(f'<td class="median num">{bar}{_e(human.seconds(med))}</td>'
                         f'<td class="num">{_e(human.count(v.get("count")))}</td>')
        body.append(f'<tr class="rank"><td>{_e(rank)}</td><td class="num">{_e(human.count(r.get("iteration")))}</td>'
                    + "".join(cells) + "</tr>")
    return f'<table class="steps"><tr><th>rank</th><th>iteration</th>{head}</tr>' + "".join(body) + "</table>"


def render(events: Sequence[Mapping[str, Any]], title: str = "", *, data: ReportInput | None = None,
           page_dir: Path | None = None) -> str:
    """The page (pure): ``events`` (validated, in time order), what else was read beside them
    (``data``), and the folder the page will be in (links are relative to it)."""
    m = build(events, data.diagnoses if data is not None else None, data.stacks if data is not None else None)
    links = _Links(page_dir, data)
    runs = ([links.folder(r.path) for r in data.runs] if data is not None else []) or ([title] if title else [])
    hosts = sorted({str(e["host"]) for e in events})
    first = next((i for i in m.incidents if i.verdict), None)
    verdict = f'<p class="verdict top">verdict: {_e(first.verdict)}</p>' if first is not None else ""
    meta = [f"run {'folders' if len(runs) > 1 else 'folder'} " + ", ".join(f"<code>{_e(r)}</code>" for r in runs)
            if runs else "",
            f"run id <code>{_e(', '.join(m.run_ids))}</code>" if m.run_ids else "",
            f"{'hosts' if len(hosts) > 1 else 'host'} {_e(', '.join(hosts))}",
            f"from {_e(human.clock(m.t0))}, {_e(human.seconds(m.t1 - m.t0))} of events"]
    kinds_drawn = [k for k in ("process", "inprocess") if any(r.mode == k for r in m.restarts)]
    legends = marks_legend(m) + "".join(legend(k, [r for r in m.restarts if r.mode == k]) for k in kinds_drawn)
    left_out = (f"<p>{human.plural(m.lanes_left_out, 'other rank')} not drawn (the lanes show the incidents' ranks "
                "and the first others).</p>") if m.lanes_left_out else ""
    slow = (f"<p>Slow ranks flagged: {_e(human.ranks(m.slow_ranks))}.</p>") if m.slow_ranks else ""
    problems = "".join(f"<li>{_e(p)}</li>" for p in (data.problems if data is not None else []))
    page_title = f"ft-monitor report: {', '.join(m.run_ids) or title or 'run'}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(page_title)}</title><style>{CSS}</style></head><body>
<header><h1>What happened</h1>
<p class="headline">{_e(headline(m))}</p>
{verdict}
<p class="meta">{" · ".join(x for x in meta if x)}</p></header>
{_featured(m, links)}
{_evidence(data.files, links) if data is not None else ""}
<h2>Timeline</h2>
{timeline(m)}
{left_out}
<div class="legends">{legends}</div>
{_restart_bars(m)}
<p class="meta">0 s is {_e(human.clock(m.t0))}, the first event. Hover a shape for its times.</p>
{_incident_table(m)}
{_launchers(m)}
{slow}
<h2>Step time per rank</h2>
{_step_table(m.step_stats)}
{f'<h2>Not read</h2><ul class="problems">{problems}</ul>' if problems else ""}
<footer>Written by <code>ft-monitor report</code> from {human.plural(len(events), 'event')}
{"of " + human.plural(len(data.runs), "run folder") if data is not None else ""}.</footer>
</body></html>
"""


def default_output(data: ReportInput) -> Path:
    """One run folder: ``report.html`` in it; several: in the folder that holds them all."""
    folders = [r.path.resolve() for r in data.runs]
    if len(folders) == 1:
        return folders[0] / REPORT_FILE
    return Path(os.path.commonpath([str(f) for f in folders])) / REPORT_FILE


def write_report(run_dirs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 output: str | os.PathLike[str] | None = None) -> Path:
    """Render the run folders' page to ``output`` (default: `default_output`); returns its path."""
    paths = [run_dirs] if isinstance(run_dirs, (str, os.PathLike)) else list(run_dirs)
    data = load(paths)
    out = Path(output) if output else default_output(data)
    page = render(data.events, title=str(out.parent), data=data, page_dir=out.parent.resolve())
    write_bytes_atomic(out, page.encode("utf-8"), mode=0o666)  # as a plain write's mode; a link there is replaced
    return out
