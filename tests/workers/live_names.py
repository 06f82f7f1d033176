"""A torch.distributed (gloo) rank for the live view's tmux test (tests/test_live_view_tmux.py),
started by ft-launcher: rank 0 steps (a "step" section around an all_reduce), rank 1 keeps a
section open whose name holds escape sequences and a line break (put in force with a timeout
first, so that its monitor times it and shows it), all_reducing with rank 0, until FILE exists.

    ft-launcher --nproc-per-node 2 ... tests/workers/live_names.py --stop-file FILE [--ckpt-dir D]
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

from ft_client import RankMonitorClient

EVIL = "evil\x1b[2J\x1b]0;pwned\x07\r\n9 999 active FORGED"
"""Would clear the terminal, retitle it and forge a row, if printed as is."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-file", required=True)
    p.add_argument("--ckpt-dir", default=None)  # ft-launcher tests pass one; nothing is saved
    args = p.parse_args()
    import torch  # here: the test imports EVIL from this module without torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    client = RankMonitorClient()
    client.init_workload_monitoring()
    t = client.timeouts
    client.set_timeouts(t.with_updates(rank_section_timeouts={**t.rank_section_timeouts, EVIL: 600.0}))
    if rank == 1:
        client.start_section(EVIL)
    print(f"[rank {rank}] live_names: stepping", flush=True)
    step = 0
    while True:
        stop = torch.tensor([1.0 if os.path.exists(args.stop_file) else 0.0])
        if rank == 0:
            with client.section("step"):
                dist.all_reduce(stop)
                time.sleep(0.02)
        else:
            dist.all_reduce(stop)
        client.send_heartbeat()
        step += 1
        if stop.item() > 0:
            break
        time.sleep(0.05)
    if rank == 1:
        client.end_section(EVIL)
    print(f"[rank {rank}] live_names: stopped after {step} steps", flush=True)
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
