#!/usr/bin/env bash
# A staged device call (written after session 37; item 1 of NOTES.md's "Staged ... after session 39"). Carry [".carry", ".whl", ".deps/deepgemm"].
# In order, each step only while it fits BUDGET (device_common.sh's `fits`):
#   any GPU:      tests/test_topk_cuda.py whole on the default library, unless SKIP_TESTS=1
#   an H200 only: the scoring suite's decode section (TMA dense decode rows, row kernel configurations, DeepGEMM's
#                 raw kernel in the same process; DeepGEMM is built in the background from the start)
#   any GPU:      the shared-memory top-k rows on the default and on variant_fixup_serial (the old decrements),
#                 default again, write flush, unless FIXUP=0 (only where variant_fixup_serial.so was built)
#   an H200 only: the TMA bulk-read probe, the DeepGEMM suite (_agreement), the top-k head-prefetch variants
# Everything lands in $OUT/logs (packed into $OUT/logs.tgz) and $OUT/summary.txt.
set -u
source "$(dirname "$0")/device_common.sh"
L=$OUT/logs; mkdir -p "$L"
S=$OUT/summary.txt
log() { echo "[+${SECONDS} s] $*" | tee -a "$S"; }
pack() { tar czf "$OUT/logs.tgz" -C "$OUT" logs $(cd "$OUT" && ls -d ./*/ 2>/dev/null); }
trap pack EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:. TRITON_CACHE_DIR=/tmp/tsi-triton-cache
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$L/env.txt"
log "gpu: $gpu"
# ANY_GPU=1 runs the H200-only steps on whatever card came (their comparisons are within one process, so they hold
# on that card; the H200 targets do not).
h200=0; [[ $gpu == *H200* || ${ANY_GPU:-0} = 1 ]] && h200=1

source "$(dirname "$0")/deepgemm_bg.sh"
[ $h200 = 1 ] && dg_start "$L/deepgemm_build.log"
join_dg() { dg_join; [ -z "$DG_MSG" ] || log "$DG_MSG"; }

if [ "${SKIP_TESTS:-0}" != 1 ] && fits 200 "topk tests"; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_topk_cuda.py > "$L/topk_tests.log" 2>&1
  log "topk tests rc=$? $(tail -n 1 "$L/topk_tests.log")"
fi

if [ $h200 = 1 ]; then
  join_dg
  if fits 150 "scoring decode"; then
    TSI_BENCH_ONLY=decode timeout 150 python3 benchmarks/bench.py --suite scoring --out "$OUT/scoring" \
      > "$L/scoring_decode.log" 2>&1
    log "scoring decode rc=$?"
    grep "ctx131072" "$L/scoring_decode.log" | grep "fp8" | grep "paged_mqa_logits " | cut -c1-140 >> "$S"
  fi
fi

if [ "${FIXUP:-1}" = 1 ] && [ -f torch_sparse_indexer/_C/variant_fixup_serial.so ] && fits 270 "fixup sweep"; then
  OUT=$OUT/fixup VARIANTS=fixup_serial TARGETS=smem FLUSHES=write BUDGET=$((BUDGET - SECONDS)) \
    timeout 270 bash benchmarks/gpu_decode_sweep.sh > "$L/fixup.log" 2>&1
  log "fixup sweep rc=$?"; grep -v "CTA\]" "$L/fixup.log" >> "$S"
fi

[ $h200 = 1 ] || { log "not an H200 (ANY_GPU=1 runs the rest anyway): done"; exit 0; }
if [ -x .carry/bulk_read_probe ] && fits 60 probe; then
  timeout 30 .carry/bulk_read_probe > "$L/probe.txt" 2>&1
  timeout 30 .carry/bulk_read_probe clean > "$L/probe_clean.txt" 2>&1
  log "probe done"; cat "$L/probe.txt" "$L/probe_clean.txt" >> "$S"
fi
if fits 90 deepgemm; then
  timeout 90 python3 benchmarks/bench.py --suite deepgemm --out "$OUT/deepgemm" > "$L/deepgemm_suite.log" 2>&1
  log "deepgemm suite rc=$?"
  grep -i "same_as_dg" "$L/deepgemm_suite.log" | cut -c1-200 >> "$S"
fi
if fits 200 "topk prefetch"; then
  OUT=$OUT/sweep VARIANTS="prefetch_64 prefetch_256" TARGETS=decode FLUSHES=read BUDGET=$((BUDGET - SECONDS)) \
    timeout 200 bash benchmarks/gpu_decode_sweep.sh > "$L/topk_sweep.log" 2>&1
  log "topk sweep rc=$?"; cat "$L/topk_sweep.log" >> "$S"
fi
log "elapsed"
