#!/usr/bin/env bash
# Builds torch_sparse_indexer/_C/libsparse_indexer_topk.so with plain nvcc (no CUDA torch needed).
# The same command as setup.py's build step. Usage: csrc/build.sh [output path] [extra nvcc flags...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/torch_sparse_indexer/_C/libsparse_indexer_topk.so}"
shift || true
mkdir -p "$(dirname "$out")"
"${NVCC:-nvcc}" -O3 -std=c++17 --shared -Xcompiler -fPIC -cudart static --threads 0 \
  -gencode arch=compute_90a,code=sm_90a \
  -gencode arch=compute_100a,code=sm_100a \
  -gencode arch=compute_90,code=compute_90 \
  "$@" "$root/csrc/topk.cu" -o "$out"
echo "built $out"
