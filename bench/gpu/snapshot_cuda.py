"""Device check: in-memory snapshots (ft_client.snapshot) of CUDA tensors, through the pinned
staging path, into real `ft-monitor serve` daemons.

    PYTHONPATH=/tmp/site:$PWD python bench/gpu/snapshot_cuda.py [--gib 1]

A. One rank, no process group, one daemon. A process builds a state on cuda:0 (a model, an
   Adam optimizer after one step, a ``--gib`` GiB float32 tensor, bf16 / int64 / float8 /
   non-contiguous tensors), saves it 3 times (timed: the call, then `wait()`), restores it
   in the same process (map_location cuda:0) and compares every tensor; then exits. A second
   process (the "restarted" rank) restores from the daemon's memory and compares with the
   expected state (rebuilt: the big tensor is a formula of its index, the rest came through
   a torch.save file). The raw device -> pinned host copy speed is measured beside it.
B. Two ranks on a gloo group, both on cuda:0, LOCAL_WORLD_SIZE=1 (two "nodes": each snapshot
   is copied to the partner's monitor), a daemon each. Both save steps 1 and 2 and exit.
   Rank 1's daemon is then replaced by a fresh one (its memory lost: a lost node); new
   processes restore collectively: rank 0 from its own monitor, rank 1 from the copy rank
   0's monitor kept; both must get step 2 and equal tensors.

``FT_DEVCHECK_DEVICE=cpu`` runs the same with CPU tensors (a dry run where there is no GPU).
Without CUDA and without that variable it says so and exits 2.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER_TIMEOUT = 180.0


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def dev() -> str:
    return os.environ.get("FT_DEVCHECK_DEVICE", "cuda:0")


def sync() -> None:
    import torch

    if dev().startswith("cuda"):
        torch.cuda.synchronize()


def big_tensor(n: int, rank: int) -> Any:
    """A float32 tensor whose values are a formula of the index (rebuilt exactly elsewhere)."""
    import torch

    return (torch.arange(n, device=dev(), dtype=torch.int64) % 9973).to(torch.float32) * 0.5 + rank


def build_state(gib: float, rank: int) -> dict[str, Any]:
    import torch
    from torch import nn

    torch.manual_seed(1234 + rank)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).to(dev())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device=dev())
    model(x).pow(2).mean().backward()
    opt.step()
    extra = {
        "bf16": torch.randn(333, 77, device=dev()).to(torch.bfloat16),
        "int64": torch.arange(1000, device=dev(), dtype=torch.int64) * 7 - 3,
        "f8": torch.randn(256, device=dev()).to(torch.float8_e4m3fn),
        "noncontig": torch.randn(64, 48, device=dev()).t(),
        "empty": torch.empty(0, 5, device=dev()),
        "scalar": torch.tensor(3.25, device=dev()),
    }
    n = int(gib * 2**30) // 4
    return {"model": model, "opt": opt, "big": big_tensor(n, rank), "extra": extra, "step": 0,
            "meta": ("tuple", 1, 2.5, None, b"bytes"), "ints": {7: "seven"}}


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a snapshot gives it back: state_dict()-able objects as their state."""
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


def compare(got: Any, want: Any, path: str = "state") -> list[str]:
    """Differences between ``got`` (restored) and ``want``: tensors by value (bitwise), dtype
    and shape; containers by keys and types."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: a {type(got).__name__}, not a tensor"]
        out = []
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return [f"{path}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"]
        if got.device != torch.device(dev()):  # restore(map_location=dev()) puts every tensor there
            out.append(f"{path}: on {got.device}, not {dev()}")
        if got.numel():  # bitwise: the bytes as uint8
            a = got.detach().contiguous().reshape(-1).view(torch.uint8)
            b = want.detach().to(got.device).contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(a, b):
                out.append(f"{path}: values differ")
        return out
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(map(str, got)) if isinstance(got, dict) else type(got)} != "
                    f"{sorted(map(str, want))}"]
        return [d for k in want for d in compare(got[k], want[k], f"{path}[{k!r}]")]
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return [f"{path}: {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'} != "
                    f"{type(want).__name__} of {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in compare(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def d2h_bandwidth(nbytes: int) -> dict[str, float]:
    """Raw device -> pinned host copy, GB/s (best of 3), and the pinned allocation's time."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev())
    t0 = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc = time.perf_counter() - t0
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        pinned.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - t0)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    sync()
    t0 = time.perf_counter()
    pageable.copy_(src)
    sync()
    page_s = time.perf_counter() - t0
    return {"pinned_alloc_s": round(alloc, 3), "d2h_pinned_GBps": round(nbytes / best / 1e9, 2),
            "d2h_pageable_GBps": round(nbytes / page_s / 1e9, 2)}


