"""Device check: the in-process restart Wrapper (ft_client.inprocess) on NCCL, world size 1
(NCCL refuses two ranks on one GPU).

    PYTHONPATH=/tmp/site:$PWD python bench/gpu/inprocess_nccl.py [SCENARIO ...]

With no scenario it runs them all, each in a process of its own (bounded by a timeout),
and prints one PASS/FAIL line per scenario and a summary; exit status 0 when all passed.
Each scenario's process (``worker SCENARIO``) calls a Wrapper-wrapped function that does
``call.init_process_group("nccl")`` on the Wrapper's store, an all_reduce on cuda:0, and in
iteration 0 one fault:

  raise          an exception out of the function: restart in the same process
  hang           ping(), then a Python-side hang (time.sleep) with no ping: the Wrapper's
                 monitor thread sees the soft_timeout, runs the abort hook (NCCL
                 communicator aborted from that thread), interrupts the main thread
  hang_inflight  as hang, but with NCCL work still queued on the GPU (an all_reduce behind a
                 spin kernel that runs ~4 s past the abort) when the monitor thread aborts the
                 communicator
  monitored      a RankMonitorClient beside an `ft-monitor serve --ft-on-hang inprocess` daemon;
                 the rank hangs inside section `data` (timeout 3 s): the daemon's verdict
                 pushes ABORT, the client hands it to the Wrapper, which aborts and restarts

Iteration 1 must init NCCL again and all_reduce correctly, in the same pid. Timings printed:
NCCL init, first all_reduce, the abort hook and `_abort_process_group` (with the thread
they ran in), fault -> re-entered, fault -> first all_reduce of iteration 1.

``FT_DEVCHECK_BACKEND=gloo`` runs the same on CPU (a dry run of this script where there is
no GPU; hang_inflight is skipped there). Without CUDA and without that variable it says so
and exits 2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("raise", "hang", "monitored", "hang_inflight")
SOFT_TIMEOUT = 3.0
SPIN_LEFT = 4.0
"""hang_inflight: seconds the spin kernel (and the all_reduce queued behind it) still has to run when
the abort comes."""
SECTION_TIMEOUT = 3.0
WORKER_TIMEOUT = 60.0


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def free_port_pair() -> int:
    """A port with its successor free (the Wrapper's store is at MASTER_PORT + 1)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


# -- the rank --------------------------------------------------------------------------------
def worker(scenario: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from ft_client.inprocess import AbortTorchDistributed, CallWrapper, Wrapper

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    backend = os.environ.get("FT_DEVCHECK_BACKEND", "nccl")
    on_gpu = backend == "nccl"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    marks: dict[str, float] = {}
    events: list[dict[str, object]] = []

    # time the abort of the communicators, and note the thread that does it
    real_abort_pg = distributed_c10d._abort_process_group

    def timed_abort_pg(*a: object, **k: object) -> object:
        t0 = time.perf_counter()
        try:
            return real_abort_pg(*a, **k)
        finally:
            events.append({"what": "_abort_process_group", "thread": threading.current_thread().name,
                           "ms": round((time.perf_counter() - t0) * 1000, 2)})

    distributed_c10d._abort_process_group = timed_abort_pg

    class TimedAbort(AbortTorchDistributed):
        def __call__(self, call: object) -> None:
            t0 = time.perf_counter()
            init = dist.is_initialized()
            marks.setdefault("abort_start", time.time())
            try:
                super().__call__(call)  # type: ignore[arg-type]
            finally:
                events.append({"what": "abort hook", "thread": threading.current_thread().name,
                               "pg_initialized_before": init, "pg_initialized_after": dist.is_initialized(),
                               "ms": round((time.perf_counter() - t0) * 1000, 2)})

    client = None
    if scenario == "monitored":
        from ft_client import RankMonitorClient

        client = RankMonitorClient()  # $FT_RANK_MONITOR_IPC_SOCKET
        client.init_workload_monitoring()

    results: list[dict[str, object]] = []

    @Wrapper(soft_timeout=SOFT_TIMEOUT, hard_timeout=SOFT_TIMEOUT + 30, barrier_timeout=30, completion_timeout=30,
             monitor_thread_interval=0.05, max_iterations=3, abort=TimedAbort())
    def train(call: CallWrapper) -> list[dict[str, object]]:
        it = call.iteration
        entered = time.time()
        row: dict[str, object] = {"iteration": it, "pid": os.getpid(), "tasks": len(os.listdir("/proc/self/task")),
                                  "python_threads": threading.active_count()}
        if on_gpu:
            row["cuda_allocated_MiB_at_entry"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        t0 = time.perf_counter()
        kwargs: dict[str, object] = {"timeout": timedelta(seconds=120)}
        if on_gpu:
            kwargs["device_id"] = device  # eager NCCL communicator
        call.init_process_group(backend, **kwargs)
        row["init_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        row["backend"] = str(dist.get_backend())
        x = torch.full((1 << 20,), float(it + 1), device=device)  # 4 MiB
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if on_gpu:
            torch.cuda.synchronize()
        row["first_all_reduce_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        row["all_reduce_ok"] = bool(torch.all(x == float(it + 1)).item())  # world 1: the sum is itself
        if it > 0:
            row["abort_start_to_reentered_s"] = round(entered - marks.get("abort_start", entered), 3)
            fault = marks.get("fault")
            if fault is not None:
                row["fault_to_reentered_s"] = round(entered - fault, 3)
                row["fault_to_first_all_reduce_s"] = round(time.time() - fault, 3)
            if "abort_start" in marks:
                row["abort_start_after_fault_s"] = round(marks["abort_start"] - marks.get("fault", 0), 3)
        results.append(row)
        say("ITER", json.dumps(row))
        if client is not None:
            client.send_heartbeat()
        if it == 0:
            if scenario == "raise":
                marks["fault"] = time.time()
                raise ValueError("planted fault (devcheck)")
            if scenario in ("hang", "hang_inflight"):
                call.ping()
                if scenario == "hang_inflight":
                    # NCCL work left queued on the GPU when the abort comes (at ~SOFT_TIMEOUT): an
                    # all_reduce behind a spin kernel that outlasts it by ~SPIN_LEFT seconds
                    y = torch.ones(1 << 20, device=device)
                    torch.cuda._sleep(int((SOFT_TIMEOUT + SPIN_LEFT) * 1.98e9))  # cycles at up to 1.98 GHz
                    work = dist.all_reduce(y, async_op=True)
                    say("queued an all_reduce behind a spin kernel; completed now:", work.is_completed())
                marks["fault"] = time.time() + SOFT_TIMEOUT  # the soft_timeout's verdict, give or take a tick
                say("hanging (Python side, no ping)")
                time.sleep(3600)
            if scenario == "monitored":
                assert client is not None
                client.start_section("data")
                marks["fault"] = time.time() + SECTION_TIMEOUT  # the daemon's verdict, give or take its tick
                say("hanging inside section data")
                time.sleep(3600)
                client.end_section("data")
        if client is not None:
            client.start_section("step")
            client.end_section("step")
            client.send_heartbeat()
        dist.destroy_process_group()
        return results

    try:
        out = train()
    except BaseException as e:
        say(f"GAVE UP: {type(e).__name__}: {e}")
        for ev in events:
            say("EVENT", json.dumps(ev))
        return 3
    for ev in events:
        say("EVENT", json.dumps(ev))
    ok = (len(out) == 2 and [r["iteration"] for r in out] == [0, 1] and all(r["all_reduce_ok"] for r in out)
          and len({r["pid"] for r in out}) == 1 and any(e["what"] == "abort hook" for e in events))
    if on_gpu:  # the NCCL communicator was aborted by the hook (monitor thread for hangs)
        aborted = [e for e in events if e["what"] == "_abort_process_group"]
        ok = ok and bool(aborted)
        if scenario != "raise":
            ok = ok and any(e["thread"] == "ft-inprocess-monitor" for e in aborted)
    if client is not None:
        client.shutdown_workload_monitoring()
    say("RESULT", scenario, "PASS" if ok else "FAIL")
    return 0 if ok else 1


# -- the driver ------------------------------------------------------------------------------
def run_scenario(scenario: str, workdir: Path) -> tuple[bool, float, str]:
    from ft_monitor.testing import ServeProcess

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair()), "FT_KEY_DIR": str(workdir / "keys"),
           "PYTHONUNBUFFERED": "1"}
    daemon = None
    if scenario == "monitored":
        sock = workdir / f"{scenario}.sock"
        daemon = ServeProcess(sock, "--ft-on-hang", "inprocess", "--ft-rank-section-timeouts",
                              f"data:{SECTION_TIMEOUT:g}", "--ft-inprocess-restart-timeout", "30",
                              "--ft-stack-dump-timeout", "0", log_path=workdir / f"{scenario}-daemon.log",
                              env=os.environ, cwd=ROOT).wait_ready(30)
        env["FT_RANK_MONITOR_IPC_SOCKET"] = str(sock)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-u", __file__, "worker", scenario], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=WORKER_TIMEOUT)
        out, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")) + \
              ((e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        out += f"\nTIMED OUT after {WORKER_TIMEOUT:g} s"
        code = -999
    took = time.perf_counter() - t0
    if daemon is not None:
        daemon.stop()
        log = daemon.log()
        out += "\n--- daemon log ---\n" + log
        if code == 0 and "restarting in-process" not in log:
            out += "\nFAIL: the daemon log does not say it restarted in-process"
            code = 1
    return code == 0, took, out


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        return worker(argv[1])
    import tempfile

    import torch

    backend = os.environ.get("FT_DEVCHECK_BACKEND", "nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        say("no CUDA here (torch", torch.__version__, "); set FT_DEVCHECK_BACKEND=gloo for a CPU dry run")
        return 2
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "backend": backend}
    if backend == "nccl":
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["device"] = torch.cuda.get_device_name(0)
    say("INFO", json.dumps(info))
    scenarios = argv or [s for s in SCENARIOS if backend == "nccl" or s != "hang_inflight"]
    workdir = Path(tempfile.mkdtemp(prefix="ftdev-"))
    passed = []
    for s in scenarios:
        ok, took, out = run_scenario(s, workdir)
        say(f"===== scenario {s}: {'PASS' if ok else 'FAIL'} ({took:.1f} s) =====")
        say(out.rstrip())
        passed.append(ok)
    say("SUMMARY inprocess_nccl:", " ".join(f"{s}={'PASS' if ok else 'FAIL'}" for s, ok in zip(scenarios, passed)))
    shutil.rmtree(workdir, ignore_errors=True)  # the logs are in the output above
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
