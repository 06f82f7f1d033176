#!/bin/bash
# The second device call: what the first one (run.sh) left open. Logs under $OUT.
#   1. the whole tests/test_template.py with CUDA torch (pytest-benchmark, installed there, turns
#      xdist's warning into an error under filterwarnings=error: -p no:benchmark)
#   2. hang_inflight again, the abort now coming while the all_reduce is still queued on the GPU
#   3. the NCCL abort's time: torch's _abort_process_group / destroy vs raw ncclCommAbort
#   4. a 1 GiB snapshot save's breakdown, and a direct device -> monitor-memory copy
set -u
OUT=${OUT:-/tmp/devcheck-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-200}
export PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
start=$SECONDS
left() { echo $(( BUDGET - (SECONDS - start) )); }
step() {
  local name=$1 cap=$2 log=$3; shift 3
  local t; t=$(left); (( t > cap )) && t=$cap
  if (( t < 10 )); then echo "STEP $name: SKIPPED (budget spent)" | tee -a "$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$log" 2>&1
  echo "STEP $name: rc=$? in $(( SECONDS - t0 )) s (limit $t s)" | tee -a "$OUT/summary.txt"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/env.txt" 2>&1 || { echo "wheel install failed"; cat "$OUT/env.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
echo /tmp/site > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ft-devcheck-wheels.pth"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/env.txt"

step pytest_template_all 90 "$OUT/pytest_template_all.log" python3 -m pytest -p no:cacheprovider -p no:benchmark \
  -n 4 -q -rA tests/test_template.py
step hang_inflight 60 "$OUT/hang_inflight.log" python3 bench/gpu/inprocess_nccl.py hang_inflight
step nccl_abort_bench 60 "$OUT/nccl_abort_bench.log" python3 bench/gpu/nccl_abort_bench.py
step snapshot_breakdown 60 "$OUT/snapshot_breakdown.log" python3 bench/gpu/snapshot_breakdown.py --gib 1

echo "===== summary (total $(( SECONDS - start )) s) ====="
cat "$OUT/summary.txt"
grep -hE "^(SUMMARY|RESULT|INFO|ITER|EVENT|NCCL_END|CUPY_NCCL|SAVE_BREAKDOWN|COPY|CHECKSUM|REGISTER|DIRECT|FAIL|GAVE|queued|=====)|passed|failed|PASSED|FAILED|Error|rounds" \
  "$OUT/pytest_template_all.log" "$OUT/hang_inflight.log" "$OUT/nccl_abort_bench.log" "$OUT/snapshot_breakdown.log" \
  2>/dev/null | cut -c1-330 | tail -n 90
