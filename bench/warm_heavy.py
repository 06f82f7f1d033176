"""A module that is slow to import: ``BENCH_HEAVY_IMPORT_S`` seconds (default 5) of CPU at
import, as a large code base's imports are (unmarshalling and running module code, not
waiting). Imported by bench/warm_train.py --heavy for bench/restart.py's heavy warm-restart
row: a cold restart pays it in every new worker, a warm one (``--ft-preload auto``) once, in
the worker template, before the restart.

The burn is measured in this process's CPU time, so a busy machine stretches it in wall
time as it would a real import."""

from __future__ import annotations

import os
import time

SECONDS = float(os.environ.get("BENCH_HEAVY_IMPORT_S", "5"))


def _burn(seconds: float) -> int:
    end = time.process_time() + seconds
    n = 0
    while time.process_time() < end:
        n = (n * 1103515245 + 12345) & 0xFFFFFFFF
        for _ in range(1000):
            n ^= n >> 3
    return n


IMPORT_BURN = _burn(SECONDS)
