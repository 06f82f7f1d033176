"""A hostile client of an in-process Wrapper job's store (torch's TCPStore has no authentication).

Usage: inprocess_forger.py PORT PREFIX ATTACK

Connects to 127.0.0.1:PORT as any process that reaches the port could (it holds no key
of the job), writes the review's attack under PREFIX (the job's key space,
``ft_inprocess/<run id>/<attempt>/``), then prints "done". The tests run it as
another user (uid 65534) where they can:

* ``outcomes``: ``forged`` as the outcome of iterations 0..9 (every rank restarted on it
  until max_iterations was used up, then exited 1 with RestartLimitError);
* ``done``: ``{"done": true}`` as iteration 0's outcome, before the job's real fault (a
  rank returned as if training had completed while its peer died at the barrier);
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    port, prefix, attack = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    if attack == "outcomes":
        for i in range(10):
            store.set(f"{prefix}iter/{i}/outcome", b"forged")
    elif attack == "done":
        store.set(f"{prefix}iter/0/outcome", b'{"done": true}')
    else:
        raise SystemExit(f"unknown attack {attack}")
    print("done", flush=True)


if __name__ == "__main__":
    main()
