"""The report's pictures as inline SVG (pure): the timeline and each restart's phases.

`timeline` draws one row for the attempts, one lane per rank (each progress sample as a
tick where the rank last made progress, its hang from that last progress to the
detection, its wait when the roll call found it waiting for the hung rank, the group
stop, its exit), then one lane per kind of restart that happened, with its phases in
the colours of its own legend (`legend`). `phase_bar` draws one restart's phases at a
scale of their own (a 0.4 s in-process restart is two pixels on a minute-long
timeline). Every text is escaped; every shape has a ``<title>`` (the browser's tooltip).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from ft_monitor.launcher.telemetry.events import RESTART_PHASES
from ft_monitor.views import human
from ft_monitor.views.report_model import Model, Restart

WIDTH = 1000
LEFT = 120
RIGHT = 12
LANE = 16
GAP = 6

PHASE_COLORS: dict[str, dict[str, str]] = {
    "process": {"notify": "#e6550d", "to_stop": "#fd8d3c", "stop": "#fdae6b", "rendezvous": "#9e9ac8",
                "worker_start": "#756bb1", "first_step": "#54278f"},
    "inprocess": {"notify": "#08519c", "abort": "#3182bd", "interrupt": "#6baed6", "finalize": "#31a354",
                  "barrier": "#74c476", "reinit": "#006d2c", "first_step": "#00441b"},
}
PHASE_HELP: dict[str, dict[str, str]] = {
    "process": {
        "notify": "the monitor's verdict reaches the launcher",
        "to_stop": "the launcher decides (roll call, error files) until it starts stopping the workers",
        "stop": "SIGTERM, the grace time, SIGKILL: the workers are gone",
        "rendezvous": "the next rendezvous round (every node)",
        "worker_start": "the new workers are started (or forked from the template)",
        "first_step": "until every rank has made progress again",
    },
    "inprocess": {
        "notify": "every rank learns of the fault",
        "abort": "its abort hook returned (collectives freed)",
        "interrupt": "its main thread left the training function",
        "finalize": "process groups released, finalize and health check done",
        "barrier": "every rank met at the restart barrier",
        "reinit": "re-entered, init_process_group returned",
        "first_step": "until every rank has made progress again",
    },
}
KIND_TITLE = {"process": "process restart", "inprocess": "in-process restart"}
ATTEMPT_COLORS = {"SUCCEEDED": "#31a354", "FAILED": "#de2d26", "UNHEALTHY": "#de2d26", "RUNNING": "#74a9cf"}
MARKS = {"run": "#d9d9d9", "tick": "#3182bd", "hang": "#de2d26", "wait": "#fdae6b", "stop": "#636363",
         "exit": "#000000"}
OTHER_PHASE = "#bdbdbd"
MAX_TITLED_TICKS = 60
"""A lane with more progress ticks draws them as one path with one tooltip (a page of 128
lanes of a day's samples would be megabytes of tooltips)."""


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def color(mode: str, phase: str) -> str:
    return PHASE_COLORS.get(mode, {}).get(phase, OTHER_PHASE)


def _tick_step(span: float) -> float:
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
                 86400):
        if span / step <= 10:
            return float(step)
    return float(math.ceil(span / 10 / 86400) * 86400)


