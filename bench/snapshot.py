#!/usr/bin/env python3
"""In-memory snapshots (issue 26): what `ft_client.snapshot` costs a training loop, and what
it saves after a `kill -9`, side by side with file checkpoints, on CPU.

    bench/snapshot.py [--quick | --smoke] [--sizes 100MB,1GB] [--out FILE.json]

Full: states of 100 MB and 1 GB (~7 min); --quick: 100 MB, fewer repetitions (< 1 min);
--smoke: 1 MB, one of each (tests/test_bench.py; its figures mean nothing). Prints the
markdown table of bench/run.py and writes the same JSON (default
bench/results/snapshot-<mode>-<time>.json). bench/run.py runs it as `snapshot` (its
--quick variant in the full set, its --smoke variant with --smoke).

The state: a model-like dict of float32 tensors and an Adam-like optimizer state, filled
with seeded uniform noise. 16 weight matrices of [1024, n] and 16 vectors of 1024 (layer
norms), one `exp_avg` and one `exp_avg_sq` per parameter and a 0-d `step` tensor, the
param groups' plain values; the model is a third of the bytes, the optimizer two thirds:
128 tensors (32 parameters, 96 optimizer tensors), totals exact to within a column of 1024 floats. Every
monitor is a real `ft-monitor serve` daemon started as its own process (one per state
size; one per rank for the peer row); every rank a real process (`--worker`), one torch
thread (OMP_NUM_THREADS=1: on a GPU node the step runs on the GPU, and the snapshot's
background thread (layout, the XXH3-64 checksum, header, peer copy) has the other core here).

Rows, per state size:

1. **Step time** (`snap.SIZE.step.*`, `.added.*`): the step is fixed CPU work, WORK_MATMULS
   matmuls of two fixed [1024, 1024] float32 matrices (~110 ms on the machine this was
   written on). Blocks of BLOCK steps, three modes rotated every repetition: no save; save
   every 10 steps (after the 1st and 11th step of a block, so the background finish
   overlaps the next steps as in a long run); save after every step. A block's time runs
   from its first step to a final `wait()` (so the last save's background finish counts
   too); samples are per-block mean step times. Added per step = median over repetitions
   of (mode block - no-save block of the same repetition); per save = that x the interval.
   Noise = median |difference| between consecutive no-save blocks. `save` first waits for
   the previous save's background finish: the loop's view includes that wait. References
   in the same process: `copy_` of the same tensors into preallocated (touched) tensors,
   the same copy into a mapped memfd (what `save` writes to), the snapshot's checksum of the
   bytes (`ft_client.snapshot.format.checksum`, XXH3-64: what the background finish does),
   zlib.crc32 of the same bytes (the checksum before dd63034, for the before/after), and
   `save()` alone and `save()` + `wait()` (quiet).
2. **Restore after kill -9** (`snap.SIZE.restore`, `.torch_load`, `.dcp_load`): each
   incident of row 4 ends with a SIGKILL of the training process; a new process then
   times `Snapshotter.restore()` (maps the monitor's memory, checks each complete buffer's
   checksum once, copies the tensors out), `torch.load(weights_only=True)` of the same state
   saved with `torch.save` to a file under /tmp on local disk (written by row 1's
   process; in the page cache: warm, dropping it needs root), and
   `torch.distributed.checkpoint.load` (no process group) of the same state saved with
   `dcp.save`, into a preallocated, touched state. Order rotated per incident. Restore
   and torch.load return new tensors; none of the three includes `load_state_dict`.
3. **Peer transfer** (`snap.SIZE.peer.*`): two rank processes (gloo, world 2,
   LOCAL_WORLD_SIZE=1: each its own "node"), each with its own monitor; time from
   `save()` to `wait()` returning with the peer copy on (each rank sends its snapshot to
   the other over the side gloo group, both directions at once, loopback TCP) and off,
   alternated; transfer = median of the paired differences (the slower rank's time).
4. **Lost steps per incident** (`snap.SIZE.lost.kK`): a training process (the step of
   row 1) saves every K steps (K = 1, 10) and prints each finished step before saving
   it; the harness SIGKILLs it at a random point in a random step between 2K+1 and 3K+1
   (past two saves); lost = steps finished at the kill - the step `restore()` returns.
   Target <= K.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
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

from bench.harness import (  # noqa: E402
    Daemon,
    Figure,
    Mode,
    Worker,
    cleanup,
    private_dir,
    resolve_loop,
)
from bench.report import machine_info, write_standalone  # noqa: E402
from bench.snapshot_figures import incident_figures, peer_figures, step_figures  # noqa: E402
from bench.snapshot_worker import SEED, worker  # noqa: E402

WORK_MATMULS = 5
WORK_N = 1024
SAVE_EVERY = (1, 10)


# -- sizes --------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    t = text.strip().upper()
    for suffix, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def size_label(n: int) -> str:
    return f"{n // 10**9}GB" if n >= 10**9 and n % 10**9 == 0 else f"{n // 10**6}MB" if n % 10**6 == 0 else f"{n}B"


def plan(mode: Mode, sizes: list[int] | None = None) -> list[dict[str, Any]]:
    """What each size runs: (block reps, block length, incidents per K, peer reps, work)."""
    if sizes is None:
        sizes = mode.pick([100 * 10**6, 10**9], [100 * 10**6], [10**6])
    out = []
    for n in sizes:
        big = n >= 500 * 10**6
        out.append({
            "bytes": n,
            "reps": mode.pick(3 if big else 5, 2, 1),
            "block": mode.pick(20, 10, 10),
            "incidents": mode.pick(3 if big else 5, 1, 1),
            "ks": mode.pick(SAVE_EVERY, SAVE_EVERY, (1,)),
            "peer_reps": mode.pick(3 if big else 5, 2, 1),
            "work": mode.pick([WORK_MATMULS, WORK_N], [WORK_MATMULS, WORK_N], [1, 64]),
        })
    return out


# -- the harness side (no torch here) -------------------------------------------------------------
ROWS = ("steps", "kill", "peer")


def run(mode: Mode, loop: str, sizes: list[int] | None = None, rows: tuple[str, ...] = ROWS) -> list[Figure]:
    figures: list[Figure] = []
    for p in plan(mode, sizes):
        figures += _one_size(p, loop, rows)
    return figures


def _monitor(d: Path, loop: str, name: str) -> Daemon:
    """A real `ft-monitor serve` (its snapshot memory limit, 16 GiB by default, holds every row)."""
    daemon = Daemon(d, loop, name=name).wait_ready()
    from ft_client.errors import MemorySnapshotError
    from ft_client.snapshot import open_pair

    try:
        open_pair(str(daemon.socket), "own", 0, 0)
    except MemorySnapshotError as e:
        daemon.stop()
        raise RuntimeError(f"`ft-monitor serve` keeps no snapshots here: {e}") from e
    return daemon


def _one_size(p: dict[str, Any], loop: str, rows: tuple[str, ...]) -> list[Figure]:
    n, label = p["bytes"], size_label(p["bytes"])
    d = private_dir()
    files = Path(os.environ.get("TMPDIR", "/tmp")) / f"ftb-snapshot-files-{os.getpid()}"
    files.mkdir(exist_ok=True)
    common = ["--bytes", str(n), "--work", *map(str, p["work"])]
    out: list[Figure] = []
    load_start = _loadavg()
    try:
        mon = _monitor(d, loop, "mon.sock")
        try:
            sock = ["--socket", str(mon.socket)]
            if "steps" in rows or "kill" in rows:  # the kill row loads the files the steps' process writes
                w = Worker("bench.snapshot", ["steps", *sock, *common, "--reps", str(p["reps"]),
                                              "--block", str(p["block"]), "--files", str(files)],
                           env={"OMP_NUM_THREADS": "1"})
                try:
                    steps = w.recv(timeout=900)
                finally:
                    w.finish()
                if "steps" in rows:
                    out += step_figures(label, steps, p)
            incidents = _incidents(p, sock, common, files) if "kill" in rows else []
        finally:
            mon.stop()
        if incidents:
            out += incident_figures(label, incidents, p)
        if "peer" in rows:
            out += peer_figures(label, _peer(p, d, loop, common), p)
        for f in out:  # a busy neighbour on a shared machine shows here
            f.details["loadavg_1min"] = [load_start, _loadavg()]
    finally:
        cleanup(d)
        cleanup(files)
    return out


def _incidents(p: dict[str, Any], sock: list[str], common: list[str], files: Path) -> list[dict[str, Any]]:
    rnd = random.Random(SEED + p["bytes"])
    orders = [("restore", "torch_load", "dcp_load"), ("torch_load", "dcp_load", "restore"),
              ("dcp_load", "restore", "torch_load")]
    got = []
    i = 0
    for _ in range(p["incidents"]):
        for k in p["ks"]:
            job = f"incident{i}"
            w = Worker("bench.snapshot", ["loop", *sock, *common, "--every", str(k), "--job", job],
                       env={"OMP_NUM_THREADS": "1"})
            kill_after = rnd.randint(2 * k + 1, 3 * k)  # finished steps before the step the kill falls in
            fraction = rnd.random()
            try:
                first = w.recv(timeout=300)
                assert first.get("ready"), first
                done, durations, last_t = 0, [], time.monotonic()
                assert w.proc.stdout is not None
                while done < kill_after:  # a line a step (blocking: the worker prints or dies)
                    line = w.proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"incident {i}: the training process exited ({w.proc.wait(5)})")
                    done = json.loads(line)["done"]
                    now = time.monotonic()
                    durations.append(now - last_t)
                    last_t = now
                time.sleep(fraction * statistics.median(durations))
                os.kill(w.pid, 9)
                w.proc.wait(30)
                for line in w.proc.stdout:  # steps it finished before the signal landed
                    done = max(done, json.loads(line)["done"])
            finally:
                w.finish()
            assert w.proc.returncode == -9, w.proc.returncode
            order = orders[i % len(orders)]
            loader = Worker("bench.snapshot", ["load", *sock, *common, "--job", job, "--files", str(files),
                                               "--order", ",".join(order)], env={"OMP_NUM_THREADS": "1"})
            try:
                r = loader.recv(timeout=600)
            finally:
                loader.finish()
            if r.get("restored_step") is None:
                raise RuntimeError(f"incident {i}: nothing restored: {r}")
            got.append({**r, "k": k, "killed_after": done, "lost": done - r["restored_step"],
                        "kill_in_step": kill_after + 1, "kill_fraction": round(fraction, 3), "order": order})
            i += 1
    return got


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _peer(p: dict[str, Any], d: Path, loop: str, common: list[str]) -> list[dict[str, Any]]:
    mons = [_monitor(d, loop, f"peer{r}.sock") for r in range(2)]
    try:
        port = _free_port()
        workers = [Worker("bench.snapshot", ["peer", "--socket", str(mons[r].socket), *common, "--rank", str(r),
                                             "--reps", str(p["peer_reps"])],
                          env={"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                               "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
                   for r in range(2)]
        try:
            return [w.recv(timeout=900) for w in workers]
        finally:
            for w in workers:
                w.finish()
    finally:
        for m in mons:
            m.stop()


# -- standalone -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/snapshot.py", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="100 MB, fewer repetitions: under a minute")
    size.add_argument("--smoke", action="store_true", help="1 MB, one of each (tests only; figures meaningless)")
    p.add_argument("--sizes", default=None, help="comma-separated state sizes, e.g. 100MB,1GB (default per mode)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of: {', '.join(ROWS)} "
                   "(kill: restore after kill -9 and lost steps)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/snapshot-<mode>-<time>.json)")
    args = p.parse_args(argv)
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    if set(rows) - set(ROWS):
        p.error(f"unknown row(s) {', '.join(sorted(set(rows) - set(ROWS)))}; choose from {', '.join(ROWS)}")
    mode = Mode("smoke" if args.smoke else "quick" if args.quick else "full")
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
    loop = resolve_loop("auto")
    started = time.time()
    t0 = time.monotonic()
    machine = machine_info([loop])
    figures = run(mode, loop, sizes, rows)
    write_standalone("snapshot", mode.name, loop, started, t0, machine, figures, plan(mode, sizes), args.out)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main())
