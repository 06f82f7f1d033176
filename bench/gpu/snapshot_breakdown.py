"""Device check: where a snapshot save of 1 GiB of CUDA tensors spends its time, and what a
direct device -> monitor-memory copy would give.

    PYTHONPATH=/tmp/site:$PWD python bench/gpu/snapshot_breakdown.py [--gib 1]

Beside a real `ft-monitor serve`: 4 saves of a 1 GiB float32 CUDA tensor through
`Snapshotter.save` (the call, then `wait()`; the XXH3 checksum timed apart by wrapping
`ft_client.snapshot.format.body_checksum`). Then on a memfd of the same size, mapped as the client maps
the monitor's buffers: the pinned staging -> mapping copy (what the writer thread does; first
touch and again), and the mapping registered with cudaHostRegister so that the device copies
into it directly (one DMA, no staging).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def main(argv: list[str]) -> int:
    import torch

    from ft_client.snapshot import Snapshotter
    from ft_client.snapshot import format as fmt
    from ft_monitor.testing import ServeProcess

    if not torch.cuda.is_available():
        say("no CUDA here: nothing to measure")
        return 2
    gib = float(argv[argv.index("--gib") + 1]) if "--gib" in argv else 1.0
    nbytes = int(gib * 2**30)
    src = torch.arange(nbytes // 4, device="cuda", dtype=torch.float32)
    work = Path(tempfile.mkdtemp(prefix="ftsb-"))
    d = ServeProcess(work / "m.sock", log_path=work / "m.log", env={**os.environ, "TORCHELASTIC_RUN_ID": "sb"},
                     cwd=ROOT).wait_ready(30)
    checks: list[float] = []
    real = fmt.body_checksum

    def timed(*a: object, **k: object) -> int:
        t0 = time.perf_counter()
        try:
            return real(*a, **k)  # type: ignore[arg-type]
        finally:
            checks.append(time.perf_counter() - t0)

    fmt.body_checksum = timed
    try:
        s = Snapshotter(socket_path=str(d.socket), job="sb", rank=0)
        for step in range(1, 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.save(step, {"t": src})
            call = time.perf_counter() - t0
            t1 = time.perf_counter()
            s.wait()
            wait = time.perf_counter() - t1
            say("SAVE_BREAKDOWN", json.dumps({"step": step, "buffer": (step - 1) % 2, "call_s": round(call, 3),
                                              "wait_s": round(wait, 3), "checksum_s": round(checks[-1], 3),
                                              "rest_of_wait_s": round(wait - checks[-1], 3),
                                              "GBps": round(nbytes / (call + wait) / 1e9, 2)}))
        s.close()
    finally:
        fmt.body_checksum = real
        d.stop()
        shutil.rmtree(work, ignore_errors=True)

    # the pieces, on a memfd mapping like the monitor's
    fd = os.memfd_create("ftsb", 0)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    view = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    staged = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    staged.copy_(src.view(torch.uint8), non_blocking=True)
    torch.cuda.synchronize()
    for what in ("pinned->mapping (first touch)", "pinned->mapping (again)"):
        t0 = time.perf_counter()
        view.copy_(staged)
        dt = time.perf_counter() - t0
        say("COPY", json.dumps({"what": what, "s": round(dt, 3), "GBps": round(nbytes / dt / 1e9, 2),
                                "torch_threads": torch.get_num_threads()}))
    t0 = time.perf_counter()
    xx = fmt.checksum(memoryview(mm))
    dt = time.perf_counter() - t0
    say("CHECKSUM", json.dumps({"s": round(dt, 3), "GBps": round(nbytes / dt / 1e9, 2), "value": xx}))
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(view.data_ptr(), nbytes, 0)
    reg = time.perf_counter() - t0
    say("REGISTER", json.dumps({"error": int(err) if not isinstance(err, int) else err, "s": round(reg, 3),
                                "is_pinned": bool(view.is_pinned())}))
    try:
        for i in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            view.copy_(src.view(torch.uint8), non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            say("DIRECT_D2H", json.dumps({"rep": i, "s": round(dt, 3), "GBps": round(nbytes / dt / 1e9, 2)}))
        same = torch.equal(view.view(torch.float32).to("cuda"), src)
        say("DIRECT_D2H_EQUAL", same)
    finally:
        cudart.cudaHostUnregister(view.data_ptr())
    del view
    try:
        mm.close()
    except BufferError:  # a tensor still views it: the mapping goes with the process
        pass
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
