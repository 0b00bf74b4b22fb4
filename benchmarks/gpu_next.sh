#!/usr/bin/env bash
# (Ran as run 112 in session 26, on an H100: benchmarks/NOTES.md, "Session 26".)
# The staged list after session 25 (benchmarks/NOTES.md) as one device call, in priority order, so that the first
# machine that starts does the most valuable step and the later ones run only while BUDGET (default 540 s) lasts:
#   1. sparse_out: the sparse tests on the variant, then the 16K and sparse_topk rows against the default (any
#      H100 or H200: the comparison is within the call);
#   2. the head-prefetch builds on the decode shape under both flushes (its target is an H200 figure, so on an
#      H100 it runs only when BUDGET leaves room after step 1, as a relative reading);
#   3. the phase timing of the 16K rows on the default and smem_sampled phase builds.
# Prepare here: bash csrc/build.sh; bash benchmarks/build_variants.sh sparse_out prefetch_0 prefetch_128
# prefetch_256 phase_default phase_sampled; bash benchmarks/pack_carry.sh. Then carry [".carry", ".whl"]:
# bash benchmarks/gpu_next.sh
set -u
BUDGET=${BUDGET:-540}  # before device_common.sh, whose own default (580) would otherwise apply
source "$(dirname "$0")/device_common.sh"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "gpu: $gpu, budget $BUDGET s"
left() { echo $((BUDGET - SECONDS)); }
cap() { local l; l=$(left); echo $((l < $1 ? l : $1)); }  # a step's budget: at most $1 s, and what is left
if fits 150 "sparse_out"; then
  OUT=$OUT/sparse_out VARIANTS=sparse_out TARGETS=smem FLUSHES=write TESTS_K=sparse TESTS_SECONDS=60 \
    BUDGET=$(cap 260) bash benchmarks/gpu_decode_sweep.sh
fi
if [[ "$gpu" == *H200* ]] || [ "$(left)" -ge 300 ]; then
  fits 120 "prefetch" && OUT=$OUT/prefetch VARIANTS="prefetch_0 prefetch_128 prefetch_256" \
    BUDGET=$(cap 240) bash benchmarks/gpu_decode_sweep.sh
fi
for v in default sampled; do
  lib=$PWD/torch_sparse_indexer/_C/variant_phase_$v.so
  [ -f "$lib" ] && fits 60 "phase $v" && PHASE_SMEM_ONLY=1 TORCH_SPARSE_INDEXER_TOPK_LIB=$lib timeout 60 \
    python3 scripts/phase_topk.py > "$OUT/phase_$v.log" 2>&1 && { echo "== phase $v"; cat "$OUT/phase_$v.log"; }
done
echo "elapsed ${SECONDS} s"
