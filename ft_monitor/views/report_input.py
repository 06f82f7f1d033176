"""What `ft-monitor report` reads: the run folders, their events, and the evidence beside them.

A run folder is what ft-launcher writes under ``--log-dir`` (``<run id>_<random>/``):
``events.jsonl``, and per attempt ``attempt_N/diagnosis.json`` and per local rank
``attempt_N/<local rank>/`` with the stack dumps, hang reports, Flight Recorder traces,
error.json and the monitor's log. `load` takes any number of paths (a run folder, its
events.jsonl, or a log directory holding run folders: one per node, or several launchers
sharing one ``--log-dir``), reads every events.jsonl (validated, events.read_events),
merges them in time order, and collects:

* every evidence file found in the attempt folders (never following a link), with the
  attempt and global rank it belongs to (the file name's ``rank<R>-``, else the local
  rank folder mapped through the attempt's ``attempt_start``);
* each diagnosis.json an event names, read bounded and parsed by `parse_diagnosis`, which
  keeps only what the page shows and raises nothing but ReportError;
* the latest stack dump of each hung rank whose incident has no diagnosis (in-process
  restarts take no roll call);
* where each path an event names is now: the run folder may have been moved or copied
  (the events keep the paths as written), so a path under the log directory the events
  name is looked for under the folder they were read from.

Nothing here decides anything: the culprit, the verdict and the counts are the
launcher's, as its events and diagnosis.json record them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_client.errors import FtError
from ft_client.safefiles import read_bounded
from ft_monitor.forensics import stacks
from ft_monitor.launcher.telemetry.events import EVENTS_FILE, read_events

MAX_DIAGNOSIS_BYTES = 64 * 1024 * 1024
"""diagnosis.json holds at most 32 KiB of stack per rank (and as much of native stack): about
33 MB for 1,000 ranks. A larger file is refused (listed under "Not read") rather than read."""
MAX_STACK_BYTES = 64 * 1024
MAX_FILES = 20_000
"""Evidence files listed per run folder (a folder holding more is listed up to this)."""
TOP_FRAMES = 8
"""Frames shown of a rank's stack (innermost first)."""

_RANK_IN_NAME = re.compile(r"^rank(\d{1,9})-")
_DUMP_HEADER = "# ft-monitor stack dump"


class ReportError(FtError, ValueError):
    """Run folders that cannot be rendered (none, no events, or of different jobs)."""


@dataclass(frozen=True)
class StackTop:
    """Where one rank was when its stack was taken."""

    rank: int
    host: str | None
    pid: int | None
    where: str | None
    """The innermost frame of the user's own code (stacks.where)."""
    frames: tuple[str, ...]
    """The main thread's innermost frames, innermost first (stacks.Frame.short)."""
    in_collective: bool | None
    source: str
    """The file the stack was read from."""


@dataclass(frozen=True)
class DiagnosisDoc:
    """What the page shows of a diagnosis.json (the launcher's roll call of a hang)."""

    path: str
    attempt: int | None
    verdict: str
    basis: str
    behind: tuple[int, ...]
    waiting: tuple[int, ...]
    stacks: dict[int, StackTop]


@dataclass(frozen=True)
class EvidenceFile:
    path: Path
    """Where it is now."""
    run_dir: Path
    attempt: int | None
    rank: int | None
    kind: str
    """diagnosis, stack dump, hang report, Flight Recorder trace, native stack, error file,
    monitor log, events, other."""


@dataclass(frozen=True)
class RunFolder:
    path: Path
    events: list[dict[str, Any]]
    log_dirs: tuple[str, ...]
    """The run folder's path as its events name it (``attempt_start.log_dir``)."""


@dataclass
class ReportInput:
    runs: list[RunFolder]
    events: list[dict[str, Any]]
    """Every run folder's events, by time (then host, launcher, seq)."""
    files: list[EvidenceFile] = field(default_factory=list)
    diagnoses: dict[str, DiagnosisDoc] = field(default_factory=dict)
    """By the path the ``diagnosis`` event names."""
    stacks: dict[str, StackTop] = field(default_factory=dict)
    """By the ``stack_dump`` path a ``hang`` event names (the culprits without a diagnosis)."""
    located: dict[str, Path] = field(default_factory=dict)
    """Each path an event names -> where that file is now (absent: not found)."""
    problems: list[str] = field(default_factory=list)
    """What could not be read, for the page to say."""


