#!/usr/bin/env bash
# One device call for the Triton scoring/cache kernels: builds DeepGEMM 2.8.2 in the background (when
# .deps/deepgemm is carried), runs the GPU tests, the DeepGEMM cross-check tests, then the benchmark suite.
# Everything is logged under $OUT (at most 8 files come back). Usage on the GPU machine, from the repo root:
#   bash benchmarks/gpu_check_scoring.sh [total_seconds]
# SKIP_DEEPGEMM=1 skips the DeepGEMM build and cross-check; TSI_BENCH_FAST=1 benchmarks the target shapes
# only; TEST_SECONDS caps the test phase.
set -u
OUT=${OUT:-/tmp/tsi-out}
mkdir -p "$OUT"
BUDGET=${1:-400}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tsi-triton-cache
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/env.txt" 2>&1

XDIST=""
if python3 -c "import pytest, xdist" 2>/dev/null; then
  XDIST="-n 8"
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

DG_PID=""
if [ -f .deps/deepgemm/deepgemm-build.sh ] && [ "${SKIP_DEEPGEMM:-0}" != 1 ]; then
  ( nice -n 10 bash .deps/deepgemm/deepgemm-build.sh .deps/deepgemm > "$OUT/deepgemm_build.log" 2>&1 ) &
  DG_PID=$!
fi

echo "== GPU tests ($(left) s left)"
timeout ${TEST_SECONDS:-$(( $(left) - 200 > 60 ? $(left) - 200 : 60 ))} python3 -m pytest -q $XDIST -p no:cacheprovider \
  tests/test_triton_kernels.py -k "not deepgemm" -rfE > "$OUT/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/tests.log"
tail -n 25 "$OUT/tests.log"

if [ -n "$DG_PID" ]; then
  wait "$DG_PID"
  tail -n 3 "$OUT/deepgemm_build.log"
  if [ -d /tmp/deepgemm-site ]; then
    export PYTHONPATH=/tmp/deepgemm-site:$PYTHONPATH LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6
  fi
fi

echo "== DeepGEMM cross-check ($(left) s left)"
[ "${SKIP_DEEPGEMM:-0}" = 1 ] || timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k deepgemm -rfEs \
  >> "$OUT/tests.log" 2>&1
echo "deepgemm tests rc=$?" | tee -a "$OUT/tests.log"
tail -n 6 "$OUT/tests.log"

echo "== benchmarks ($(left) s left)"
timeout $(( $(left) > 30 ? $(left) : 30 )) python3 benchmarks/bench.py --suite scoring --out "$OUT" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E "^\s+(paged|mqa|sparse|write|gather|quantize)|candidate lists|FAILED|Error|error" "$OUT/bench.log" | head -80
echo "total $(( $(date +%s) - START )) s"
