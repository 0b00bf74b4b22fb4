#!/usr/bin/env bash
# Builds experimental variants of a CUDA library, to be timed against the default build in one device call.
#   bash benchmarks/build_variants.sh [NAME ...]               top-k (default: every variant in benchmarks/variants/)
#   KIND=scoring bash benchmarks/build_variants.sh [NAME ...]  decode scoring (benchmarks/variants/scoring/)
# A variant NAME is NAME.patch (a unified diff against csrc/, applied to a copy) and/or NAME.flags (extra nvcc
# flags on one line, e.g. -DTSI_THREADS=1024) in that folder. Output: torch_sparse_indexer/_C/variant_NAME.so
# (top-k; benchmarks/gpu_check_topk.sh times every variant_*.so after the default library) or
# scoring_variant_NAME.so (scripts/sweep_cuda_decode.py takes them as arguments), sm_90a only (the H200), each
# with its ptxas report (*.ptxas.txt: registers and spills per kernel). Builds run in parallel (~1-2 min each).
# Run it here, then carry torch_sparse_indexer/_C to the device machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
outdir="$root/torch_sparse_indexer/_C"
if [ "${KIND:-topk}" = scoring ]; then
  vdir="$root/benchmarks/variants/scoring" srcfile=scoring.cu prefix=scoring_variant_
else
  vdir="$root/benchmarks/variants" srcfile=topk.cu prefix=variant_
fi
mkdir -p "$outdir"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in "$vdir"/*.patch "$vdir"/*.flags; do
    [ -e "$f" ] && names+=("$(basename "${f%.*}")")
  done
  mapfile -t names < <(printf '%s\n' "${names[@]}" | sort -u)
fi
[ ${#names[@]} -gt 0 ] || { echo "no variants in $vdir"; exit 0; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for name in "${names[@]}"; do
  [ -e "$vdir/$name.patch" ] || [ -e "$vdir/$name.flags" ] || { echo "unknown variant $name" >&2; exit 2; }
done
pids=()
rc=0
for name in "${names[@]}"; do
  src="$tmp/$name"
  cp -r "$root/csrc" "$src"
  if [ -e "$vdir/$name.patch" ] && ! patch -s -d "$src" -p1 < "$vdir/$name.patch" > "$tmp/$name.patch.log" 2>&1; then
    echo "variant $name: its patch does not apply to this tree (skipped):"; cat "$tmp/$name.patch.log"
    rc=1
    continue
  fi
  flags=""
  [ -e "$vdir/$name.flags" ] && flags=$(head -n 1 "$vdir/$name.flags")
  # shellcheck disable=SC2086
  ( "${NVCC:-nvcc}" -O3 -std=c++20 --shared -Xcompiler -fPIC -cudart static \
      -gencode arch=compute_90a,code=sm_90a -Xptxas -v $flags "$src/$srcfile" -o "$outdir/$prefix$name.so" \
      > "$outdir/$prefix$name.ptxas.txt" 2>&1 && echo "built $prefix$name.so" \
    || { echo "variant $name failed:"; tail -n 20 "$outdir/$prefix$name.ptxas.txt"; exit 1; } ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
