"""One of 4 gloo ranks taking the element-wise MAX of its observations (tests/test_sync.py).

    python tests/workers/sync_rank.py RANK WORLD INIT     # prints the result as JSON
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.simplefilter("ignore")  # torch's import-time warnings

import torch.distributed as dist  # noqa: E402

from ft_client.learning.sync import max_across_ranks  # noqa: E402

rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
try:
    # each rank has different values; -1.0 (missing) everywhere in the last slot;
    # the middle slot is real on rank 2 only
    mine = [float(rank), 10.0 - rank, 5.5 if rank == 2 else -1.0, -1.0, 1e-9 * rank + 1e6]
    print(json.dumps(max_across_ranks(mine)))
finally:
    dist.destroy_process_group()