def run_folders(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The run folders the paths name: a run folder, its events file, or a log directory
    with run folders one level down (all of them). Raises ReportError for a path that is
    none of these."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            found.append(p.parent)
        elif (p / EVENTS_FILE).is_file():
            found.append(p)
        elif p.is_dir():
            below = sorted(q.parent for q in p.glob(f"*/{EVENTS_FILE}") if q.is_file())
            if not below:
                raise ReportError(f"{p} holds no {EVENTS_FILE}, and no run folder with one: RUN_DIR is the run's "
                                  f"log directory, where ft-launcher writes {EVENTS_FILE} (the summary line "
                                  "'events: ...' names it), or the --log-dir above it")
            found.extend(below)
        else:
            raise ReportError(f"{p / EVENTS_FILE} does not exist: RUN_DIR is the run's log directory, where "
                              f"ft-launcher writes {EVENTS_FILE} (the summary line 'events: ...' names it)")
    out: list[Path] = []
    for f in found:
        if f.resolve() not in {o.resolve() for o in out}:
            out.append(f)
    if not out:
        raise ReportError("no run folder given")
    return out


def _order(e: Mapping[str, Any]) -> tuple[float, str, int, int]:
    return (float(e["time"]), str(e["host"]), int(e["launcher_pid"]), int(e["seq"]))


def load(paths: Sequence[str | os.PathLike[str]]) -> ReportInput:
    runs: list[RunFolder] = []
    for folder in run_folders(paths):
        events = read_events(folder / EVENTS_FILE)
        if not events:
            raise ReportError(f"{folder / EVENTS_FILE} holds no events")
        log_dirs = tuple(sorted({str(e["log_dir"]) for e in events if e["kind"] == "attempt_start"
                                 and e.get("log_dir")}))
        runs.append(RunFolder(folder, events, log_dirs))
    _same_job(runs)
    merged = sorted((e for r in runs for e in r.events), key=_order)
    data = ReportInput(runs, merged)
    for run in runs:
        data.files.extend(_scan(run))
    for e in merged:
        reporter = reporter_of(e)
        named = [e.get(k) for k in ("report", "stack_dump", "error_file")] + [reporter.get("report"),
                                                                             reporter.get("stack_dump")]
        if e["kind"] == "diagnosis":
            named.append(e.get("path"))
        for value in named:
            if isinstance(value, str) and value and value not in data.located:
                where = _locate(value, runs)
                if where is not None:
                    data.located[value] = where
    for e in merged:
        if e["kind"] == "diagnosis" and e["path"] not in data.diagnoses:
            where = data.located.get(e["path"])
            if where is None:
                data.problems.append(f"diagnosis {e['path']} was not found")
                continue
            try:
                data.diagnoses[e["path"]] = parse_diagnosis(_read_json(where, MAX_DIAGNOSIS_BYTES), str(where))
            except ReportError as err:
                data.problems.append(f"{where}: {err}")
    diagnosed = {(int(e["attempt"]), int(e["rank"])) for e in merged if e["kind"] == "diagnosis"}
    for e in merged:
        dump = e.get("stack_dump") if e["kind"] == "hang" else None
        if dump and (int(e["attempt"]), int(e["rank"])) not in diagnosed and dump in data.located:
            top = _stack_file(data.located[dump], int(e["rank"]), str(e["host"]), int(e["pid"]))
            if top is not None:
                data.stacks[dump] = top
        reporter = reporter_of(e)
        dump = reporter.get("stack_dump")
        if isinstance(dump, str) and dump in data.located and isinstance(reporter.get("rank"), int):
            top = _stack_file(data.located[dump], int(reporter["rank"]), str(e["host"]),
                              int(reporter["pid"]) if isinstance(reporter.get("pid"), int) else 0)
            if top is not None:
                data.stacks[dump] = top
    return data


def reporter_of(e: Mapping[str, Any]) -> dict[str, Any]:
    """A hang event's ``reported_by`` (the waiting rank whose monitor fired first), or {}."""
    r = e.get("reported_by") if e.get("kind") == "hang" else None
    return dict(r) if isinstance(r, dict) else {}


def _same_job(runs: list[RunFolder]) -> None:
    """Run folders of different jobs (different run ids) are not one page."""
    ids: dict[str, list[Path]] = {}
    for r in runs:
        for run_id in sorted({str(e["run_id"]) for e in r.events if e["kind"] == "attempt_start"}):
            ids.setdefault(run_id, []).append(r.path)
    if len(ids) > 1:
        listed = "; ".join(f"run id {rid}: {', '.join(map(str, ps))}" for rid, ps in sorted(ids.items()))
        raise ReportError(f"the run folders are of {len(ids)} different jobs ({listed}); give the folders of "
                          "one job (one per node, or the --log-dir its launchers shared)")


def _locate(path: str, runs: list[RunFolder]) -> Path | None:
    """Where a file an event names is now: as named, else under the run folder the events were
    read from (the same path relative to the log directory the events name)."""
    for run in runs:
        for log_dir in run.log_dirs:
            try:
                rel = os.path.relpath(path, log_dir)
            except ValueError:
                continue
            if rel.startswith(os.pardir):
                continue
            candidate = run.path / rel
            if _is_file(candidate):
                return candidate
    p = Path(path)
    return p if p.is_absolute() and _is_file(p) else None


def _is_file(p: Path) -> bool:
    try:
        return p.is_file() and not p.is_symlink()
    except OSError:
        return False


def _kind(name: str) -> str:
    if name == "diagnosis.json":
        return "diagnosis"
    if name == "error.json":
        return "error file"
    if name == "monitor.log":
        return "monitor log"
    if name == EVENTS_FILE:
        return "events"
    if name.endswith("-stack.txt"):
        return "stack dump"
    if name.endswith("-hang.json"):
        return "hang report"
    if "native" in name:
        return "native stack"
    if re.search(r"-fr\d*\.json$", name):
        return "Flight Recorder trace"
    return "other"


def _scan(run: RunFolder) -> list[EvidenceFile]:
    """Every file of the run folder's attempt folders, and its events file."""
    local_to_global: dict[tuple[int, int], int] = {}
    for e in run.events:
        if e["kind"] == "attempt_start":
            for g, entry in e["ranks"].items():
                lr = entry.get("local_rank")
                if isinstance(lr, int):
                    local_to_global[(int(e["attempt"]), lr)] = int(g)
    out = [EvidenceFile(run.path / EVENTS_FILE, run.path, None, None, "events")]
    try:
        attempts = sorted(os.scandir(run.path), key=lambda d: d.name)
    except OSError:
        return out
    for entry in attempts:
        m = re.fullmatch(r"attempt_(\d{1,9})", entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        attempt = int(m.group(1))
        for path, local in _files_below(Path(entry.path)):
            if len(out) >= MAX_FILES:
                return out
            named = _RANK_IN_NAME.match(path.name)
            rank = int(named.group(1)) if named else (
                local_to_global.get((attempt, local)) if local is not None else None)
            out.append(EvidenceFile(path, run.path, attempt, rank, _kind(path.name)))
    return out


def _files_below(folder: Path) -> list[tuple[Path, int | None]]:
    """The regular files of an attempt folder and of its local rank folders (one level)."""
    found: list[tuple[Path, int | None]] = []
    try:
        entries = sorted(os.scandir(folder), key=lambda d: d.name)
    except OSError:
        return found
    for entry in entries:
        if entry.is_file(follow_symlinks=False):
            found.append((Path(entry.path), None))
        elif entry.is_dir(follow_symlinks=False) and entry.name.isdecimal() and len(entry.name) < 10:
            try:
                inner = sorted(os.scandir(entry.path), key=lambda d: d.name)
            except OSError:
                continue
            found.extend((Path(f.path), int(entry.name)) for f in inner if f.is_file(follow_symlinks=False))
    return found


def _read_json(path: Path, limit: int) -> Any:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ReportError(f"cannot read it: {e.strerror}") from e
    if size > limit:
        raise ReportError(f"{size:,} bytes, more than the {limit:,} read")
    try:
        return json.loads(read_bounded(path, limit))
    except (OSError, FtError) as e:
        raise ReportError(f"cannot read it: {e}") from e
    except (ValueError, RecursionError) as e:
        raise ReportError(f"not JSON ({type(e).__name__})") from e


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 else None


def _text(v: Any, limit: int = 4096) -> str | None:
    return v[:limit] if isinstance(v, str) else None


def _ranks(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        return ()
    return tuple(r for r in (_int(x) for x in v[:100_000]) if r is not None)


def stack_top(text: str, rank: int, host: str | None, pid: int | None, source: str) -> StackTop | None:
    """The main thread's innermost frames of the latest dump in ``text`` (None: no thread in it)."""
    latest = text.rsplit(_DUMP_HEADER, 1)[-1] if _DUMP_HEADER in text else text
    main = stacks.main_thread(stacks.parse(latest))
    if main is None:
        return None
    return StackTop(rank, host, pid, stacks.where(main), tuple(f.short() for f in main.frames[:TOP_FRAMES]),
                    stacks.in_collective(main), source)


def parse_diagnosis(doc: Any, source: str) -> DiagnosisDoc:
    """The parts of a diagnosis.json (diagnosis.Diagnosis.document) the page shows; a
    document that is not one raises ReportError, odd fields are left out."""
    if not isinstance(doc, dict) or doc.get("schema") != "ft-monitor/diagnosis":
        raise ReportError("not an ft-monitor diagnosis document")
    verdict = doc.get("verdict")
    if not isinstance(verdict, dict) or not isinstance(verdict.get("line"), str):
        raise ReportError("a diagnosis without its verdict line")
    tops: dict[int, StackTop] = {}
    ranks = doc.get("ranks")
    for entry in ranks[:100_000] if isinstance(ranks, list) else ():
        if not isinstance(entry, dict):
            continue
        rank = _int(entry.get("rank"))
        stack = _text(entry.get("stack"), MAX_STACK_BYTES)
        if rank is None or not stack:
            continue
        top = stack_top(stack, rank, _text(entry.get("host"), 255), _int(entry.get("pid")), source)
        if top is not None:
            tops[rank] = top
    return DiagnosisDoc(path=source, attempt=_int(doc.get("attempt")), verdict=verdict["line"][:4096],
                        basis=_text(verdict.get("basis"), 64) or "", behind=_ranks(verdict.get("behind")),
                        waiting=_ranks(verdict.get("waiting")), stacks=tops)


def _stack_file(path: Path, rank: int, host: str, pid: int) -> StackTop | None:
    try:
        text = read_bounded(path, MAX_STACK_BYTES)
    except (OSError, FtError):
        return None
    return stack_top(text, rank, host, pid, str(path))
