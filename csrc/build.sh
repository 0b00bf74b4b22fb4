#!/usr/bin/env bash
# Builds the CUDA libraries with plain nvcc (no CUDA torch needed); the same command as setup.py's build step.
# Usage: csrc/build.sh                      both libraries into torch_sparse_indexer/_C/
#        csrc/build.sh OUT [nvcc flags...]  one library (csrc/topk.cu, or csrc/$CSRC with CSRC=scoring.cu) into OUT
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build() {  # src out [flags...]
  local src="$1" out="$2"
  shift 2
  mkdir -p "$(dirname "$out")"
  "${NVCC:-nvcc}" -O3 -std=c++20 --shared -Xcompiler -fPIC -cudart static --threads 0 \
    -gencode arch=compute_90a,code=sm_90a \
    -gencode arch=compute_100a,code=sm_100a \
    -gencode arch=compute_90,code=compute_90 \
    "$@" "$root/csrc/$src" -o "$out"
  echo "built $out"
}
if [ $# -eq 0 ]; then
  build topk.cu "$root/torch_sparse_indexer/_C/libsparse_indexer_topk.so"
  build scoring.cu "$root/torch_sparse_indexer/_C/libsparse_indexer_scoring.so"
else
  out="$1"
  shift
  build "${CSRC:-topk.cu}" "$out" "$@"
fi
