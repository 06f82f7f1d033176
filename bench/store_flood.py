#!/usr/bin/env python3
"""What a flood of idle and half-open connections to the rendezvous store's port costs (issue 49).

Two measurements, each printed as one table and written as JSON (``--json``):

* the store itself: torch's TCPStore server (libuv, and the legacy one), a client's set+get on an
  established connection and a new client's connection, with N idle connections open to the port
  (every other one sent one byte of a request and left there: half-open);
* a real job: ft-launcher with 2 ranks of examples/train_ddp.py on a c10d rendezvous at a known
  port, rank 1 hung at step 20; once the ranks train, N connections are opened to that port and
  held until the job ends. The summary's restart row (its rendezvous, first step and total) and
  the time lost to hangs, with and without the flood.

    bench/store_flood.py --connections 1000            # both, about 3 minutes
    bench/store_flood.py --connections 1000 --store-only

Not in bench/run.py (a real job per figure). docs/reliability.md, "A connection flood to the
store port", has the figures and what bounds the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def flood(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to ``port``, every other one left with one byte of a request."""
    socks = []
    for i in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        if i % 2:
            time.sleep(0.001)
            try:
                s.send(b"\x01")
            except OSError:
                pass
        socks.append(s)
    return socks


def store_costs(counts: list[int], libuv: bool) -> list[dict[str, Any]]:
    """A set+get (ms each, mean of 10 of each) and a new client (ms) with each count of connections open."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=300)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout, use_libuv=libuv)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
    held: list[socket.socket] = []
    rows = []
    try:
        for n in counts:
            held += flood(server.port, n - len(held))
            time.sleep(1.0)
            t0 = time.perf_counter()
            for _ in range(10):
                client.set("k", "v")
                client.get("k")
            op_ms = (time.perf_counter() - t0) / 20 * 1000
            t0 = time.perf_counter()
            fresh = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
            fresh.set("x", "y")
            new_ms = (time.perf_counter() - t0) * 1000
            del fresh
            rows.append({"server": "libuv" if libuv else "legacy", "connections": n, "op_ms": round(op_ms, 2),
                         "new_client_ms": round(new_ms, 1)})
            print(f"  {rows[-1]['server']:6} {n:5} connections: set/get {op_ms:8.2f} ms, new client "
                  f"{new_ms:9.1f} ms", flush=True)
    finally:
        for s in held:
            s.close()
    return rows


def job(n: int, work: Path) -> dict[str, Any]:
    """A 2-rank ft-launcher job with a hang, ``n`` connections held on its store port once it trains."""
    port = _free_port()
    work.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ft_monitor.launcher.main", "--nnodes", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "flood", "--nproc-per-node", "2",
            "--max-restarts", "2", "--log-dir", str(work / "logs"), "--ft-summary-json", str(work / "summary.json"),
            "--ft-cfg-path", str(ROOT / "examples" / "ft.yaml"), "--ft-termination-grace-time", "2",
            str(ROOT / "examples" / "train_ddp.py"), "--ckpt-dir", str(work / "ckpt"), "--steps", "40",
            "--hang", "rank=1,step=20,attempt=0"]
    out_path = work / "out.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 300
    while out_path.read_text().count("timeouts in force") < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the job did not start training:\n{out_path.read_text()[-3000:]}")
        time.sleep(0.2)
    held = flood(port, n)
    try:
        code = proc.wait(600)
    finally:
        for s in held:
            s.close()
    summary = json.loads((work / "summary.json").read_text())
    lost = [line for line in out_path.read_text().splitlines() if "lost to hangs" in line]
    row = {"connections": n, "exit_code": code, "restart": summary["restarts"][0] if summary["restarts"] else None,
           "goodput_line": lost[-1].strip() if lost else None}
    r = row["restart"] or {}
    print(f"  job, {n:5} connections: exit {code}, rendezvous {r.get('rendezvous')} s, first_step "
          f"{r.get('first_step')} s, total {r.get('total')} s; {row['goodput_line']}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=1000, help="connections opened to the port (default 1000)")
    p.add_argument("--store-only", action="store_true", help="only the store's own costs, no job")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args()
    counts = sorted({0, 40, 60, 100, args.connections})
    print("the store (torch's TCPStore server):", flush=True)
    figures: dict[str, Any] = {"store": store_costs(counts, True) + store_costs([0, 100], False), "jobs": []}
    if not args.store_only:
        print("a real 2-rank job with a hang, rendezvous c10d on that port:", flush=True)
        with tempfile.TemporaryDirectory(prefix="ft-flood-") as tmp:
            for n in (0, args.connections):
                figures["jobs"].append(job(n, Path(tmp) / f"n{n}"))
    figures["load"] = os.getloadavg()
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
