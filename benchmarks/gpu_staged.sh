#!/usr/bin/env bash
# The first staged device call (benchmarks/NOTES.md, "Staged for the next device session"), ~9 minutes, in
# priority order: the top-k targets with the three-CTA rows, the top-k GPU tests, the read roofline of the sparse
# decode pattern (FP8 and MXFP4), the top-k tests again with the three-CTA kernel forced on, phase timing on both
# kernels, the write_k_cache hint-mask sweep with the Triton cache tests, and the scoring GPU tests. Prepare here:
# csrc/build.sh, csrc/build.sh torch_sparse_indexer/_C/phase_topk.so -DTSI_PHASE_TIMING, bash
# benchmarks/pack_carry.sh; then on the device, carrying [".carry", ".whl"]: bash benchmarks/gpu_staged.sh
set -u
# Steps in priority order; each is skipped when its timeout would run past BUDGET seconds.
source "$(dirname "$0")/device_common.sh"
python3 -c "from torch_sparse_indexer.kernels import cuda_topk as ct; print('tri CTAs/SM', ct.tri_blocks_per_sm())" \
  | tee "$OUT/tri_occupancy.txt"
# TOPK_BENCH_S: the step's timeout (default 150 s; longer for a build whose suite times extra alternative rows)
fits "${TOPK_BENCH_S:=150}" "topk bench" && TSI_BENCH_TOPK_TARGETS=1 TSI_BENCH_FLASHINFER=0 timeout "$TOPK_BENCH_S" \
  python3 benchmarks/bench.py --suite topk --out "$OUT" > "$OUT/topk_bench.log" 2>&1
grep -s "^\[topk\]" "$OUT/topk_bench.log"
fits 150 "topk tests" && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/test_topk_cuda.py \
  2>&1 | tail -n 3 | tee "$OUT/topk_tests.txt"
fits 60 "roofline" && timeout 60 python3 scripts/gather_roofline.py 2>&1 | tee "$OUT/roofline.txt"
# the same tests with the three-CTA kernel taking every row it qualifies for
fits 90 "topk tests tri always" && TORCH_SPARSE_INDEXER_TEST_TRI_MODE=always timeout 90 python3 -m pytest -q -m gpu \
  -p no:cacheprovider -n 8 tests/test_topk_cuda.py -k "sparse_topk or topk_random or strided or patterns or overflow" \
  2>&1 | tail -n 3 | tee "$OUT/topk_tests_tri_always.txt"
phase=torch_sparse_indexer/_C/phase_topk.so
[ -f $phase ] && fits 80 "phase" && TORCH_SPARSE_INDEXER_TOPK_LIB="$PWD/$phase" timeout 80 python3 \
  scripts/phase_topk.py > "$OUT/phase.log" 2>&1; tail -n 40 "$OUT/phase.log" 2>/dev/null
fits 100 "cache bench" && TSI_BENCH_ONLY=cache TSI_BENCH_FAST=1 timeout 100 python3 benchmarks/bench.py --suite scoring \
  --out "$OUT/cache" > "$OUT/cache.log" 2>&1
grep -sE "write_k_cache|gather_k" "$OUT/cache.log" | tail -n 30
fits 100 "cache tests" && timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_kernels.py \
  -k "write or cache or gather" 2>&1 | tail -n 1 | tee "$OUT/cache_tests.txt"
fits 90 "scoring tests" && timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_scoring.py 2>&1 \
  | tail -n 1 | tee "$OUT/scoring_tests.txt"
echo "elapsed ${SECONDS} s"
