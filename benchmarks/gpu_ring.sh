#!/usr/bin/env bash
# One device call for the top-k pass through bulk copies (session 22): the read-path probe under both flushes,
# the top-k target shapes on the default library and on each ring build (benchmarks/variants/ring_*.flags, built
# by build_variants.sh and packed by pack_carry.sh), then the top-k GPU tests on RING_TEST's build.
#   BUDGET=480 RING_TEST=ring_7x16 bash benchmarks/gpu_ring.sh
source "$(dirname "$0")/device_common.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$OUT/env.txt"
if [ -x probe_bin/bulk_read_probe ]; then
  fits 30 probe && { timeout 30 probe_bin/bulk_read_probe; timeout 30 probe_bin/bulk_read_probe clean; } \
    > "$OUT/probe.txt" 2>&1
  cat "$OUT/probe.txt"
fi
bench() {  # name [library]   (TSI_BENCH_FLUSH passes through)
  local name=$1 lib=${2:-}
  fits 60 "bench $name" || return 0
  TORCH_SPARSE_INDEXER_TOPK_LIB=$lib TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_FLASHINFER=0 timeout 60 \
    python3 benchmarks/bench.py --suite topk --out "$OUT/$name" > "$OUT/bench_$name.log" 2>&1
  echo "== $name"; grep "^\[topk\]" "$OUT/bench_$name.log" || tail -n 5 "$OUT/bench_$name.log"
}
bench default
for v in torch_sparse_indexer/_C/variant_ring_*.so; do
  [ -f "$v" ] && bench "$(basename "$v" .so)" "$PWD/$v"
done
TSI_BENCH_FLUSH=read bench default_clean
t=torch_sparse_indexer/_C/variant_${RING_TEST:-ring_7x16}.so
TSI_BENCH_FLUSH=read bench ring_clean "$PWD/$t"
if [ -f "$t" ] && fits 150 "tests"; then
  TORCH_SPARSE_INDEXER_TOPK_LIB="$PWD/$t" timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 \
    tests/test_topk_cuda.py 2>&1 | tail -n 5 | tee "$OUT/tests_ring.txt"
fi
# The sparse decode scoring targets with the clean flush (their write-flush figures: runs 92, 103).
fits 120 "scoring clean" && TSI_BENCH_FLUSH=read TSI_BENCH_ONLY=decode TSI_BENCH_FAST=1 timeout 120 \
  python3 benchmarks/bench.py --suite scoring --out "$OUT/scoring_clean" > "$OUT/scoring_clean.log" 2>&1
grep -i "sparse\|read" "$OUT/scoring_clean.log" | head -n 30
echo "total ${SECONDS} s"