def timeline(m: Model) -> str:
    span = max(m.t1 - m.t0, 1e-3)
    scale = (WIDTH - LEFT - RIGHT) / span

    def x(t: float) -> float:
        return LEFT + min(max(t - m.t0, 0.0), span) * scale

    def w(a: float, b: float, least: float = 1.0) -> float:
        return max(least, x(b) - x(a))

    rows: list[str] = []
    y = 4

    def row(label: str, shapes: list[str], cls: str, data: str = "") -> None:
        nonlocal y
        rows.append(f'<g class="lane {cls}"{data} transform="translate(0,{y})">'
                    f'<text class="lane-label" x="0" y="{LANE - 4}">{_e(label)}</text>'
                    f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{LANE / 2}" y2="{LANE / 2}" stroke="#eee"/>'
                    + "".join(shapes) + "</g>")
        y += LANE + GAP

    shapes = []
    for a in m.attempts:
        end = a.end if a.end is not None else m.t1
        fill = ATTEMPT_COLORS.get(a.state, "#74a9cf")
        shapes.append(f'<rect class="attempt" x="{x(a.start):.1f}" y="0" width="{w(a.start, end):.1f}" '
                      f'height="{LANE}" fill="{fill}"><title>attempt {a.attempt}: {_e(a.state.lower())}, '
                      f'{_e(human.seconds(end - a.start))}</title></rect>'
                      f'<text x="{x(a.start) + 3:.1f}" y="{LANE - 4}" class="on-bar">attempt {a.attempt}</text>')
    row("attempts", shapes, "attempts")
    many_nodes = len({(ln.node, ln.host) for ln in m.lanes}) > 1
    for ln in m.lanes:
        s = []
        for t_a, t_b, title in ln.runs:
            end = t_b if t_b is not None else m.t1
            s.append(f'<rect class="run" x="{x(t_a):.1f}" y="{LANE / 2 - 2}" width="{w(t_a, end):.1f}" height="4" '
                     f'fill="{MARKS["run"]}"><title>{_e(title)}</title></rect>')
        for t_a, t_b, title in ln.stops:
            s.append(f'<rect class="stop" x="{x(t_a):.1f}" y="2" width="{w(t_a, t_b, 2):.1f}" height="{LANE - 4}" '
                     f'fill="{MARKS["stop"]}"><title>{_e(title)}</title></rect>')
        for t_a, t_b, title in ln.waits:
            s.append(f'<rect class="wait" x="{x(t_a):.1f}" y="3" width="{w(t_a, t_b, 2):.1f}" height="{LANE - 6}" '
                     f'fill="{MARKS["wait"]}"><title>{_e(title)}: {_e(human.seconds(t_b - t_a))}</title></rect>')
        for t_a, t_b, title in ln.hangs:
            s.append(f'<rect class="hang" x="{x(t_a):.1f}" y="1" width="{w(t_a, t_b, 2):.1f}" height="{LANE - 2}" '
                     f'fill="{MARKS["hang"]}"><title>{_e(title)} ({_e(human.seconds(t_b - t_a))} from its last progress'
                     f' to the detection)</title></rect>')
        columns: dict[int, tuple[float, int | None]] = {}
        for t, it in ln.ticks:  # one tick per pixel column (the latest): a day of samples stays a small page
            columns[round(x(t))] = (t, it)
        if len(columns) <= MAX_TITLED_TICKS:
            for t, it in columns.values():
                label = f"iteration {human.count(it)}" if it is not None else "progress"
                s.append(f'<line class="tick" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="3" y2="{LANE - 3}" '
                         f'stroke="{MARKS["tick"]}" stroke-width="1.5"><title>rank {ln.rank}: {label} at '
                         f'{_e(human.seconds(t - m.t0))}</title></line>')
        elif columns:  # many: one path, one tooltip
            d = "".join(f"M{px},3V{LANE - 3}" for px in columns)
            last_t, last_it = max(columns.values())
            s.append(f'<path class="ticks" data-samples="{len(columns)}" d="{d}" stroke="{MARKS["tick"]}" '
                     f'stroke-width="1"><title>rank {ln.rank}: {human.count(len(ln.ticks))} progress samples; the '
                     f'last at {_e(human.seconds(last_t - m.t0))}, iteration {human.count(last_it)}</title></path>')
        for t, title in ln.exits:
            cx = x(t)
            s.append(f'<path class="exit" d="M{cx - 4:.1f},3 L{cx + 4:.1f},{LANE - 3} M{cx + 4:.1f},3 '
                     f'L{cx - 4:.1f},{LANE - 3}" stroke="{MARKS["exit"]}" stroke-width="1.5">'
                     f'<title>{_e(title)}</title></path>')
        label = f"rank {ln.rank}" + (f" · node {ln.node}" if many_nodes and ln.node is not None else "")
        row(label[:20], s, "rank", f' data-rank="{ln.rank}"')
    for mode in ("process", "inprocess"):
        drawn = [r for r in m.restarts if r.mode == mode]
        if not drawn:
            continue
        s = []
        for r in drawn:
            t = r.start
            for name, dur in r.phases:
                s.append(f'<rect class="phase" data-mode="{mode}" data-phase="{_e(name)}" x="{x(t):.1f}" y="0" '
                         f'width="{w(t, t + dur):.1f}" height="{LANE}" fill="{color(mode, name)}"><title>'
                         f'{_e(KIND_TITLE[mode])}, {_e(name)}: {_e(human.seconds(dur))}</title></rect>')
                t += dur
        row(KIND_TITLE[mode], s, f"restarts {mode}", f' data-mode="{mode}"')
    axis = []
    step = _tick_step(span)
    k = 0.0
    while k <= span + 1e-9:
        axis.append(f'<line x1="{x(m.t0 + k):.1f}" x2="{x(m.t0 + k):.1f}" y1="{y}" y2="{y + 4}" stroke="#999"/>'
                    f'<text class="axis" x="{x(m.t0 + k):.1f}" y="{y + 15}" text-anchor="middle">'
                    f'{_e(human.seconds(k))}</text>')
        k += step
    y += 20
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" viewBox="0 0 {WIDTH} {y}" '
            f'width="{WIDTH}" height="{y}" role="img" aria-label="timeline of the run">'
            + "".join(rows) + "".join(axis) + "</svg>")


