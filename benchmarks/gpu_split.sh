#!/usr/bin/env bash
# One device call for the split kernel (NOTES.md, "Session 28"): the top-k GPU tests, the capture and determinism
# tests (whose small batches now take the split kernel), the small decode batches on every path
# (TSI_BENCH_TOPK_SMALL=1), then the top-k target shapes on this library and on variant_head.so (the previous one).
# Carry [".carry", ".whl"]:  bash benchmarks/gpu_split.sh
source "$(dirname "$0")/device_common.sh"
L=$OUT/logs
mkdir -p "$L"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee "$L/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
t() {  # seconds file...
  local log="$L/t_$(basename "$2" .py).log"
  timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "${@:2}" > "$log" 2>&1
  echo "$2: $(tail -n 1 "$log")"
}
fits 120 topk_tests && t 120 tests/test_topk_cuda.py
fits 150 graph_tests && t 150 tests/test_capture_gpu.py tests/test_determinism.py
if fits 200 small; then
  TSI_BENCH_TOPK_SMALL=1 TSI_BENCH_FLASHINFER=0 timeout 200 python3 benchmarks/bench.py --suite topk \
    --out "$OUT/small" > "$L/small.log" 2>&1
  grep "^\[topk\] topk" "$L/small.log"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
if [ $((BUDGET - SECONDS)) -gt 150 ]; then
  BUDGET=$((BUDGET - SECONDS)) VARIANTS=head TARGETS=all FLUSHES=write OUT=$OUT/sweep \
    bash benchmarks/gpu_decode_sweep.sh
fi
echo "elapsed ${SECONDS} s"
