#!/usr/bin/env python3
"""examples/train_ddp.py, optionally after a slow import, for bench/restart.py's warm rows.

    warm_train.py [--heavy] TRAIN_DDP_ARGS...

``--heavy`` imports `bench.warm_heavy` first (``BENCH_HEAVY_IMPORT_S`` seconds of CPU at
import, default 5), as a training script imports a large code base at its top; the rest of
the arguments are train_ddp.py's. `bench` is found through PYTHONPATH (the repository root,
as bench/ sets it), as an installed package would be, so that a worker template started by
``ft-launcher --ft-warm-restart --ft-preload auto`` can import it too.
"""

from __future__ import annotations

import sys
from pathlib import Path

if "--heavy" in sys.argv[1:]:
    sys.argv.remove("--heavy")
    import bench.warm_heavy  # noqa: F401 - imported for its cost

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_ddp  # noqa: E402

if __name__ == "__main__":
    train_ddp.main()
