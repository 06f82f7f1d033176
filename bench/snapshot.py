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
from bench.report import machine_info, markdown_table  # noqa: E402

SEED = 26
MATRICES = 16
VECTOR = 1024
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
                    out += _step_figures(label, steps, p)
            incidents = _incidents(p, sock, common, files) if "kill" in rows else []
        finally:
            mon.stop()
        if incidents:
            out += _incident_figures(label, incidents, p)
        if "peer" in rows:
            out += _peer_figures(label, _peer(p, d, loop, common), p)
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


# -- figures --------------------------------------------------------------------------------------
def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _step_figures(label: str, r: dict[str, Any], p: dict[str, Any]) -> list[Figure]:
    pre = f"snap.{label}"
    blocks = r["blocks"]  # mode -> [per-rep block mean step time, ms]
    how = (f"{p['reps']} repetition(s) x 3 modes rotated, blocks of {p['block']} steps; a step = "
           f"{r['work'][0]} matmuls of [{r['work'][1]}]^2 float32, 1 torch thread; block time includes a final "
           f"wait(); sample = block mean step time")
    none = blocks["none"]
    noise_d = [abs(a - b) for a, b in zip(none[1:], none[:-1])]
    noise = _med(noise_d)
    copy = _med(r["copy_ms"])
    out = [
        Figure(id=f"{pre}.step.none", what=f"{label}: step, no save", unit="ms", samples=none,
               details={"how": how, "per_step_median_ms": r["per_step_median"]["none"], "state": r["state"]}),
    ]
    for m, k in (("every10", 10), ("every1", 1)):
        diffs = [a - b for a, b in zip(blocks[m], none)]
        added = _med(diffs)
        f_step = Figure(id=f"{pre}.step.{m}", what=f"{label}: step, save every {k} step{'s' if k > 1 else ''}",
                        unit="ms", samples=blocks[m],
                        details={"how": how, "per_step_median_ms": r["per_step_median"][m],
                                 "save_call_ms": summarize_ms(r["save_calls"][m])})
        if m == "every10":
            f_add = Figure(id=f"{pre}.added.{m}", what=f"{label}: added per step, save every 10 steps (x10 = per "
                           f"save: {_num(None if added is None else added * 10)} ms)", unit="ms", samples=diffs,
                           target="within noise",
                           met=None if added is None or noise is None else abs(added) <= noise,
                           details={"how": "per repetition: block mean (every 10) - block mean (no save)",
                                    "per_save_ms": None if added is None else added * 10, "noise_ms": noise})
        else:
            f_add = Figure(id=f"{pre}.added.{m}", what=f"{label}: added per step = per save, save every step",
                           unit="ms", samples=diffs, target=f"<= copy ({_num(copy)} ms)", limit=copy,
                           details={"how": "per repetition: block mean (every step) - block mean (no save)",
                                    "ratio_to_copy": None if added is None or not copy else added / copy})
        out += [f_step, f_add]
    out += [
        Figure(id=f"{pre}.noise", what=f"{label}: noise (|consecutive no-save blocks|)", unit="ms", samples=noise_d),
        Figure(id=f"{pre}.copy", what=f"{label}: copy_ of the same tensors into preallocated tensors", unit="ms",
               samples=r["copy_ms"], details={"how": "median of repeated copies, destination touched beforehand"}),
        Figure(id=f"{pre}.copy_memfd", what=f"{label}: the same copy into a mapped memfd (what save writes to)",
               unit="ms", samples=r["copy_memfd_ms"]),
        Figure(id=f"{pre}.checksum", what=f"{label}: the snapshot's checksum (XXH3-64) of the same bytes (the "
               "background finish's work)", unit="ms", samples=r["checksum_ms"],
               details={"how": "ft_client.snapshot.format.checksum over the memfd of the copy row, 1 thread"}),
        Figure(id=f"{pre}.crc32", what=f"{label}: zlib.crc32 of the same bytes (the old checksum, before dd63034)",
               unit="ms", samples=r["crc_ms"]),
        Figure(id=f"{pre}.save_call", what=f"{label}: save() alone, quiet (tensors copied, finish started)",
               unit="ms", samples=r["save_ms"]),
        Figure(id=f"{pre}.save_wait", what=f"{label}: save() + wait(), quiet (complete in the monitor's memory)",
               unit="ms", samples=r["save_wait_ms"]),
    ]
    files = r.get("files") or {}
    for key, what in (("torch_save_ms", "torch.save of the same state to a local file (no fsync), once"),
                      ("dcp_save_ms", "torch.distributed.checkpoint.save of it (no group), once")):
        if key in files:
            out.append(Figure(id=f"{pre}.{key.removesuffix('_ms')}", what=f"{label}: {what}", unit="ms",
                              samples=[files[key]], details={"how": "for comparison: the file checkpoint's write, "
                                                             "blocking, into the page cache"}))
    return out


