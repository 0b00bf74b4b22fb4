#!/usr/bin/env bash
# One device call for the CUDA top-k kernels: checks (or builds) the library, runs the GPU tests, then the
# benchmark suite. Logs under $OUT (at most 8 files come back). From the repo root on the GPU machine:
#   bash benchmarks/gpu_check_topk.sh [total_seconds]
# TEST_SECONDS caps the test phase.
set -u
OUT=${OUT:-/tmp/tsi-out}
mkdir -p "$OUT"
BUDGET=${1:-300}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# The libraries, packed by benchmarks/pack_carry.sh (carried as .carry/c.tar.xz: under the 64 MiB limit)
[ -f .carry/c.tar.xz ] && tar xJf .carry/c.tar.xz -C torch_sparse_indexer
export PYTHONUNBUFFERED=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
LIB=torch_sparse_indexer/_C/libsparse_indexer_topk.so

{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/env.txt" 2>&1

XDIST=""
if python3 -c "import pytest, xdist" 2>/dev/null; then
  XDIST="-n 4"
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

check_lib() { python3 -c "from torch_sparse_indexer.kernels import cuda_topk as c; assert c.available(), c._load_error; print('lib ok, max_k', c.max_k(), c.tuning())"; }
if ! check_lib >> "$OUT/env.txt" 2>&1; then
  echo "carried library unusable: building here" | tee -a "$OUT/env.txt"
  bash csrc/build.sh >> "$OUT/env.txt" 2>&1
  check_lib >> "$OUT/env.txt" 2>&1
fi
tail -n 3 "$OUT/env.txt"

echo "== GPU tests ($(left) s left)"
timeout ${TEST_SECONDS:-$(( $(left) - 120 > 60 ? $(left) - 120 : 60 ))} python3 -m pytest -q $XDIST -p no:cacheprovider \
  tests/test_topk_cuda.py -rfE > "$OUT/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/tests.log"
tail -n 30 "$OUT/tests.log"

echo "== benchmarks ($(left) s left)"
timeout $(( $(left) > 30 ? $(left) : 30 )) python3 benchmarks/bench.py --suite topk --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
tail -n 40 "$OUT/bench.log"

# Other builds of the library (torch_sparse_indexer/_C/variant_*.so: benchmarks/build_variants.sh), target shapes only.
for v in torch_sparse_indexer/_C/variant_*.so; do
  [ -f "$v" ] || continue
  name=$(basename "$v" .so)
  echo "== $name ($(left) s left)"
  [ "$(left)" -gt 20 ] || break
  TORCH_SPARSE_INDEXER_TOPK_LIB="$PWD/$v" TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_FLASHINFER=0 timeout $(left) \
    python3 benchmarks/bench.py --suite topk --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep "^\[topk\]" "$OUT/$name.log"
done
echo "total $(( $(date +%s) - START )) s"
