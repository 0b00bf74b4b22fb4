#!/usr/bin/env bash
# Builds benchmarks/baselines/flashinfer_topk.cu against a FlashInfer checkout, for the top-k suite's public
# baseline (the issue asks for "the fastest public per-row top-k you can build here").
#   bash benchmarks/baselines/build_flashinfer_topk.sh SRC [OUT.so]
# SRC: a FlashInfer work tree, or a bare git directory (e.g. the agent tools' mirror
# /work/.mirror/flashinfer-ai+flashinfer/repo), whose include/ is extracted. OUT defaults to
# .deps/flashinfer_topk/libtsi_fi_topk.so (ignored by git; carry it to the GPU machine). The suite loads it from
# there or from $TSI_FLASHINFER_TOPK_LIB. sm_90a only (our test GPU); about 25 s on this machine.
set -euo pipefail
SRC=${1:?usage: build_flashinfer_topk.sh FLASHINFER_SRC [OUT.so]}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${2:-$HERE/../../.deps/flashinfer_topk/libtsi_fi_topk.so}
mkdir -p "$(dirname "$OUT")"
INC=$(mktemp -d)
trap 'rm -rf "$INC"' EXIT
if [ -d "$SRC/include/flashinfer" ]; then
  cp -r "$SRC/include" "$INC/"
  REV=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)
else
  git --git-dir="$SRC" archive HEAD include | tar -x -C "$INC"
  REV=$(git --git-dir="$SRC" rev-parse HEAD)
fi
nvcc -O3 -std=c++17 --shared -Xcompiler -fPIC -cudart static --expt-relaxed-constexpr \
  -gencode arch=compute_90a,code=sm_90a -I"$INC/include" "$HERE/flashinfer_topk.cu" -o "$OUT"
echo "$REV" > "$OUT.rev"
echo "built $OUT (FlashInfer $REV)"