# -- A: one rank -------------------------------------------------------------------------------
def single_save(gib: float, expect_file: str) -> int:
    import torch

    from bench.snapshot_worker import tensors_of
    from ft_client.snapshot import Snapshotter

    s = Snapshotter()
    state = build_state(gib, 0)
    torch.save({"model": state["model"].state_dict(), "opt": state["opt"].state_dict(), "extra": state["extra"]},
               expect_file)
    nbytes = state["big"].numel() * 4
    say("INFO", json.dumps({"rank": 0, "state_GiB": round(sum(
        t.numel() * t.element_size() for t in tensors_of(plain(state))) / 2**30, 4), "big_GiB": nbytes / 2**30}))
    rows = []
    for step in (1, 2, 3):
        state["step"] = step
        sync()
        t0 = time.perf_counter()
        ok = s.save(step, state)
        call_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        s.wait()
        wait_s = time.perf_counter() - t1
        total = call_s + wait_s
        rows.append({"step": step, "saved": ok, "save_call_s": round(call_s, 3), "wait_s": round(wait_s, 3),
                     "total_s": round(total, 3), "GBps": round(nbytes / total / 1e9, 2)})
        say("SAVE", json.dumps(rows[-1]))
        if not ok or s._thread_error is not None:
            say("FAIL: save did not complete")
            return 1
    if dev().startswith("cuda"):
        say("D2H", json.dumps(d2h_bandwidth(nbytes)))
    t0 = time.perf_counter()
    got = s.restore(map_location=dev())
    restore_s = time.perf_counter() - t0
    if got is None:
        say("FAIL: restore in the same process returned None:", s.why_not)
        return 1
    step, restored = got
    diffs = compare(restored, plain(state))
    say("RESTORE_SAME_PROCESS", json.dumps({"step": step, "seconds": round(restore_s, 3),
                                            "GBps": round(nbytes / restore_s / 1e9, 2), "diffs": diffs[:10]}))
    # the restored state loads back into the model and optimizer, and training goes on
    state["model"].load_state_dict(restored["model"])
    state["opt"].load_state_dict(restored["opt"])
    state["model"](torch.randn(64, 1024, device=dev())).pow(2).mean().backward()
    state["opt"].step()
    sync()
    say("TRAINED_ON_AFTER_RESTORE ok")
    s.close()
    return 0 if step == 3 and not diffs else 1


def single_restore(gib: float, expect_file: str) -> int:
    import torch

    from ft_client.snapshot import Snapshotter

    s = Snapshotter()
    t0 = time.perf_counter()
    got = s.restore(map_location=dev())
    restore_s = time.perf_counter() - t0
    if got is None:
        say("FAIL: restore in a new process returned None:", s.why_not)
        return 1
    step, restored = got
    saved = torch.load(expect_file, map_location=dev(), weights_only=True)
    n = int(gib * 2**30) // 4
    want = {"model": saved["model"], "opt": saved["opt"], "big": big_tensor(n, 0), "extra": saved["extra"],
            "step": 3, "meta": ("tuple", 1, 2.5, None, b"bytes"), "ints": {7: "seven"}}
    diffs = compare(restored, want)
    say("RESTORE_NEW_PROCESS", json.dumps({"step": step, "pid": os.getpid(), "seconds": round(restore_s, 3),
                                           "last_restore": s.last_restore, "diffs": diffs[:10]}))
    return 0 if step == 3 and not diffs else 1


# -- B: two ranks, gloo, both on cuda:0 -------------------------------------------------------
PAIR_GIB = 1 / 16


def pair_save(expect_dir: str) -> int:
    import torch
    import torch.distributed as dist

    from ft_client import snapshot

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = build_state(PAIR_GIB, rank)
    torch.save({"model": state["model"].state_dict(), "opt": state["opt"].state_dict(), "extra": state["extra"]},
               f"{expect_dir}/expect{rank}.pt")
    for step in (1, 2):
        state["step"] = step
        sync()
        t0 = time.perf_counter()
        ok = snapshot.save(step, state)
        call_s = time.perf_counter() - t0
        snapshot.wait()
        err = snapshot.default()._thread_error
        say("PAIR_SAVE", json.dumps({"rank": rank, "step": step, "saved": ok, "save_call_s": round(call_s, 4),
                                     "total_s": round(time.perf_counter() - t0, 4), "error": repr(err)}))
        if not ok:
            return 1
    snapshot.wait()  # before destroy_process_group: the partner copy may still run
    dist.destroy_process_group()
    return 0