def legend(mode: str, restarts: Sequence[Restart] = ()) -> str:
    """The phases of one kind of restart, in order, each with what it measures."""
    names = list(RESTART_PHASES.get(mode, ()))
    for r in restarts:
        names += [n for n, _ in r.phases if n not in names]
    items = "".join(f'<li><span class="swatch" style="background:{color(mode, n)}"></span><b>{_e(n)}</b> '
                    f'{_e(PHASE_HELP.get(mode, {}).get(n, ""))}</li>' for n in names)
    return (f'<div class="legend" data-mode="{mode}"><h3>{_e(KIND_TITLE.get(mode, mode))} phases</h3>'
            f"<ul>{items}</ul></div>")


def marks_legend(m: Model) -> str:
    """What the lanes' shapes mean, for the shapes drawn."""
    drawn = {"run": any(ln.runs for ln in m.lanes), "tick": any(ln.ticks for ln in m.lanes),
             "hang": any(ln.hangs for ln in m.lanes), "wait": any(ln.waits for ln in m.lanes),
             "stop": any(ln.stops for ln in m.lanes), "exit": any(ln.exits for ln in m.lanes)}
    items = [("run", "the rank's process, from its attempt's start to its end"),
             ("tick", "progress sample: when the rank last made progress, at each poll"),
             ("hang", "hang: from the hung rank's last progress to its detection"),
             ("wait", "wait: a rank the roll call found waiting for the hung one, from its last progress"),
             ("stop", "stop: the launcher stops the node's workers (SIGTERM, grace, SIGKILL)"),
             ("exit", "exit: the worker ended (torch's record of the failure)")]
    return ('<div class="legend marks"><h3>Lanes</h3><ul>'
            + "".join(f'<li><span class="swatch {k}" style="background:{MARKS[k]}"></span>{_e(t)}</li>'
                      for k, t in items if drawn[k]) + "</ul></div>")


def phase_bar(r: Restart, width: int = 640) -> str:
    """One restart's phases at their own scale, each labelled where it is wide enough."""
    total = sum(d for _, d in r.phases) or 1e-9
    parts = []
    x0 = 0.0
    for name, d in r.phases:
        pw = width * d / total
        parts.append(f'<rect class="phase" data-mode="{r.mode}" data-phase="{_e(name)}" x="{x0:.1f}" y="0" '
                     f'width="{max(pw, 0.5):.1f}" height="18" fill="{color(r.mode, name)}"><title>{_e(name)}: '
                     f'{_e(human.seconds(d))}</title></rect>')
        if pw > 7 * (len(name) + 7):
            parts.append(f'<text x="{x0 + 3:.1f}" y="13" class="on-bar">{_e(name)} {_e(human.seconds(d))}</text>')
        x0 += pw
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="phase-bar" data-mode="{r.mode}" '
            f'viewBox="0 0 {width} 18" width="{width}" height="18" role="img" '
            f'aria-label="{_e(KIND_TITLE.get(r.mode, r.mode))} phases">' + "".join(parts) + "</svg>")
