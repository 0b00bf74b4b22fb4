#!/usr/bin/env bash
# CPU emulation build of the top-k kernels (logic checks without a GPU; see tests/test_topk_cuda.py), or with
# CSRC=scoring.cu of the decode scoring kernels (tests/test_cuda_scoring.py). Small top-k tuning constants so
# that small shapes reach every path. Usage: [CSRC=scoring.cu] build_emu.sh OUT.so [extra g++ flags]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-/tmp/libsparse_indexer_topk_emu.so}"
shift || true
g++ -std=c++20 -O1 -pthread -shared -fPIC -x c++ -DTSI_EMULATE \
  -DTSI_THREADS="${TSI_THREADS:-128}" -DTSI_WIDE_THREADS="${TSI_WIDE_THREADS:-256}" -DTSI_CAND_CAP="${TSI_CAND_CAP:-512}" -DTSI_LIST_CAP="${TSI_LIST_CAP:-256}" \
  "$@" "$here/${CSRC:-topk.cu}" -o "$out"
echo "$out"
