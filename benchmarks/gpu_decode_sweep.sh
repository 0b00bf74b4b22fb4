#!/usr/bin/env bash
# One device call: top-k target shapes on the default library and on variant builds
# (torch_sparse_indexer/_C/variant_*.so, benchmarks/build_variants.sh) under the L2 flushes (benchmarks/common.py),
# the default first and last. Carry [".carry", ".whl"]:  BUDGET=300 bash benchmarks/gpu_decode_sweep.sh
#   VARIANTS="prefetch_0 prefetch_128"  only these builds (default: every variant_*.so)
#   TARGETS=all                         every top-k target shape (default: decode, the 128 x 128K rows only)
#   TARGETS=smem                        the shared-memory rows' targets only (4096 x 16K, sparse_topk)
#   FLUSHES="write"                     the flushes to run (default: "write read")
#   FLUSHES_FIRST="write read"          the flushes of the first default run only (default: FLUSHES)
#   TESTS_K="random or sparse"          also run tests/test_topk_cuda.py -k "$TESTS_K" on each variant first
#                                       (for at most TESTS_SECONDS, default 150)
source "$(dirname "$0")/device_common.sh"
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$OUT/logs/env.txt"
decode=1 smem=0 secs=40
[ "${TARGETS:-decode}" = all ] && decode="" secs=90
[ "${TARGETS:-decode}" = smem ] && decode="" smem=1 secs=80
one() {  # name library [flushes]
  for fl in ${3:-${FLUSHES:-write read}}; do
    fits $secs "$1 $fl" || return 0
    TORCH_SPARSE_INDEXER_TOPK_LIB=$2 TSI_BENCH_FLUSH=$fl TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_TOPK_DECODE=$decode \
      TSI_BENCH_TOPK_SMEM=$smem TSI_BENCH_FLASHINFER=0 timeout $secs python3 benchmarks/bench.py --suite topk \
      --out "$OUT/$1_$fl" > "$OUT/logs/$1_$fl.log" 2>&1
    echo "== $1, $fl flush"
    grep "^\[topk\] \(sparse_\|block_\)\?topk" "$OUT/logs/$1_$fl.log" | grep -v "cluster\|two-pass"
  done
}
variants=()
if [ -n "${VARIANTS:-}" ]; then
  for n in $VARIANTS; do variants+=("torch_sparse_indexer/_C/variant_$n.so"); done
else
  variants=(torch_sparse_indexer/_C/variant_*.so)
fi
one default "" "${FLUSHES_FIRST:-}"
for v in "${variants[@]}"; do
  [ -f "$v" ] || { echo "missing $v"; continue; }
  n=$(basename "$v" .so)
  if [ -n "${TESTS_K:-}" ] && fits "${TESTS_SECONDS:-150}" "$n tests"; then
    TORCH_SPARSE_INDEXER_TOPK_LIB=$PWD/$v timeout "${TESTS_SECONDS:-150}" \
      python3 -m pytest -q -p no:cacheprovider tests/test_topk_cuda.py \
      -k "$TESTS_K" > "$OUT/logs/${n}_tests.log" 2>&1
    echo "== $n tests: $(tail -n 1 "$OUT/logs/${n}_tests.log")"
  fi
  one "$n" "$PWD/$v"
done
one default_again ""
tar czf "$OUT/logs.tgz" -C "$OUT" logs
echo "elapsed ${SECONDS} s"
