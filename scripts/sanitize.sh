#!/usr/bin/env bash
# Memory and race checking of every GPU op: runs scripts/sanitize_driver.py (edge-case shapes, whatever backend
# dispatch picks) under compute-sanitizer, one pass per tool, and requires "ERROR SUMMARY: 0 errors" and the
# driver's "DRIVER OK" line from each. Exit status 0 only if every required pass is clean.
#
# Usage (GPU machine, repo root):  bash scripts/sanitize.sh [tool ...]
#   tools: memcheck racecheck initcheck synccheck (default: all four), plus initcheck-strict (informational
#   unless SAN_STRICT_REQUIRED=1: caches hold only written tokens, so initcheck reports any read of a byte no
#   valid position covers).
# Env: SAN_TOOL_S (seconds per pass, default 120), SAN_QUICK=1 (fewer configurations), OUT (log folder).
set -u
OUT=${OUT:-/tmp/tsi-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# Triton kernels JIT-compile: the warm-up run below compiles them outside the sanitizer into this cache, so
# the sanitized runs only load binaries.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tsi-triton-cache}
TOOLS=${*:-memcheck racecheck initcheck synccheck initcheck-strict}
PASS_S=${SAN_TOOL_S:-120}
DRIVER_ARGS=""
[ "${SAN_QUICK:-0}" = 1 ] && DRIVER_ARGS="--quick"

CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
     /opt/nvidia/*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$CS" ]; then
  echo "sanitize: FAIL: compute-sanitizer not found"
  exit 2
fi
"$CS" --version | tail -n 1

if [ ! -f torch_sparse_indexer/_C/libsparse_indexer_topk.so ] && [ -f csrc/build.sh ]; then
  bash csrc/build.sh > "$OUT/sanitize_topk_build.log" 2>&1 || echo "sanitize: WARN: top-k library build failed (top-k runs on the reference)"
fi

T0=$(date +%s)
echo "== warm-up (no sanitizer): compiles every kernel the driver launches"
if ! timeout 300 python3 scripts/sanitize_driver.py $DRIVER_ARGS > "$OUT/sanitize_warm.log" 2>&1 ||
   ! grep -q "DRIVER OK" "$OUT/sanitize_warm.log"; then
  tail -n 30 "$OUT/sanitize_warm.log"
  echo "sanitize: FAIL: the driver does not run without the sanitizer"
  exit 1
fi
python3 scripts/sanitize_driver.py $DRIVER_ARGS --strict-init > "$OUT/sanitize_warm_strict.log" 2>&1
grep -E "^  |DRIVER" "$OUT/sanitize_warm.log"
echo "   warm-up $(( $(date +%s) - T0 )) s"

FAILED=0
SUMMARY=""
for tool in $TOOLS; do
  t=$tool; extra=""; strict=""
  case $tool in
    memcheck) extra="--leak-check no" ;;
    racecheck) extra="--racecheck-report all" ;;
    initcheck) ;;
    synccheck) ;;
    initcheck-strict) t=initcheck; strict="--strict-init" ;;
    *) echo "sanitize: unknown tool $tool"; exit 2 ;;
  esac
  log="$OUT/sanitize_$tool.log"
  s0=$(date +%s)
  # No caching allocator: every tensor is its own allocation, so an access past a tensor leaves it.
  timeout "$PASS_S" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$t" --target-processes all \
    --print-limit 20 --error-exitcode 3 $extra python3 scripts/sanitize_driver.py $DRIVER_ARGS $strict > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - s0 ))
  # memcheck/initcheck/synccheck end with "ERROR SUMMARY: N errors", racecheck with
  # "RACECHECK SUMMARY: M hazards displayed (N errors, W warnings)".
  errs=$(grep -Eo "ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: .*\([0-9]+ error" "$log" | tail -n 1 |
         grep -Eo "[0-9]+ error" | grep -Eo "[0-9]+")
  if [ "$rc" = 0 ] && [ "${errs:-x}" = 0 ] && grep -q "DRIVER OK" "$log"; then
    verdict=PASS
  else
    verdict=FAIL
    if [ "$tool" != initcheck-strict ] || [ "${SAN_STRICT_REQUIRED:-0}" = 1 ]; then FAILED=1; fi
    [ "$rc" = 124 ] && verdict="FAIL (timeout ${PASS_S} s)"
    grep -m 12 -E "=========  *(Invalid|Uninitialized|Race|Barrier|Error|Warning|ERROR|Program hit)|in .*kernel|DRIVER|Device not supported" "$log"
  fi
  [ "$tool" = initcheck-strict ] && [ "${SAN_STRICT_REQUIRED:-0}" != 1 ] && verdict="$verdict (informational)"
  line="$tool: $verdict (rc=$rc, errors=${errs:-?}, ${secs} s)"
  echo "$line"
  SUMMARY="$SUMMARY$line"$'\n'
done
echo "== sanitize summary"
printf "%s" "$SUMMARY"
if [ "$FAILED" = 0 ]; then echo "sanitize: PASS"; else echo "sanitize: FAIL"; fi
exit $FAILED
