#!/usr/bin/env python3
"""In-memory snapshots of FSDP2-sharded state against torch.distributed.checkpoint, on CPU.

    bench/fsdp2_snapshot.py [--quick | --smoke] [--sizes 100MB,1GB] [--reps N] [--out FILE.json]

Two rank processes (gloo, one "node": no peer copy) train an MLP sharded with FSDP2's
``fully_shard`` (each Linear of [1024, 1024] and the root) with Adam, one step taken so that
Adam's moments exist: the state is the parameters and both moments, all DTensors, each rank
holding half (SIZE is the whole job's state, both ranks together). Each rank has its own real
`ft-monitor serve` daemon. Per repetition, in an order rotated every repetition, both ranks
time (after a barrier; a sample is the slower rank's time):

- ``fsdp2snap.SIZE.save``: ``snapshot.save(step, {"model": model, "opt": opt})`` then
  ``snapshot.wait()``: the shards copied into the monitor's memory, the layout, the XXH3-64
  checksum and the header (the background finish included);
- ``fsdp2snap.SIZE.save_call``: ``save()`` alone, what the training thread waits for;
- ``fsdp2snap.SIZE.restore``: ``snapshot.restore(like={"model": model, "opt": opt})``, a
  collective: the monitor's memory mapped, each buffer checked (checksum), the ranks' agreement,
  the shards copied out and made DTensors on the model's mesh (no ``load_state_dict``);
- ``fsdp2snap.SIZE.dcp_save``: ``dcp.save`` of ``get_state_dict(model, opt)`` to a new local
  directory (FileSystemWriter's defaults: a file per rank, fsync'd, plus the metadata);
- ``fsdp2snap.SIZE.dcp_load``: ``dcp.load`` of that directory into a state dict of the same
  DTensors, in place (no ``set_state_dict``); its files are in the page cache (warm: dropping it
  needs root).

Each repetition checks once that what came back equals what was saved. Printed as bench/run.py's
markdown table; JSON like bench/snapshot.py's (default bench/results/fsdp2_snapshot-<mode>-<time>.json).
Not registered in bench/run.py (its `BENCHMARKS` would take
``"fsdp2_snapshot": (False, lambda mode, loop: fsdp2_snapshot.run(mode, loop))``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

from bench.harness import Daemon, Figure, Mode, Worker, cleanup, private_dir, resolve_loop  # noqa: E402

HIDDEN = 1024
ROWS = ("save", "save_call", "restore", "dcp_save", "dcp_load")
WHAT = {
    "save": "snapshot.save + wait of the FSDP2 state (slower rank)",
    "save_call": "snapshot.save call alone (the training thread's part)",
    "restore": "snapshot.restore(like=model, opt) as DTensors (collective)",
    "dcp_save": "dcp.save of get_state_dict to a local directory",
    "dcp_load": "dcp.load of that directory in place (page cache warm)",
}


def plan(mode: Mode, sizes: list[int] | None = None, reps: int | None = None) -> dict[str, Any]:
    return {"sizes": sizes or mode.pick([10**8, 10**9], [10**8], [4 * 10**6]),
            "reps": reps or mode.pick(7, 5, 1), "hidden": mode.pick(HIDDEN, HIDDEN, 256)}


def _layers(nbytes: int, hidden: int) -> int:
    """Linear layers of [hidden, hidden] (+ bias) whose parameters and two Adam moments make ``nbytes``."""
    return max(1, round(nbytes / (3 * 4 * hidden * (hidden + 1))))


def size_label(n: int) -> str:
    return f"{n / 1e9:g}GB" if n >= 10**9 else f"{n / 1e6:g}MB"


def run(mode: Mode, loop: str = "auto", sizes: list[int] | None = None, reps: int | None = None) -> list[Figure]:
    p = plan(mode, sizes, reps)
    figures: list[Figure] = []
    for n in p["sizes"]:
        figures += _one_size(n, p, resolve_loop(loop))
    return figures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _one_size(n: int, p: dict[str, Any], loop: str) -> list[Figure]:
    d = private_dir()
    files = Path(os.environ.get("TMPDIR", "/tmp")) / f"ftb-fsdp2-dcp-{os.getpid()}"
    files.mkdir(exist_ok=True)
    layers = _layers(n, p["hidden"])
    load = [round(os.getloadavg()[0], 2)]
    try:
        mons = [Daemon(d, loop, name=f"r{r}.sock").wait_ready() for r in range(2)]
        try:
            port = _free_port()
            workers = [Worker("bench.fsdp2_snapshot", [
                "--socket", str(mons[r].socket), "--layers", str(layers), "--hidden", str(p["hidden"]),
                "--reps", str(p["reps"]), "--dir", str(files)],
                env={"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                     "TORCHELASTIC_RUN_ID": f"bench-fsdp2-{os.getpid()}"}) for r in range(2)]
            try:
                got = [w.recv(timeout=1800) for w in workers]
            finally:
                for w in workers:
                    w.finish()
        finally:
            for m in mons:
                m.stop()
    finally:
        cleanup(d)
        shutil.rmtree(files, ignore_errors=True)
    load.append(round(os.getloadavg()[0], 2))
    label = size_label(n)
    state_bytes = sum(g["state_bytes"] for g in got)
    out = []
    for row in ROWS:
        slower = [1000 * max(a, b) for a, b in zip(got[0][row], got[1][row])]
        out.append(Figure(id=f"fsdp2snap.{label}.{row}", what=f"{WHAT[row]}, {label}", unit="ms", samples=slower,
                          details={"how": "one sample per repetition: the slower of the 2 ranks",
                                   "state_bytes": state_bytes, "layers": layers, "hidden": p["hidden"],
                                   "per_rank": [g[row] for g in got], "loadavg_1min": load}))
    median = {f.id.rsplit(".", 1)[1]: statistics.median(f.samples) for f in out}
    for row, (mine, theirs) in {"save_vs_dcp": ("save", "dcp_save"), "restore_vs_dcp": ("restore", "dcp_load")}.items():
        out.append(Figure(id=f"fsdp2snap.{label}.{row}", what=f"{WHAT[theirs].split(' of')[0]} / snapshot {mine}, "
                          f"{label} (medians)", unit="x", value=round(median[theirs] / median[mine], 2), judge="value",
                          details={"how": "the ratio of the two medians above"}))
    return out


# -- the rank process -----------------------------------------------------------------------------
def worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--reps", type=int, required=True)
    p.add_argument("--dir", required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ft_client.snapshot import Snapshotter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, args.hidden)).sum().backward()
    opt.step()
    state = {"model": model, "opt": opt}
    local = [t.to_local() for t in [*model.state_dict().values(),
                                    *(v for s in opt.state_dict()["state"].values() for v in s.values())]
             if isinstance(t, DTensor)]
    state_bytes = sum(t.numel() * t.element_size() for t in local)
    snap = Snapshotter(socket_path=args.socket, log_line=lambda line: print(line, file=sys.stderr))
    times: dict[str, list[float]] = {row: [] for row in ROWS}

    def timed(row: str, fn: Any) -> Any:
        dist.barrier()
        t0 = time.perf_counter()
        got = fn()
        times[row].append(time.perf_counter() - t0)
        return got

    def save() -> None:
        t0 = time.perf_counter()
        if not snap.save(step, state):
            raise RuntimeError("the monitor refused the snapshot")
        times["save_call"].append(time.perf_counter() - t0)
        snap.wait()

    def dcp_save() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)

    def dcp_load() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        target = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}, "optim": osd}
        dcp.load(target, checkpoint_id=where)
        return target

    for step in range(1, args.reps + 1):
        where = Path(args.dir) / f"step-{step}"
        first_snapshot = step % 2 == 1
        for row in (("save", "dcp_save") if first_snapshot else ("dcp_save", "save")):
            timed(row, save if row == "save" else dcp_save)
        for row in (("restore", "dcp_load") if first_snapshot else ("dcp_load", "restore")):
            if row == "restore":
                got = timed(row, lambda: snap.restore(like=state))
                assert got is not None and got[0] == step, got
                _same(model.state_dict(), got[1]["model"])
                _same(opt.state_dict()["state"], got[1]["opt"]["state"])
            else:
                target = timed(row, dcp_load)
                _same(get_state_dict(model, opt)[0], target["model"])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where, ignore_errors=True)
    snap.close()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "state_bytes": state_bytes, **times}), flush=True)


def _same(a: Any, b: Any) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        assert isinstance(b, DTensor) and a.placements == b.placements and a.shape == b.shape
        assert bool((a.to_local() == b.to_local()).all())
    elif isinstance(a, dict):
        assert list(a) == list(b), (list(a), list(b))
        for k in a:
            _same(a[k], b[k])


# -- standalone -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from bench.report import machine_info, write_standalone

    p = argparse.ArgumentParser(prog="bench/fsdp2_snapshot.py", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="100 MB, 5 repetitions")
    size.add_argument("--smoke", action="store_true", help="4 MB, one repetition (figures meaningless)")
    p.add_argument("--sizes", default=None, help="comma-separated job state sizes in MB, e.g. 100,1000")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default per mode: 7, 5, 1)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/fsdp2_snapshot-<mode>-<time>.json)")
    args = p.parse_args(argv)
    mode = Mode("smoke" if args.smoke else "quick" if args.quick else "full")
    sizes = [int(float(s) * 10**6) for s in args.sizes.split(",")] if args.sizes else None
    loop = resolve_loop("auto")
    started = time.time()
    t0 = time.monotonic()
    machine = machine_info([loop])
    figures = run(mode, loop, sizes, args.reps)
    write_standalone("fsdp2_snapshot", mode.name, loop, started, t0, machine, figures, plan(mode, sizes, args.reps),
                     args.out)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main())