def summarize_ms(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": _med(xs), "max": max(xs) if xs else None}


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _incident_figures(label: str, incs: list[dict[str, Any]], p: dict[str, Any]) -> list[Figure]:
    pre = f"snap.{label}"
    col = {m: [x["times_ms"][m] for x in incs] for m in ("restore", "torch_load", "dcp_load")}
    how = (f"{len(incs)} incident(s): a training process SIGKILLed, then a new process times each (order rotated); "
           "files written once by row 1's process, in the page cache (warm)")
    med = {m: _med(v) for m, v in col.items()}
    out = [
        Figure(id=f"{pre}.restore", what=f"{label}: restore() after kill -9, new process", unit="ms",
               samples=col["restore"], details={"how": how, "equal_to_file": [x["equal"] for x in incs],
                                                "complete_buffers": [x["complete_buffers"] for x in incs]}),
        Figure(id=f"{pre}.torch_load", what=f"{label}: torch.load of the same state (file, page cache)", unit="ms",
               samples=col["torch_load"], details={"how": how}),
        Figure(id=f"{pre}.dcp_load", what=f"{label}: torch.distributed.checkpoint.load (in place, no group)",
               unit="ms", samples=col["dcp_load"], details={"how": how}),
    ]
    for m in ("torch_load", "dcp_load"):
        a, b = med[m], med["restore"]
        ratio = a / b if a and b else None
        out.append(Figure(id=f"{pre}.restore_vs_{m}", what=f"{label}: {m} median / restore median", unit="x",
                          value=None if ratio is None else round(ratio, 2)))
    out.append(Figure(id=f"{pre}.restored_equal", what=f"{label}: restored state equal to the file's", unit="",
                      value=f"{sum(x['equal'] for x in incs)}/{len(incs)}", target="all",
                      met=bool(incs) and all(x["equal"] for x in incs)))
    for k in p["ks"]:
        lost = [float(x["lost"]) for x in incs if x["k"] == k]
        out.append(Figure(id=f"{pre}.lost.k{k}", what=f"{label}: lost steps per kill -9, save every {k}",
                          unit="steps", samples=lost, target=f"max <= {k}", limit=k, judge="max",
                          details={"incidents": [{key: x[key] for key in ("killed_after", "restored_step", "lost",
                                                                           "kill_in_step", "kill_fraction")}
                                                 for x in incs if x["k"] == k]}))
    return out


def _peer_figures(label: str, ranks: list[dict[str, Any]], p: dict[str, Any]) -> list[Figure]:
    pre = f"snap.{label}"
    local = [max(a, b) for a, b in zip(ranks[0]["local_ms"], ranks[1]["local_ms"])]
    peer = [max(a, b) for a, b in zip(ranks[0]["peer_ms"], ranks[1]["peer_ms"])]
    diffs = [a - b for a, b in zip(peer, local)]
    transfer = _med(diffs)
    nbytes = ranks[0]["snapshot_bytes"]
    rate = nbytes / (transfer / 1000) / 1e9 if transfer else None
    how = (f"2 rank processes, gloo world 2, LOCAL_WORLD_SIZE=1, each its own monitor; {p['peer_reps']} "
           "repetition(s), peer on/off alternated; sample = the slower rank's save()->wait()")
    errors = ranks[0]["errors"] + ranks[1]["errors"]
    return [
        Figure(id=f"{pre}.peer.local", what=f"{label}: save() -> wait(), local only (2 ranks)", unit="ms",
               samples=local, details={"how": how}),
        Figure(id=f"{pre}.peer.with_copy", what=f"{label}: save() -> wait(), with the peer copy", unit="ms",
               samples=peer, details={"how": how, "errors": errors,
                                      "partner_copy_steps": [r["peer_steps"] for r in ranks]}),
        Figure(id=f"{pre}.peer.transfer", what=f"{label}: peer transfer (with copy - local), both ways at once "
               f"over loopback gloo: {'-' if rate is None else f'{rate:.2f}'} GB/s each way", unit="ms",
               samples=diffs, met=None if not errors and all(r["peer_ok"] for r in ranks) else False,
               details={"how": how + "; paired differences", "snapshot_bytes": nbytes, "gb_per_s_each_way": rate}),
    ]


# -- the worker side (torch) ------------------------------------------------------------------------
def make_state(nbytes: int, seed: int = SEED, empty: bool = False) -> dict[str, Any]:
    """The model-like state of ``nbytes`` (float32: a third parameters, two thirds Adam moments)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    floats = nbytes // 4
    params = floats // 3
    vec_total = MATRICES * VECTOR
    cols = max(1, (params - vec_total) // (MATRICES * VECTOR))
    shapes: list[tuple[int, ...]] = []
    for _ in range(MATRICES):
        shapes += [(VECTOR, cols), (VECTOR,)]

    def t(shape: tuple[int, ...]) -> Any:
        x = torch.empty(shape)
        return x.zero_() if empty else x.uniform_(-1, 1, generator=g)

    model = {f"layers.{i // 2}.{'weight' if i % 2 == 0 else 'norm'}": t(s) for i, s in enumerate(shapes)}
    opt_state = {i: {"step": torch.tensor(100.0), "exp_avg": t(s), "exp_avg_sq": t(s)} for i, s in enumerate(shapes)}
    opt = {"state": opt_state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                 "weight_decay": 0.0, "amsgrad": False,
                                                 "params": list(range(len(shapes)))}]}
    return {"model": model, "opt": opt, "step": 0}


def tensors_of(tree: Any) -> list[Any]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


class Work:
    """The fixed CPU work of one training step."""

    def __init__(self, matmuls: int, n: int) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(n, n, generator=g) / n**0.5
        self.b = torch.randn(n, n, generator=g) / n**0.5
        self.matmuls = matmuls

    def step(self) -> None:
        x = self.a
        for _ in range(self.matmuls):
            x = x @ self.b


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def worker(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    from bench.harness import say
    from ft_client.snapshot import Snapshotter

    a = argparse.ArgumentParser()
    a.add_argument("role", choices=("steps", "loop", "load", "peer"))
    a.add_argument("--socket", required=True)
    a.add_argument("--bytes", type=int, required=True)
    a.add_argument("--work", type=int, nargs=2, required=True)
    a.add_argument("--reps", type=int, default=1)
    a.add_argument("--block", type=int, default=10)
    a.add_argument("--files", default=None)
    a.add_argument("--every", type=int, default=1)
    a.add_argument("--job", default="bench")
    a.add_argument("--order", default="restore,torch_load,dcp_load")
    a.add_argument("--rank", type=int, default=0)
    args = a.parse_args(argv)
    errors: list[str] = []
    snap = Snapshotter(socket_path=args.socket, job=args.job, rank=args.rank, log_line=errors.append)

    if args.role == "steps":
        say(_worker_steps(args, snap, errors))
    elif args.role == "loop":
        state = make_state(args.bytes)
        work = Work(*args.work)
        work.step()
        say({"ready": True})
        done = 0
        while True:  # until the harness kills it
            work.step()
            done += 1
            state["step"] = done
            say({"done": done})
            if done % args.every == 0:
                if not snap.save(done, state):
                    raise SystemExit(f"save refused: {errors}")
    elif args.role == "load":
        say(_worker_load(args, snap, errors))
    else:
        say(_worker_peer(args, snap, errors))


def _worker_steps(args: argparse.Namespace, snap: Any, errors: list[str]) -> dict[str, Any]:
    import mmap
    import zlib

    import torch

    from ft_client.snapshot import format as fmt

    state = make_state(args.bytes)
    ts = tensors_of(state)
    total = sum(t.numel() * t.element_size() for t in ts)
    work = Work(*args.work)
    for _ in range(2):
        work.step()
    # references, in this process: copy, copy into a memfd, the checksum (and the old one), a save alone
    dst = [torch.empty_like(t).zero_() for t in ts]
    copy_ms = []
    for _ in range(5):
        t0 = time.perf_counter()
        for s, d in zip(ts, dst):
            d.copy_(s)
        copy_ms.append(_ms(t0))
    del dst
    fd = os.memfd_create("bench-copy", os.MFD_CLOEXEC)
    os.ftruncate(fd, total)
    mm = mmap.mmap(fd, total)
    views, off = [], 0
    for t in ts:
        nb = t.numel() * t.element_size()
        views.append(torch.frombuffer(mm, dtype=torch.uint8, count=nb, offset=off).view(t.dtype).view(t.shape))
        off += nb
    memfd_ms = []
    for i in range(6):
        t0 = time.perf_counter()
        for s, d in zip(ts, views):
            d.copy_(s)
        if i:  # the first copy also allocates the memfd's pages
            memfd_ms.append(_ms(t0))
    checksum_ms, crc_ms = [], []
    for _ in range(3):  # alternated: the snapshot's checksum (what the background finish runs), then the old one
        body = memoryview(mm)
        t0 = time.perf_counter()
        fmt.checksum(body)
        checksum_ms.append(_ms(t0))
        t0 = time.perf_counter()
        zlib.crc32(body)
        crc_ms.append(_ms(t0))
        body.release()
    del views
    mm.close()
    os.close(fd)
    save_ms, save_wait_ms = [], []
    for i in range(4):
        t0 = time.perf_counter()
        if not snap.save(i, state):
            raise SystemExit(f"save refused: {errors}")
        t1 = time.perf_counter()
        snap.wait()
        if i:  # the first save also allocates (and first touches) the monitor's memory
            save_ms.append((t1 - t0) * 1000)
            save_wait_ms.append(_ms(t0))
    # the loop
    modes = {"none": 0, "every10": 10, "every1": 1}
    order = list(modes)
    blocks: dict[str, list[float]] = {m: [] for m in modes}
    per_step: dict[str, list[float]] = {m: [] for m in modes}
    save_calls: dict[str, list[float]] = {m: [] for m in modes}
    done = 100
    for rep in range(args.reps):
        for m in order[rep % 3:] + order[:rep % 3]:
            k = modes[m]
            b0 = time.perf_counter()
            for i in range(args.block):
                t0 = time.perf_counter()
                work.step()
                done += 1
                if k and i % k == 0:
                    state["step"] = done
                    s0 = time.perf_counter()
                    snap.save(done, state)
                    save_calls[m].append(_ms(s0))
                per_step[m].append(_ms(t0))
            snap.wait()
            blocks[m].append(_ms(b0) / args.block)
    files: dict[str, Any] = {}
    if args.files:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        t0 = time.perf_counter()
        torch.save(state, os.path.join(args.files, "state.pt"))
        files["torch_save_ms"] = _ms(t0)
        t0 = time.perf_counter()
        dcp_save(state, checkpoint_id=os.path.join(args.files, "dcp"))
        files["dcp_save_ms"] = _ms(t0)
    return {"blocks": blocks, "per_step_median": {m: statistics.median(v) for m, v in per_step.items()},
            "save_calls": save_calls, "copy_ms": copy_ms, "copy_memfd_ms": memfd_ms,
            "checksum_ms": checksum_ms, "crc_ms": crc_ms,
            "save_ms": save_ms, "save_wait_ms": save_wait_ms, "work": args.work, "errors": errors, "files": files,
            "state": {"bytes": total, "tensors": len(ts)}}


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _worker_load(args: argparse.Namespace, snap: Any, errors: list[str]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from ft_client.snapshot import format as fmt

    assert args.files
    into = make_state(args.bytes, empty=True)  # a resumed job's model and optimizer exist already
    times, got = {}, {}
    for what in args.order.split(","):
        t0 = time.perf_counter()
        if what == "restore":
            got[what] = snap.restore()
        elif what == "torch_load":
            got[what] = torch.load(os.path.join(args.files, "state.pt"), weights_only=True)
        else:
            dcp_load(into, checkpoint_id=os.path.join(args.files, "dcp"))
            got[what] = into
        times[what] = _ms(t0)
    restored = got["restore"]
    complete = 0
    if snap.memory.own is not None:
        complete = sum(1 for b in snap.memory.own.buffers if (h := b.header()) is not None and h.state == fmt.COMPLETE
                       and h.job == args.job)
    if restored is None:
        return {"restored_step": None, "errors": errors, "times_ms": times}
    step, state = restored
    file_state = got["torch_load"]
    equal = _equal({k: v for k, v in state.items() if k != "step"},
                   {k: v for k, v in file_state.items() if k != "step"}) and _equal(tensors_of(into),
                                                                                    tensors_of(file_state))
    return {"restored_step": step, "state_step": state["step"], "times_ms": times, "equal": equal,
            "complete_buffers": complete, "errors": errors}


def _worker_peer(args: argparse.Namespace, snap: Any, errors: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from ft_client.snapshot import format as fmt

    dist.init_process_group("gloo")
    state = make_state(args.bytes, seed=SEED + args.rank)
    snap.peer_every = 1
    times: dict[str, list[float]] = {"local": [], "peer": []}
    peer_steps, peer_ok = [], True
    step = 0
    for rep in range(args.reps + 1):  # the first round allocates the memory (own and peer): not timed
        order = ("local", "peer") if rep % 2 == 0 else ("peer", "local")
        for m in order:
            snap.peer_enabled = m == "peer"
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            snap.save(step, state)
            snap.wait()
            if rep:
                times[m].append(_ms(t0))
            if m == "peer":
                held = sorted(h.step for b in (snap.memory.peer.buffers if snap.memory.peer else [])
                              if (h := b.header()) is not None and h.state == fmt.COMPLETE)
                peer_steps.append(held)
                peer_ok = peer_ok and step in held
    dist.barrier()
    own = snap.memory.own.newest(job=args.job) if snap.memory.own else None
    dist.destroy_process_group()
    return {"local_ms": times["local"], "peer_ms": times["peer"], "errors": errors, "peer_steps": peer_steps,
            "peer_ok": peer_ok, "snapshot_bytes": None if own is None else own[1].end}


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
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    table = markdown_table(figures)
    print(table)
    result = {"schema": 1, "mode": mode.name, "loop": loop, "loops": [loop],
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "duration_s": round(time.monotonic() - t0, 2), "benchmark_seconds": {"snapshot": round(
                  time.monotonic() - t0, 2)}, "machine": machine, "figures": [f.to_json() for f in figures],
              "table": table, "plan": plan(mode, sizes)}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / \
        f"snapshot-{mode.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nbench: {len(figures)} figures in {result['duration_s']:.0f} s; JSON written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main())
