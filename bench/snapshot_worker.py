"""The rank processes of bench/snapshot.py (``python -m bench.snapshot --worker ROLE ...``, one
torch thread): the model-like state, the fixed step, and the four roles: ``steps`` (step time
with and without saves, the references, the file checkpoints), ``loop`` (trains and saves until
SIGKILLed), ``load`` (restore, torch.load, dcp.load after the kill) and ``peer`` (two ranks
copying their snapshots to each other)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

SEED = 26
MATRICES = 16
VECTOR = 1024


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

