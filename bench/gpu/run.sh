#!/bin/bash
# The device checks in one go (run from the repository root on the GPU machine):
#   bash bench/gpu/run.sh            logs under $OUT (default /tmp/devcheck-out)
# Needs .whl/ (the wheels of our dependencies that the machine's image lacks: pydantic,
# cryptography and theirs), carried with the checkout. Every step is bounded; the whole run
# stays within BUDGET seconds (the steps run in order of importance).
DEFAULT_BUDGET=330
source "$(dirname "$0")/common.sh"
{
  date -u; uname -a; nproc; free -g | head -2
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -V
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpu", torch.cuda.get_device_name(0))'
  $PY -c 'import pydantic, cryptography, xxhash, msgpack, uvloop, yaml, prometheus_client; print("pydantic", pydantic.VERSION, "cryptography", cryptography.__version__, "xxhash", xxhash.VERSION, "msgpack", msgpack.version)'
  $PY -m pip list 2>/dev/null | grep -iE '^(pytest|pytest-timeout|pytest-xdist|hypothesis|numpy|typing.extensions) '
  $PY -c 'import ft_client, ft_monitor.cli, ft_client.inprocess, ft_client.snapshot; print("project imports ok")'
} >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. the template's CUDA refusal (skipped where torch has no CUDA) and the template rules
step pytest_template 120 "$OUT/pytest_template.log" $PY -m pytest -p no:cacheprovider -n 0 -q -rA \
  "tests/test_template.py::test_cuda_initialised_in_the_template_is_refused" tests/test_template_rules.py
# 2. in-process restart on NCCL
step inprocess_nccl 180 "$OUT/inprocess_nccl.log" $PY bench/gpu/inprocess_nccl.py
# 3. snapshots of CUDA tensors
step snapshot_cuda 150 "$OUT/snapshot_cuda.log" $PY bench/gpu/snapshot_cuda.py --gib 1
# 4. the learned-timeout MAX on NCCL
step sync_nccl 60 "$OUT/sync_nccl.log" $PY bench/gpu/sync_nccl.py
# 5. if time is left: the whole template test file with CUDA torch
step pytest_template_all 60 "$OUT/pytest_template_all.log" $PY -m pytest -p no:cacheprovider -n 4 -q -rfEs \
  tests/test_template.py

echo "===== summary (total $(( SECONDS - start )) s) ====="
cat "$OUT/summary.txt"
grep -hE "^(SUMMARY|RESULT|INFO|ITER|EVENT|SAVE|D2H|RESTORE|PAIR_|SYNC|CLIENT|FAIL|TRAINED|GAVE|=====)|passed|failed|error" \
  "$OUT/pytest_template.log" "$OUT/inprocess_nccl.log" "$OUT/snapshot_cuda.log" "$OUT/sync_nccl.log" \
  "$OUT/pytest_template_all.log" 2>/dev/null | cut -c1-400 | tail -n 120
