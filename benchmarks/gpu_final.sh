#!/usr/bin/env bash
# One device call that re-runs every GPU-marked test of the repository (all backends that this machine can
# load: Triton scoring/cache, CUDA top-k, DeepGEMM when its prebuilt site is carried), then the sanitizer
# script when present. Logs under $OUT. Usage on the GPU machine, from the repo root:
#   bash benchmarks/gpu_final.sh [test_seconds]
# Carry: .whl (pytest & co. as wheels), .deps (DeepGEMM sources + prebuilt site), torch_sparse_indexer/_C.
set -u
OUT=${OUT:-/tmp/tsi-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 )) s] $*"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.
if [ -f .deps/dgsite/dgsite.tgz ]; then
  tar xzf .deps/dgsite/dgsite.tgz -C /tmp && [ -f .deps/dgsite/dgjit.tgz ] && tar xzf .deps/dgsite/dgjit.tgz -C /tmp
  export PYTHONPATH=/tmp/deepgemm-site:$PYTHONPATH LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 DG_JIT_CACHE_DIR=/tmp/dgjit
fi
[ -f torch_sparse_indexer/_C/libsparse_indexer_topk.so ] || bash csrc/build.sh > "$OUT/build.log" 2>&1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, torch_sparse_indexer as tsi
from torch_sparse_indexer import backends
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
for op in ("mqa_logits", "paged_sparse_mqa_logits", "topk", "indexer_decode", "write_k_cache"):
    print(op, [b.name for b in backends.candidates(op)])
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader >> "$OUT/env.txt" 2>&1
el setup done
# One timeout per file, so a slow file cannot starve the others; the summary lines come last.
run_file() {  # run_file SECONDS FILE...
  local t=$1; shift
  timeout "$t" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "$@" > "$OUT/t_$(basename "$1" .py).log" 2>&1
  echo "$* rc=$? $(tail -n 1 "$OUT/t_$(basename "$1" .py).log")" | tee -a "$OUT/gpu_tests.log"
}
run_file 100 tests/test_triton_kernels.py
run_file 80 tests/test_topk_cuda.py
run_file 80 tests/test_deepgemm_gpu.py
run_file 60 tests/test_oracle.py
others=$(ls tests/test_*.py | grep -v -e test_triton_kernels -e test_topk_cuda -e test_deepgemm_gpu -e test_oracle)
run_file 80 $others
el tests done
if [ -f scripts/sanitize.sh ]; then
  timeout "${SAN_S:-150}" bash scripts/sanitize.sh > "$OUT/sanitize.log" 2>&1; echo "sanitize rc=$?" >> "$OUT/sanitize.log"
  tail -n 15 "$OUT/sanitize.log"
  el sanitize done
fi
