"""The rendezvous of a restart on torch's own c10d handler, with and without torch's random
first-run delay (ft_monitor.launcher.rdzv.rdzv_delay), alternated run by run.

One node, as the demo (`--standalone`): a fresh TCPStore and handler per run, a first
rendezvous (the job's start), then the timed one (the restart's), either as torch does it
(its cached state is still round 0, so it sleeps a random 0-0.3 s first) or inside
`no_first_run_delay` (what ft-launcher does since the warm-restart bench found the delay).

    bench/run.py --only rdzv_restart          # 40 runs of each
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

from bench.harness import Figure, Mode
from ft_monitor.launcher.rdzv.rdzv_delay import no_first_run_delay


def _one(skip_delay: bool, i: int) -> float:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30),
                     use_libuv=True)
    run_id = f"bench-{i}"
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{store.port}", run_id=run_id,
                                  min_nodes=1, max_nodes=1, join_timeout=30)
    handler = create_handler(store, C10dRendezvousBackend(store, run_id), params)
    try:
        handler.next_rendezvous()  # the job's start
        with no_first_run_delay() if skip_delay else contextlib.nullcontext(False):
            t0 = time.perf_counter()
            handler.next_rendezvous()  # the restart's
            return time.perf_counter() - t0
    finally:
        handler.shutdown()
        del store


def run(mode: Mode) -> list[Figure]:
    runs = mode.pick(40, 15, 2)
    samples: dict[bool, list[float]] = {False: [], True: []}
    for i in range(runs):
        for skip in (False, True):
            samples[skip].append(_one(skip, 2 * i + skip) * 1000)
    details: dict[str, Any] = {"runs": runs, "nodes": 1}
    return [
        Figure("rdzv.torch", "a restart's rendezvous, torch's c10d handler as it is (1 node)", "ms",
               samples[False], details=details),
        Figure("rdzv.ft", "a restart's rendezvous without the first-run delay (ft-launcher)", "ms",
               samples[True], details=details),
    ]
