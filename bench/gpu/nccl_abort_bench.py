"""Device check: where the ~0.9 s of an in-process restart's abort phase goes on NCCL (world size 1).

    PYTHONPATH=/tmp/site:$PWD python bench/gpu/nccl_abort_bench.py

Times, 3 times each, on one GPU: `init_process_group("nccl")` (eager with device_id, or lazy),
one all_reduce, then `distributed_c10d._abort_process_group()` (what ft_client's abort hook
calls) or `destroy_process_group()`; each in a fresh process per environment (default, and
TORCH_NCCL_ENABLE_MONITORING=0). Then the raw `ncclCommAbort` through CuPy's NCCL binding,
with no torch in the way. One JSON line per measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def torch_rounds(label: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")  # the CUDA context first: not counted in the init
    for rep in range(3):
        for mode in ("eager+abort", "lazy+abort", "eager+destroy"):
            store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
            kw = {"device_id": torch.device("cuda", 0)} if mode.startswith("eager") else {}
            t0 = time.perf_counter()
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, **kw)
            init = time.perf_counter() - t0
            x = torch.ones(1 << 20, device="cuda")
            t0 = time.perf_counter()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            ar = time.perf_counter() - t0
            t0 = time.perf_counter()
            if mode.endswith("abort"):
                distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
            end = time.perf_counter() - t0
            say("NCCL_END", json.dumps({"env": label, "rep": rep, "mode": mode, "init_s": round(init, 3),
                                        "first_all_reduce_s": round(ar, 4), "abort_or_destroy_s": round(end, 3)}))
            del store


def cupy_rounds() -> None:
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:  # noqa: BLE001
        say("CUPY_NCCL unavailable:", type(e).__name__, e)
        return
    cupy.cuda.Device(0).use()
    say("CUPY_NCCL version", nccl.get_version())
    for rep in range(3):
        uid = nccl.get_unique_id()
        t0 = time.perf_counter()
        comm = nccl.NcclCommunicator(1, uid, 0)
        init = time.perf_counter() - t0
        x = cupy.ones(1 << 20, dtype=cupy.float32)
        comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cupy.cuda.Stream.null.ptr)
        cupy.cuda.Stream.null.synchronize()
        t0 = time.perf_counter()
        if rep < 2:
            comm.abort()
            what = "ncclCommAbort"
        else:
            comm.destroy()
            what = "ncclCommDestroy"
        say("CUPY_NCCL", json.dumps({"rep": rep, "what": what, "init_s": round(init, 3),
                                     "end_s": round(time.perf_counter() - t0, 3)}))


def main(argv: list[str]) -> int:
    if argv[:1] == ["torch"]:
        torch_rounds(argv[1])
        return 0
    if argv[:1] == ["cupy"]:
        cupy_rounds()
        return 0
    import torch

    if not torch.cuda.is_available():
        say("no CUDA here: nothing to measure")
        return 2
    say("INFO", json.dumps({"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}))
    rc = 0
    for label, extra in (("default", {}), ("TORCH_NCCL_ENABLE_MONITORING=0", {"TORCH_NCCL_ENABLE_MONITORING": "0"})):
        p = subprocess.run([sys.executable, "-u", __file__, "torch", label], env={**os.environ, **extra},
                           capture_output=True, text=True, timeout=90)
        say(p.stdout.rstrip())
        if p.returncode:
            say(f"torch rounds ({label}) exited {p.returncode}:", p.stderr[-3000:])
            rc = 1
    p = subprocess.run([sys.executable, "-u", __file__, "cupy"], capture_output=True, text=True, timeout=60)
    say(p.stdout.rstrip())
    if p.returncode:
        say(f"cupy rounds exited {p.returncode}:", p.stderr[-3000:])
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
