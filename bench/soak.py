#!/usr/bin/env python3
"""Soak: many daemon/rank pairs under steady traffic, with hangs and crashes injected.

    bench/soak.py [--pairs 8] [--seconds 600] [--rate 10000] [--inject-every 6] [--seed 0] [--json OUT]

Not part of CI (tests/test_soak.py runs it for 20 s with `pytest -m soak`). Each pair
is a real `ft-monitor serve` daemon and a real rank process (`python -m bench.soak
--worker`) that sends `step` sections and heartbeats through RankMonitorClient at
about --rate events/s (3 events per iteration, paced every 10 ms). Each rank, at
random times (exponential, mean --inject-every seconds), either hangs inside `step`
(the daemon must report and kill it) or crashes (SIGKILL to itself: the daemon must
log an exit, not a hang); the harness restarts it. The rank writes what it does to
a journal (one JSON line per decision) *before* doing it.

Checks, printed as JSON (exit 1 when one fails):
* every injected hang caught: a hang report exists for exactly the pids that hung;
* no false kill: no hang report, and no death by a signal, for a rank that did not hang;
* events counted equal on both sides: every few seconds each rank asks STATUS over its
  own (ordered) connection; the daemon's session ``events`` (heartbeats, section
  opens/closes, iteration reports) must equal the event frames the rank handed to its
  transport (bench/events.py);
* daemon RSS flat: sampled every second; growth from the end of the first quarter
  (warm-up) to the end must stay under --rss-limit-kb for every daemon.
Also reported, not judged: the daemons' open fds at the same two moments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"

if __name__ == "__main__" and sys.argv[1:2] != ["--worker"]:
    if VENV_PY.exists() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        os.execv(str(VENV_PY), [str(VENV_PY), *sys.argv])
    sys.path.insert(0, str(ROOT))

STEP_TIMEOUT = 0.5
HEARTBEAT_TIMEOUT = 2.0
TICK = 0.01
CHECK_EVERY = 2.0
QUIET_END = 3.0
"""No injection in the last seconds, so every hang is handled (and the rank restarted) before the end."""


# -- rank side ----------------------------------------------------------------------------------


def worker(argv: list[str]) -> None:
    from bench.events import EventCounter
    from ft_client import RankMonitorClient, wire

    a = argparse.ArgumentParser()
    a.add_argument("--socket", required=True)
    a.add_argument("--journal", required=True)
    a.add_argument("--until", type=float, required=True, help="time.time() to stop at")
    a.add_argument("--rate", type=float, required=True)
    a.add_argument("--inject-every", type=float, required=True)
    a.add_argument("--seed", type=int, required=True)
    args = a.parse_args(argv)
    pid = os.getpid()
    journal = open(args.journal, "a", buffering=1)

    def note(kind: str, **kw: Any) -> None:
        journal.write(json.dumps({"pid": pid, "t": time.time(), "kind": kind, **kw}) + "\n")
        journal.flush()

    counter = EventCounter().install()
    client = RankMonitorClient(args.socket)
    client.init_workload_monitoring()
    note("start")
    rng = random.Random(args.seed * 1_000_003 + pid)
    now = time.monotonic()
    end = now + (args.until - time.time())
    inject_at = now + rng.expovariate(1.0 / args.inject_every) if args.inject_every > 0 else float("inf")
    check_at = now + CHECK_EVERY
    per_tick = max(1, round(args.rate * TICK / 3))
    next_tick = now
    start, stop, hb = client.start_section, client.end_section, client.send_heartbeat

    def check() -> None:
        t = client._transport  # the rank's own connection: STATUS is ordered after every event sent
        assert t is not None, client.lost_reason
        reply = t.request(wire.STATUS)
        assert isinstance(reply, wire.StatusReply), reply
        note("check", sent=counter.sent, counted=reply.status.get("events"))

    while True:
        now = time.monotonic()
        if now >= end:
            break
        behind = min(5, int((now - next_tick) / TICK) + 1)  # catch up a little after a stall, never burst
        for _ in range(per_tick * behind):
            start("step")
            stop("step")
            hb()
        next_tick += TICK * behind
        if now >= check_at:
            check()
            check_at = now + CHECK_EVERY
        if now >= inject_at and now < end - QUIET_END:
            if rng.random() < 0.5:
                note("hang", sent=counter.sent)
                start("step")
                time.sleep(3600)  # the daemon reports and kills us
            else:
                note("crash", sent=counter.sent)
                os.kill(pid, signal.SIGKILL)
        delay = next_tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    check()
    note("done", sent=counter.sent)
    client.shutdown_workload_monitoring()


# -- harness side -------------------------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Pair:
    def __init__(self, i: int, base: Path, args: argparse.Namespace) -> None:
        from bench.harness import Daemon

        self.i = i
        self.args = args
        self.until = 0.0  # time.time() at which the ranks stop; set once every daemon serves
        self.reports = base / f"reports{i}"
        self.journal = base / f"journal{i}.jsonl"
        self.worker_log = open(base / f"worker{i}.log", "a")
        self.daemon = Daemon(base, args.loop, "--ft-rank-section-timeouts", f"step:{STEP_TIMEOUT}",
                             "--ft-rank-heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                             "--ft-stack-dump-timeout", "0.5", "--ft-termination-grace-time", "0.5",
                             "--ft-report-dir", str(self.reports), name=f"r{i}.sock")
        self.rank: subprocess.Popen[bytes] | None = None
        self.exits: list[tuple[int, int]] = []  # (pid, returncode)
        self.rss: list[tuple[float, int]] = []
        self.fds: list[tuple[float, int]] = []

    def start_rank(self) -> None:
        from bench.harness import PY, clean_env

        self.rank = subprocess.Popen(
            [PY, "-m", "bench.soak", "--worker", "--socket", str(self.daemon.socket), "--journal", str(self.journal),
             "--until", str(self.until), "--rate", str(self.args.rate), "--inject-every", str(self.args.inject_every),
             "--seed", str(self.args.seed + self.i)],
            stdout=self.worker_log, stderr=subprocess.STDOUT, cwd=ROOT, env=clean_env(), start_new_session=True)

    def poll(self, restart: bool) -> None:
        if self.rank is None:
            return
        rc = self.rank.poll()
        if rc is None:
            return
        self.exits.append((self.rank.pid, rc))
        self.rank = None
        if restart:
            self.start_rank()

    def sample(self, t: float) -> None:
        from bench.harness import read_kb

        self.rss.append((t, read_kb(self.daemon.pid)))
        self.fds.append((t, fd_count(self.daemon.pid)))


def _at(samples: list[tuple[float, int]], t: float) -> int:
    """The first sample taken at or after ``t`` (else the last)."""
    for ts, v in samples:
        if ts >= t:
            return v
    return samples[-1][1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.harness import cleanup, private_dir, wait_until

    base = private_dir()
    pairs = [Pair(i, base, args) for i in range(args.pairs)]
    try:
        for p in pairs:
            p.daemon.wait_ready()
        until = time.time() + args.seconds  # the run counts from when every daemon serves
        for p in pairs:
            p.until = until
            p.start_rank()
        started = time.monotonic()
        next_sample = started
        while time.time() < until:
            restart = time.time() < until - 1.0  # a rank started now still runs and checks before the end
            for p in pairs:
                p.poll(restart)
            if time.monotonic() >= next_sample:
                for p in pairs:
                    p.sample(time.monotonic() - started)
                next_sample += 1.0
            time.sleep(0.05)  # the harness's own pace: poll exits, sample memory
        # the end: every rank finishes (a last hang is killed within timeout + dump + grace)
        wait_until(lambda: all(p.rank is None or p.rank.poll() is not None for p in pairs), 60, "ranks to finish")
        for p in pairs:
            p.poll(restart=False)
        return judge(pairs, args, time.monotonic() - started)
    finally:
        for p in pairs:
            if p.rank is not None and p.rank.poll() is None:
                os.killpg(p.rank.pid, signal.SIGKILL)
                p.rank.wait(5)
        for p in pairs:
            p.daemon.stop()
            p.worker_log.close()
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            cleanup(base)


def judge(pairs: list[Pair], args: argparse.Namespace, elapsed: float) -> dict[str, Any]:
    from bench.harness import wait_until

    injected_hangs: set[int] = set()
    crashes: set[int] = set()
    done: set[int] = set()
    checks = 0
    mismatches: list[dict[str, Any]] = []
    sent_total = 0
    unexpected_exits: list[dict[str, Any]] = []
    false_kills: list[dict[str, Any]] = []
    missed: list[int] = []
    reports_total = 0
    rss_growth: list[int] = []
    fd_growth: list[int] = []
    per_pair = []
    for p in pairs:
        entries = [json.loads(line) for line in p.journal.read_text().splitlines()] if p.journal.exists() else []
        last: dict[int, dict[str, Any]] = {}
        hangs = set()
        for e in entries:
            last[e["pid"]] = e
            if e["kind"] == "hang":
                hangs.add(e["pid"])
            elif e["kind"] == "crash":
                crashes.add(e["pid"])
            elif e["kind"] == "done":
                done.add(e["pid"])
            elif e["kind"] == "check":
                checks += 1
                if e["sent"] != e["counted"]:
                    mismatches.append({"pair": p.i, **e})
        injected_hangs |= hangs
        sent_total += sum(e.get("sent", 0) for e in last.values())

        def reports_done(p: Any = p, hangs: set[int] = hangs) -> tuple[list[dict[str, Any]]] | None:
            out = []
            for f in p.reports.glob("*-hang.json"):
                try:
                    data = json.loads(f.read_text())
                except ValueError:
                    return None
                if not data.get("terminated_by"):
                    return None
                out.append(data)
            return (out,) if len(out) >= len(hangs) else None  # a tuple: an empty list is an answer too

        try:
            (reports,) = wait_until(reports_done, 10, f"pair {p.i}'s hang reports")
        except RuntimeError:
            reports = [json.loads(f.read_text()) for f in p.reports.glob("*-hang.json")]
        reports_total += len(reports)
        reported = {r["pid"] for r in reports}
        missed += sorted(hangs - reported)
        for r in reports:
            if r["pid"] not in hangs:
                false_kills.append({"pair": p.i, "pid": r["pid"], "message": r.get("message")})
        for pid, rc in p.exits:
            kind = last.get(pid, {}).get("kind")
            expected = {"hang": (-signal.SIGTERM, -signal.SIGKILL), "crash": (-signal.SIGKILL,), "done": (0,)}
            if rc not in expected.get(kind or "", ()):
                unexpected_exits.append({"pair": p.i, "pid": pid, "rc": rc, "last": kind})
                if rc in (-signal.SIGTERM, -signal.SIGKILL) and kind not in ("hang", "crash"):
                    false_kills.append({"pair": p.i, "pid": pid, "rc": rc})
        warm = elapsed / 4
        rss_growth.append(p.rss[-1][1] - _at(p.rss, warm))
        fd_growth.append(p.fds[-1][1] - _at(p.fds, warm))
        per_pair.append({"pair": p.i, "hangs": len(hangs), "reports": len(reports), "restarts": len(p.exits),
                         "rss_kb_first": p.rss[0][1], "rss_kb_warm": _at(p.rss, warm), "rss_kb_last": p.rss[-1][1],
                         "rss_kb_max": max(v for _, v in p.rss), "fds_warm": _at(p.fds, warm),
                         "fds_last": p.fds[-1][1]})
    result = {
        "pairs": args.pairs, "seconds": round(elapsed, 1), "target_rate_per_pair": args.rate,
        "events_sent": sent_total, "events_per_s_all_pairs": round(sent_total / elapsed),
        "injected_hangs": len(injected_hangs), "hang_reports": reports_total, "missed_hangs": missed,
        "injected_crashes": len(crashes), "ranks_finished": len(done), "false_kills": false_kills,
        "unexpected_exits": unexpected_exits, "event_checks": checks, "event_mismatches": mismatches,
        "rss_growth_kb_after_warmup": rss_growth, "fd_growth_after_warmup": fd_growth, "per_pair": per_pair,
    }
    result["checks"] = {
        "every_hang_caught": not missed and reports_total == len(injected_hangs),
        "no_false_kill": not false_kills and not unexpected_exits,
        "events_equal": checks > 0 and not mismatches,
        "rss_flat": max(rss_growth) < args.rss_limit_kb,
    }
    result["ok"] = all(result["checks"].values())
    return result


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--pairs", type=int, default=8)
    a.add_argument("--seconds", type=float, default=600.0)
    a.add_argument("--rate", type=float, default=10_000.0, help="events per second per rank")
    a.add_argument("--inject-every", type=float, default=6.0, help="mean seconds between injections per rank")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--rss-limit-kb", type=int, default=2048)
    a.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"))
    a.add_argument("--json", default=None, help="also write the result here")
    a.add_argument("--keep", action="store_true", help="keep the work directory (logs, journals, reports)")
    args = a.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main())
