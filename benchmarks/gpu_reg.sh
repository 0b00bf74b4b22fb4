#!/usr/bin/env bash
# One device call for the register-row kernel (NOTES.md, "Session 29"): the top-k GPU tests and the capture tests on
# this library, then its rows (TSI_BENCH_TOPK_REG=1: each shape on the register kernel and on the shared-memory path,
# in one process), then the top-k target shapes (TARGETS=smem sweep: this library against variant_head.so when
# present). Carry [".carry", ".whl"]:  bash benchmarks/gpu_reg.sh
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
fits 100 graph_tests && t 100 tests/test_capture_gpu.py
if fits 240 reg; then
  TSI_BENCH_TOPK_REG=1 TSI_BENCH_FLASHINFER=0 timeout 240 python3 benchmarks/bench.py --suite topk \
    --out "$OUT/reg" > "$L/reg.log" 2>&1
  grep "^\[topk\]" "$L/reg.log"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
echo "elapsed ${SECONDS} s"