def pair_restore(expect_dir: str) -> int:
    import torch
    import torch.distributed as dist

    from ft_client import snapshot

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = snapshot.restore(map_location=dev())
    if got is None:
        say("FAIL: rank", rank, "restore returned None:", snapshot.default().why_not)
        dist.destroy_process_group()
        return 1
    step, restored = got
    saved = torch.load(f"{expect_dir}/expect{rank}.pt", map_location=dev(), weights_only=True)
    want = {"model": saved["model"], "opt": saved["opt"], "big": big_tensor(int(PAIR_GIB * 2**30) // 4, rank),
            "extra": saved["extra"], "step": 2, "meta": ("tuple", 1, 2.5, None, b"bytes"), "ints": {7: "seven"}}
    diffs = compare(restored, want)
    say("PAIR_RESTORE", json.dumps({"rank": rank, "step": step, "last_restore": snapshot.default().last_restore,
                                    "diffs": diffs[:10]}))
    dist.destroy_process_group()
    return 0 if step == 2 and not diffs else 1


# -- the driver --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(args: list[str], env: dict[str, str], what: str) -> subprocess.Popen[str]:
    say(f"--- start {what}")
    return subprocess.Popen([sys.executable, "-u", __file__, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen[str], what: str) -> bool:
    try:
        out, _ = p.communicate(timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        out += f"\nTIMED OUT after {WORKER_TIMEOUT:g} s"
    say(f"--- {what}: exit {p.returncode}")
    say(out.rstrip())
    return p.returncode == 0


def main(argv: list[str]) -> int:
    import torch

    from ft_monitor.testing import ServeProcess

    if argv and argv[0] in ("single-save", "single-restore"):
        fn = single_save if argv[0] == "single-save" else single_restore
        return fn(float(argv[1]), argv[2])
    if argv[:1] == ["pair-save"]:
        return pair_save(argv[1])
    if argv[:1] == ["pair-restore"]:
        return pair_restore(argv[1])
    gib = float(argv[argv.index("--gib") + 1]) if "--gib" in argv else 1.0
    if dev().startswith("cuda") and not torch.cuda.is_available():
        say("no CUDA here (torch", torch.__version__, "); set FT_DEVCHECK_DEVICE=cpu for a CPU dry run")
        return 2
    info = {"torch": torch.__version__, "device": dev()}
    if dev().startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    say("INFO", json.dumps(info))
    work = Path(tempfile.mkdtemp(prefix="ftsnap-"))
    base = {**os.environ, "TORCHELASTIC_RUN_ID": "devcheck-job", "PYTHONUNBUFFERED": "1"}
    results: dict[str, bool] = {}

    # A
    d = ServeProcess(work / "a.sock", log_path=work / "a.log", env=base, cwd=ROOT).wait_ready(30)
    try:
        env = {**base, "FT_RANK_MONITOR_IPC_SOCKET": str(d.socket), "RANK": "0", "WORLD_SIZE": "1"}
        expect = str(work / "expect.pt")
        results["A_save_and_same_process_restore"] = finish(run(["single-save", str(gib), expect], env, "A save"),
                                                            "A save")
        results["A_restore_in_new_process"] = finish(run(["single-restore", str(gib), expect], env, "A restore"),
                                                     "A restore")
    finally:
        d.stop()
        say("--- daemon A log (tail) ---\n" + "\n".join(d.log().splitlines()[-15:]))

    # B
    port = free_port()
    daemons = [ServeProcess(work / f"b{r}.sock", log_path=work / f"b{r}.log", env=base, cwd=ROOT).wait_ready(30)
               for r in (0, 1)]
    try:
        def rank_env(r: int) -> dict[str, str]:
            return {**base, "FT_RANK_MONITOR_IPC_SOCKET": str(daemons[r].socket), "RANK": str(r),
                    "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)}

        ps = [run(["pair-save", str(work)], rank_env(r), f"B save rank {r}") for r in (0, 1)]
        results["B_two_ranks_save_with_peer_copy"] = all([finish(p, f"B save rank {r}") for r, p in enumerate(ps)])
        # rank 1's node is lost: its monitor (and the memory) goes, a fresh one comes
        daemons[1].stop()
        daemons[1] = ServeProcess(work / "b1new.sock", log_path=work / "b1new.log", env=base,
                                  cwd=ROOT).wait_ready(30)
        port = free_port()
        ps = [run(["pair-restore", str(work)], rank_env(r), f"B restore rank {r}") for r in (0, 1)]
        results["B_restore_rank1_from_partner_copy"] = all([finish(p, f"B restore rank {r}")
                                                            for r, p in enumerate(ps)])
    finally:
        for dd in daemons:
            dd.stop()
    say("SUMMARY snapshot_cuda:", " ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in results.items()))
    shutil.rmtree(work, ignore_errors=True)  # the logs are in the output above
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
