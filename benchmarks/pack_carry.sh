#!/usr/bin/env bash
# Prepares what a device call carries (run here, after building the libraries and variants):
#   .carry/c.tar.xz  torch_sparse_indexer/_C packed with xz (the default libraries, variants and phase build are
#                    ~70 MB, over the 64 MiB a call may carry; packed ~11 MB). gpu_final.sh and gpu_check_topk.sh
#                    unpack it first when it is there.
#   .whl/            expecttest (the one test dependency the device image lacks; its package list: KINDS.md)
#   .deps/deepgemm   DeepGEMM 2.8.2's source and headers (../shared/tools/deepgemm-fetch.sh), for its suite/tests
# Then: carry [".carry", ".whl", ".deps/deepgemm"]. Usage: bash benchmarks/pack_carry.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
if ! ls .whl/expecttest-*.whl >/dev/null 2>&1; then
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl expecttest
fi
if [ ! -f .deps/deepgemm/deepinfer_gemm-2.8.2.tar.gz ] && [ -f ../shared/tools/deepgemm-fetch.sh ]; then
  PATH="$(cd "$(dirname "$(command -v "$py")")" && pwd):$PATH" bash ../shared/tools/deepgemm-fetch.sh .deps/deepgemm > /dev/null \
    || echo "DeepGEMM not fetched (its suite and tests will skip on the device)"
fi
mkdir -p .carry
tar cJf .carry/c.tar.xz -C torch_sparse_indexer _C
du -sh .carry .whl .deps/deepgemm 2>/dev/null
