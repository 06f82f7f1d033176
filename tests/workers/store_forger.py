"""A hostile client of a job's rendezvous store (torch's TCPStore has no authentication).

Usage: store_forger.py PORT RUN_ID ROUNDS

Connects to 127.0.0.1:PORT as any process that reaches the port could, and writes,
for rendezvous rounds 0..ROUNDS-1, the launcher messages an unauthenticated
ft-launcher acted on: a plain workload shutdown, and malformed and forged hang
records for every node (a non-ASCII mac and 16 KiB of ``[`` at round 0's keys), listed on
the round's hang board (its index and counter: store_board.py) so that the launchers read
them (an unlisted value is never read).
Prints "done" once it has written everything. The tests run it as another user (uid
65534) where they can.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    port, run_id, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    forged_hangs = [  # round 0 (the hang's): node 1 reads node 0's key, and the other way round
        json.dumps({"mac": "\u00e9"}),  # hmac.compare_digest(str, str) raised TypeError: both launchers exited 2
        "[" * (16 * 1024),  # RecursionError in json.loads, the same way
        json.dumps({"rank": 0, "onset_time": "forged", "message": "m", "host": "h"}),  # broke min() before
        json.dumps({"v": 1, "kind": "hang", "key": "ft_launcher/hang/0", "run": run_id, "mac": "0" * 64,
                    "body": {"rank": 0, "onset_time": 0.0, "message": "forged", "host": "evil"}}),
        "\xff not json",
    ]
    for r in range(rounds):
        prefix = f"torch.rendezvous.{run_id}.{r}/"
        store.set(prefix + "ft_launcher/shutdown",
                  json.dumps({"reason": "forged by another user", "rank": 0, "host": "evil"}))
        for node in range(2):
            store.set(prefix + f"ft_launcher/hang/{node}", forged_hangs[(r + node) % len(forged_hangs)])
            store.append(prefix + "ft_launcher/hang_index", f"{node},")
            store.add(prefix + "ft_launcher/hang_count", 1)
    print("done", flush=True)


if __name__ == "__main__":
    main()
