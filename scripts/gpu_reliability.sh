#!/usr/bin/env bash
# Issue 7 on the GPU machine, in two parts that each fit one device call (< 10 min):
#   bash scripts/gpu_reliability.sh tests     # fuzz (gpu profile), determinism, bad-input matrix, replay stress
#   bash scripts/gpu_reliability.sh sanitize  # scripts/sanitize.sh (four compute-sanitizer passes)
# Logs under $OUT; the last lines are a PASS/FAIL summary per part. Env: FUZZ_BUDGET_S (per fuzz test, default
# 25), TSI_STRESS_REPLAYS (default 10000).
set -u
OUT=${OUT:-/tmp/tsi-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tsi-triton-cache}
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import hypothesis, pytest" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.:${PYTHONPATH:-}
[ -f torch_sparse_indexer/_C/libsparse_indexer_topk.so ] || bash csrc/build.sh > "$OUT/topk_build.log" 2>&1 ||
  echo "WARN: top-k library build failed (top-k runs on the reference)"
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*"; }
PART=${1:-tests}
RESULTS=""
note() { RESULTS="$RESULTS$1"$'\n'; echo "$1"; }

if [ "$PART" = tests ]; then
  # Compile the Triton scoring variants the fuzz draws (padded heads 16/32/64/128 x fmt x D, f32/bf16 weights
  # and logits) in parallel processes sharing the cache, so the fuzz spends its time on cases.
  for fmt in fp8 mxfp4; do for D in 64 128; do for H in 16 32 64 128; do
    python3 -c "
import torch
from torch_sparse_indexer.kernels import triton_scoring as ts, triton_cache as tc
ts.warmup('cuda', $H, $D, '$fmt', weights_dtypes=(torch.float32, torch.bfloat16), logits_dtypes=(torch.float32, torch.bfloat16))
tc.warmup('cuda', $D, '$fmt', k_dtypes=(torch.float32, torch.bfloat16, torch.float16), pow2_scale=(True, False))
" > "$OUT/warm_${fmt}_${D}_${H}.log" 2>&1 &
  done; done; done
  wait
  el "warm-up done"
  TSI_FUZZ_PROFILE=gpu TSI_FUZZ_BUDGET_S=${FUZZ_BUDGET_S:-25} TSI_FUZZ_REPORT="$OUT/fuzz_counts.json" \
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_fuzz.py -k cuda > "$OUT/fuzz.log" 2>&1
  note "fuzz rc=$? $(tail -n 1 "$OUT/fuzz.log")"
  grep -A 30 "fuzz cases" "$OUT/fuzz.log" | grep -E "cases|calls|total"
  el "fuzz done"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_determinism.py \
    tests/test_bad_input_matrix.py > "$OUT/determinism_matrix.log" 2>&1
  note "determinism + bad-input matrix rc=$? $(tail -n 1 "$OUT/determinism_matrix.log")"
  el "determinism/matrix done"
  TSI_STRESS_REPLAYS=${TSI_STRESS_REPLAYS:-10000} timeout 240 python3 tests/test_replay_stress_gpu.py \
    > "$OUT/replay_stress.log" 2>&1
  note "replay stress rc=$? $(tail -n 1 "$OUT/replay_stress.log")"
  grep "replay stress" "$OUT/replay_stress.log"
  el "replay stress done"
elif [ "$PART" = sanitize ]; then
  SAN_TOOL_S=${SAN_TOOL_S:-110} bash scripts/sanitize.sh > "$OUT/sanitize.log" 2>&1
  note "sanitize rc=$?"
  sed -n '/== sanitize summary/,$p' "$OUT/sanitize.log"
  el "sanitize done"
else
  echo "usage: $0 tests|sanitize"; exit 2
fi
echo "== summary ($PART)"
printf "%s" "$RESULTS"
