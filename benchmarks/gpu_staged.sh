#!/usr/bin/env bash
# The first staged device call (benchmarks/NOTES.md, "Staged for the next device session"), ~8 minutes: the top-k
# GPU tests and targets on the current build, the scoring GPU tests, the CP step through NCCL, the decode scoring
# ablation sweep, and each top-k variant library's decode row. Prepare here: build (csrc/build.sh,
# build_variants.sh, KIND=scoring build_variants.sh ablate_*), bash benchmarks/pack_carry.sh; then on the device,
# carrying [".carry", ".whl"]:   bash benchmarks/gpu_staged.sh
set -u
OUT=${OUT:-/tmp/tsi-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ -f .carry/c.tar.xz ] && tar xJf .carry/c.tar.xz -C torch_sparse_indexer
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/test_topk_cuda.py 2>&1 | tail -n 2 \
  | tee "$OUT/topk_tests.txt"
TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_FLASHINFER=0 timeout 120 python3 benchmarks/bench.py --suite topk --out "$OUT" \
  > "$OUT/topk_bench.log" 2>&1
grep "^\[topk\]" "$OUT/topk_bench.log"
[ -f torch_sparse_indexer/_C/phase_topk.so ] && TORCH_SPARSE_INDEXER_TOPK_LIB="$PWD/torch_sparse_indexer/_C/phase_topk.so" \
  timeout 60 python3 scripts/phase_topk.py > "$OUT/phase.log" 2>&1; tail -n 40 "$OUT/phase.log"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_scoring.py 2>&1 | tail -n 1
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_distributed.py -k nccl 2>&1 | tail -n 1
timeout 170 python3 scripts/sweep_cuda_decode.py torch_sparse_indexer/_C/scoring_variant_ablate_*.so \
  > "$OUT/sweep.log" 2>&1
grep -oE "'op': '[a-z]+', 'fmt': '[a-z0-9]+', 'impl': '[^']+', 'time_us': [0-9.]+|ctas_per_sm': [0-9]+" \
  "$OUT/sweep.log" | paste -sd' ' | sed "s/'op'/\n'op'/g"
for v in torch_sparse_indexer/_C/variant_*.so; do
  [ -f "$v" ] || continue
  n=$(basename "$v" .so)
  TORCH_SPARSE_INDEXER_TOPK_LIB="$PWD/$v" TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_FLASHINFER=0 timeout 60 \
    python3 benchmarks/bench.py --suite topk --out "$OUT/$n" > "$OUT/$n.log" 2>&1
  echo "== $n"
  grep "^\[topk\] topk 128x128K" "$OUT/$n.log"
done
