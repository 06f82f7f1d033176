"""A torch.distributed (gloo) rank that learns its timeouts, for multi-process tests.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. FT_RANK_MONITOR_IPC_SOCKET=.. \
    python tests/workers/learn.py --state-out F [--state-in F] [--step-sleep S] [--hang-step K]

Steps end in a collective, as DDP steps do; step and checkpoint durations grow with
the rank, so ranks observe different values and must agree.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ft_client import RankMonitorClient


def hang_in_step() -> None:
    time.sleep(600)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state-in")
    p.add_argument("--state-out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--hang-step", type=int, default=-1)
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    client = RankMonitorClient()
    if args.state_in:
        with open(args.state_in) as f:
            client.load_state_dict(json.load(f))  # before init: pushed at the handshake
    client.init_workload_monitoring()
    print(f"in force {json.dumps(client.timeouts.to_wire(), sort_keys=True)}", flush=True)
    for i in range(args.steps):
        with client.section("step"):
            if i == args.hang_step:
                print("hanging", flush=True)
                hang_in_step()
            time.sleep(args.step_sleep * (rank + 1))
            dist.all_reduce(torch.ones(1))
        if i % 2 == 1:  # heartbeats every other step: the heartbeat timeout is the looser one
            client.send_heartbeat()
    if args.hang_step >= 0:  # the other ranks stop here without a collective
        client.shutdown_workload_monitoring()
        return
    with client.section("ckpt"):
        time.sleep(0.06 * (rank + 1))
    client.calculate_and_set_section_timeouts()
    client.calculate_and_set_hb_timeouts()
    with open(args.state_out, "w") as f:
        json.dump(client.state_dict(), f, sort_keys=True)
    print(f"learned {json.dumps(client.timeouts.to_wire(), sort_keys=True)}", flush=True)
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
