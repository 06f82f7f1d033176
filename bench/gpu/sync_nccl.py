"""Device check: the cross-rank MAX of learned-timeout observations (ft_client.learning.sync) on an
NCCL group, world size 1: `TimeoutsCalc.synchronize_all` and the client's
`calculate_and_set_hb_timeouts` (beside a real `ft-monitor serve`) must all_reduce a float64
tensor on the CUDA device, and leave the values as they were (the MAX over one rank).
A "cpu:gloo,cuda:nccl" group must reduce on the CPU.

    PYTHONPATH=/tmp/site:$PWD python bench/gpu/sync_nccl.py

``FT_DEVCHECK_BACKEND=gloo`` runs it on CPU (a dry run where there is no GPU).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def main() -> int:
    import torch
    import torch.distributed as dist

    from ft_client import RankMonitorClient, SectionAction, TimeoutsCalc
    from ft_client.learning.sync import max_across_ranks
    from ft_monitor.testing import ServeProcess

    backend = os.environ.get("FT_DEVCHECK_BACKEND", "nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        say("no CUDA here (torch", torch.__version__, "); set FT_DEVCHECK_BACKEND=gloo for a CPU dry run")
        return 2
    want_dev = "cuda:0" if backend == "nccl" else "cpu"
    seen: list[dict[str, object]] = []
    real = dist.all_reduce

    def spy(tensor: torch.Tensor, *a: object, **k: object) -> object:
        seen.append({"device": str(tensor.device), "dtype": str(tensor.dtype), "n": tensor.numel()})
        return real(tensor, *a, **k)

    dist.all_reduce = spy  # ft_client.learning.sync calls dist.all_reduce through the module
    failures: list[str] = []

    def one_group(be: str, expect_device: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
        if be != "gloo":
            torch.cuda.set_device(0)
        dist.init_process_group(be, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            seen.clear()
            tc = TimeoutsCalc(sections=["step"], start_time=0.0)
            tc.update_on_heartbeat(hb_time=10.0)
            tc.update_on_heartbeat(hb_time=13.5)
            tc.update_on_section_event("step", SectionAction.OPEN, event_time=14.0)
            tc.update_on_section_event("step", SectionAction.CLOSE, event_time=16.25)
            before = (tc.initial_max_time, tc.subsequent_max_time, tc.section_to_max_time)
            tc.synchronize_all()
            after = (tc.initial_max_time, tc.subsequent_max_time, tc.section_to_max_time)
            values = max_across_ranks([1.5, -1.0, float("inf"), 2.0**60 + 1])
            row = {"backend": str(dist.get_backend()), "all_reduces": list(seen), "before": before, "after": after,
                   "max_across_ranks": values}
            say("SYNC", json.dumps(row, default=str))
            if before != after:
                failures.append(f"{be}: synchronize_all changed the values over one rank: {before} -> {after}")
            if values != [1.5, -1.0, float("inf"), float(2.0**60 + 1)]:
                failures.append(f"{be}: max_across_ranks over one rank gave {values}")
            if not seen or any(s["device"] != expect_device or s["dtype"] != "torch.float64" for s in seen):
                failures.append(f"{be}: all_reduce tensors {seen}, expected float64 on {expect_device}")
        finally:
            dist.destroy_process_group()
            del store

    info = {"torch": torch.__version__, "backend": backend}
    if backend == "nccl":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpu"] = torch.cuda.get_device_name(0)
    say("INFO", json.dumps(info))
    one_group(backend, want_dev)
    if backend == "nccl":
        one_group("cpu:gloo,cuda:nccl", "cpu")

    # the client's learning path, beside a real monitor, on the same kind of group
    work = Path(tempfile.mkdtemp(prefix="ftsync-"))
    d = ServeProcess(work / "m.sock", log_path=work / "m.log", env=os.environ, cwd=ROOT).wait_ready(30)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        client = RankMonitorClient(str(d.socket))
        client.init_workload_monitoring()
        for _ in range(3):
            client.send_heartbeat()
        seen.clear()
        learned = client.calculate_and_set_hb_timeouts()
        say("CLIENT", json.dumps({"learned": learned, "all_reduces": seen,
                                  "hb_timeouts": str(client.hb_timeouts)}, default=str))
        if not learned or not seen or any(s["device"] != want_dev or s["dtype"] != "torch.float64" for s in seen):
            failures.append(f"client: learned={learned}, all_reduce tensors {seen}, expected float64 on {want_dev}")
        client.shutdown_workload_monitoring()
        dist.destroy_process_group()
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        say("FAIL:", f)
    say("SUMMARY sync_nccl:", "PASS" if not failures else "FAIL")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
