# Shared by run.sh and extra.sh (sourced): $OUT, the time budget, `step`, and the wheels of
# our dependencies that the machine's image lacks (.whl/, installed into /tmp/site).
set -u
OUT=${OUT:-/tmp/devcheck-out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-$DEFAULT_BUDGET}
export PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
start=$SECONDS

left() { echo $(( BUDGET - (SECONDS - start) )); }
step() {  # step NAME CAP LOG CMD...: run CMD with a timeout of min(CAP, what is left), output to LOG
  local name=$1 cap=$2 log=$3; shift 3
  local t; t=$(left); (( t > cap )) && t=$cap
  if (( t < 10 )); then echo "STEP $name: SKIPPED (budget spent)" | tee -a "$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$log" 2>&1
  local rc=$?
  echo "STEP $name: rc=$rc in $(( SECONDS - t0 )) s (limit $t s)" | tee -a "$OUT/summary.txt"
}

PY=${PY:-python3}  # a dry run elsewhere: PY=.venv/bin/python SKIP_WHEELS=1
if [[ -z ${SKIP_WHEELS:-} ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/env.txt" 2>&1 || { echo "wheel install failed"; cat "$OUT/env.txt"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  # a subprocess whose PYTHONPATH a test replaces (tests/test_template.py's helper) still finds them
  echo /tmp/site > "$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ft-devcheck-wheels.pth"
else
  export PYTHONPATH=$PWD
fi
