"""Shared plumbing for the benchmarks: real daemons, real worker processes, statistics.

Owns what every benchmark module needs and nothing it measures: a private
socket directory, a `ft-monitor serve` daemon started as its own process, worker
processes that talk line-by-line JSON over stdin/stdout, readings of
/proc/PID/status, and the `Figure` record that bench/run.py prints and saves.
Every wait is bounded and polls for an event (a socket that answers, a line).
Starting, waiting for and stopping the daemon is shared with tests/procs.py: see
ft_monitor/testing.py.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_monitor import testing
from ft_monitor.testing import ping as ping  # re-exported: callers import it from here

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


# -- budgets ---------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """How much work each benchmark does: `full`, `quick` (< 1 min) or `smoke` (< 30 s, test only)."""

    name: str

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        return {"full": full, "quick": quick, "smoke": smoke}[self.name]


# -- results ---------------------------------------------------------------------
@dataclass
class Figure:
    """One measured figure: a row of the table and an entry of the JSON file."""

    id: str
    what: str
    unit: str
    samples: list[float] = field(default_factory=list)
    target: str = "-"
    limit: float | None = None  # met when median (or `judge`) <= limit (>= limit with op=">=")
    judge: str = "median"  # which statistic the target is about: median | p99 | max | min | value
    op: str = "<="
    loop: str | None = None
    value: Any = None  # for single-valued figures (a flag, a count)
    details: dict[str, Any] = field(default_factory=dict)
    met: bool | None = None  # set explicitly for boolean checks; computed otherwise

    def stats(self) -> dict[str, float | int | None]:
        return summarize(self.samples)

    def verdict(self) -> bool | None:
        if self.met is not None:
            return self.met
        if self.limit is None:
            return None
        s = self.stats()
        v = self.value if self.judge == "value" else s.get(self.judge)
        if v is None:
            return None
        return bool(v >= self.limit) if self.op == ">=" else bool(v <= self.limit)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "what": self.what,
            "loop": self.loop,
            "unit": self.unit,
            **self.stats(),
            "percentiles": percentiles(self.samples),
            "value": self.value,
            "target": self.target,
            "met": self.verdict(),
            "details": self.details,
        }


def summarize(samples: Sequence[float]) -> dict[str, float | int | None]:
    if not samples:
        return {"n": 0, "median": None, "p99": None, "min": None, "max": None}
    s = sorted(samples)
    n = len(s)
    return {"n": n, "median": _pct(s, 50), "p99": _pct(s, 99), "min": s[0], "max": s[-1]}


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """The shape of the distribution, for the JSON (the samples themselves are not kept)."""
    if not samples:
        return {}
    s = sorted(samples)
    return {f"p{q:g}": _pct(s, q) for q in (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)}


def _pct(sorted_samples: Sequence[float], q: float) -> float:
    """Percentile by linear interpolation between closest ranks (numpy's default)."""
    n = len(sorted_samples)
    if n == 1:
        return sorted_samples[0]
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)


# -- processes -------------------------------------------------------------------
def private_dir() -> Path:
    """A 0700 directory with a short path under /tmp (AF_UNIX paths are limited to 107 bytes)."""
    return testing.short_dir("ftb-")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: no inherited FT_* settings, the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(extra or {})
    return env


def resolve_loop(name: str) -> str:
    """`auto` means what `ft-monitor serve --loop auto` picks: uvloop when installed."""
    if name != "auto":
        return name
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def end_by_stdin(proc: subprocess.Popen[Any], timeout: float) -> None:
    """End a child whose cue to exit is the end of its stdin: close it, wait up to ``timeout``
    seconds, then SIGKILL it (and wait 10 s more)."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.001) -> Any:
    return testing.wait_until(predicate, timeout, what, interval, error=RuntimeError)


def read_kb(pid: int, key: str = "VmRSS") -> int:
    """A ``kB`` field of /proc/PID/status (VmRSS, VmHWM, RssAnon...)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def private_kb(pid: int) -> int | None:
    """Memory only this process holds (USS: Private_Clean + Private_Dirty of /proc/PID/smaps_rollup)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except OSError:
        return None


def maps_mention(pid: int, word: str) -> bool:
    """Whether any mapped file of the process has ``word`` in its path (e.g. a torch library)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(word in line for line in f)


class Daemon(testing.ServeProcess):
    """A real `python -m ft_monitor.cli serve` process on a socket in a private directory.

    `wait_ready()` records `ready_after`, the seconds from spawn to the first PING answered."""

    ready_timeout = 30.0
    poll_interval = 0.001
    failure = RuntimeError

    def __init__(self, directory: Path, loop: str, *flags: str, name: str = "r0.sock") -> None:
        self.dir = directory
        self.loop = loop
        self.report_dir = directory / "reports"
        super().__init__(directory / name, "--loop", loop, *flags, log_path=directory / f"{Path(name).stem}.log",
                         env=clean_env(), cwd=ROOT, python=PY)

    def rss_kb(self) -> int:
        return read_kb(self.pid)

    def status(self) -> dict[str, Any]:
        """`ft-monitor status --json`, run as the user would run it."""
        out = subprocess.run([PY, "-m", "ft_monitor.cli", "status", "--socket", str(self.socket), "--json"],
                             capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"ft-monitor status failed ({out.returncode}): {out.stderr}")
        return json.loads(out.stdout)


class Worker:
    """A benchmark worker process (`python -m bench.MODULE --worker ...`): JSON lines both ways."""

    def __init__(self, module: str, args: Iterable[str], env: dict[str, str] | None = None,
                 new_session: bool = False) -> None:
        self.proc = subprocess.Popen([PY, "-m", module, "--worker", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                     env=clean_env(env), text=True, start_new_session=new_session)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60.0) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"worker {self.proc.args[2]} gave no answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(5)
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"worker {self.proc.args[2]} exited ({rc}) without answering:\n{err}")
        return json.loads(line)

    def finish(self, timeout: float = 30.0) -> int:
        for f in (self.proc.stdin,):
            if f is not None and not f.closed:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(5)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return rc


# -- worker side -----------------------------------------------------------------
def say(obj: Any) -> None:
    """Worker -> harness: one JSON line."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def hear() -> Any:
    """Harness -> worker: one JSON line (None at end of input)."""
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def launcher_run(argv: list[str], d: Path, what: str) -> tuple[dict[str, Any], str]:
    """Run ft-launcher (``argv``, writing its --ft-summary-json in ``d``) to its end: its
    summary and output; an error with the output's end when it fails."""
    out_path = d / "launcher.out"
    with open(out_path, "w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=clean_env(), timeout=180)
    text = out_path.read_text()
    summary_path = d / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"{what}: ft-launcher exited with {proc.returncode}:\n{text[-4000:]}")
    return json.loads(summary_path.read_text()), text


def cleanup(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
