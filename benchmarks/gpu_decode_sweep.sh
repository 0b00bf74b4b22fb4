#!/usr/bin/env bash
# One device call: the top-k decode shape (128 x 128K, k 2048) on the default library and on every
# torch_sparse_indexer/_C/variant_*.so (benchmarks/build_variants.sh), under both L2 flushes (benchmarks/common.py),
# the default first and last. Carry [".carry", ".whl"]:  BUDGET=300 bash benchmarks/gpu_decode_sweep.sh
source "$(dirname "$0")/device_common.sh"
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$OUT/logs/env.txt"
one() {  # name library
  for fl in write read; do
    fits 40 "$1 $fl" || return 0
    TORCH_SPARSE_INDEXER_TOPK_LIB=$2 TSI_BENCH_FLUSH=$fl TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_TOPK_DECODE=1 \
      TSI_BENCH_FLASHINFER=0 timeout 40 python3 benchmarks/bench.py --suite topk --out "$OUT/$1_$fl" \
      > "$OUT/logs/$1_$fl.log" 2>&1
    echo "== $1, $fl flush"; grep "^\[topk\] topk" "$OUT/logs/$1_$fl.log" | grep -v "cluster\|two-pass"
  done
}
one default ""
for v in torch_sparse_indexer/_C/variant_*.so; do
  [ -f "$v" ] && one "$(basename "$v" .so)" "$PWD/$v"
done
one default_again ""
tar czf "$OUT/logs.tgz" -C "$OUT" logs
echo "elapsed ${SECONDS} s"
