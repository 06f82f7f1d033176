#!/bin/bash
# The second device call: what the first one (run.sh) left open. Logs under $OUT.
#   1. the whole tests/test_template.py with CUDA torch (pytest-benchmark, installed there, turns
#      xdist's warning into an error under filterwarnings=error: -p no:benchmark)
#   2. hang_inflight again, the abort now coming while the all_reduce is still queued on the GPU
#   3. the NCCL abort's time: torch's _abort_process_group / destroy vs raw ncclCommAbort
#   4. a 1 GiB snapshot save's breakdown, and a direct device -> monitor-memory copy
DEFAULT_BUDGET=200
source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/env.txt"

step pytest_template_all 90 "$OUT/pytest_template_all.log" $PY -m pytest -p no:cacheprovider -p no:benchmark \
  -n 4 -q -rA tests/test_template.py
step hang_inflight 60 "$OUT/hang_inflight.log" $PY bench/gpu/inprocess_nccl.py hang_inflight
step nccl_abort_bench 60 "$OUT/nccl_abort_bench.log" $PY bench/gpu/nccl_abort_bench.py
step snapshot_breakdown 60 "$OUT/snapshot_breakdown.log" $PY bench/gpu/snapshot_breakdown.py --gib 1

echo "===== summary (total $(( SECONDS - start )) s) ====="
cat "$OUT/summary.txt"
grep -hE "^(SUMMARY|RESULT|INFO|ITER|EVENT|NCCL_END|CUPY_NCCL|SAVE_BREAKDOWN|COPY|CHECKSUM|REGISTER|DIRECT|FAIL|GAVE|queued|=====)|passed|failed|PASSED|FAILED|Error|rounds" \
  "$OUT/pytest_template_all.log" "$OUT/hang_inflight.log" "$OUT/nccl_abort_bench.log" "$OUT/snapshot_breakdown.log" \
  2>/dev/null | cut -c1-330 | tail -n 90
