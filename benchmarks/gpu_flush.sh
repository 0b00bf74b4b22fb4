#!/usr/bin/env bash
# One device call: the top-k target shapes and the scoring suite sections in SECTIONS under both L2 flushes
# (TSI_BENCH_FLUSH=write, every earlier figure's, and =read, the L2 state of rotated inputs; benchmarks/common.py),
# then the read-path probe (scripts/bulk_read_probe.cu, compiled beforehand into probe_bin/) under both. Logs are
# packed into $OUT/logs.tgz. Carry [".carry", ".whl"]:  BUDGET=520 SECTIONS="decode cache" bash benchmarks/gpu_flush.sh
source "$(dirname "$0")/device_common.sh"
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$OUT/logs/env.txt"
for fl in write read; do
  fits 70 "topk $fl" && TSI_BENCH_FLUSH=$fl TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_FLASHINFER=0 timeout 70 \
    python3 benchmarks/bench.py --suite topk --out "$OUT/topk_$fl" > "$OUT/logs/topk_$fl.log" 2>&1
  echo "== topk, $fl flush"
  targets="topk 128x128K|topk 4096x16K|sparse_topk 4096x2048blk\*8|topk 4096x128K|block_topk 4096x128K/8"
  grep -sE "^\[topk\] ($targets) k=2048:" "$OUT/logs/topk_$fl.log"
done
# SECTIONS: the scoring suite's sections (TSI_BENCH_ONLY), each timed under both flushes
for sec in ${SECTIONS:-decode cache}; do
  for fl in write read; do
    fits 150 "scoring $sec $fl" && TSI_BENCH_FLUSH=$fl TSI_BENCH_ONLY=$sec TSI_BENCH_FAST=1 timeout 150 \
      python3 benchmarks/bench.py --suite scoring --out "$OUT/${sec}_$fl" > "$OUT/logs/${sec}_$fl.log" 2>&1
    echo "== scoring $sec, $fl flush"
    grep -s "^  paged_sparse\|^  write_k_cache\|^  gather_k" "$OUT/logs/${sec}_$fl.log" | head -n 24
  done
done
if [ -x probe_bin/bulk_read_probe ] && fits 40 probe; then
  { timeout 20 probe_bin/bulk_read_probe; timeout 20 probe_bin/bulk_read_probe clean; } > "$OUT/logs/probe.txt" 2>&1
  grep -E "^#|plain read|U=8 \(1 CTA|gather ldg U=4, 16" "$OUT/logs/probe.txt"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
echo "elapsed ${SECONDS} s"
