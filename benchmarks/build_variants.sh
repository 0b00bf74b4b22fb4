#!/usr/bin/env bash
# Builds the top-k library's experimental variants, to be timed against the default build in one device call
# (benchmarks/gpu_check_topk.sh times every torch_sparse_indexer/_C/variant_*.so after the default library).
#   bash benchmarks/build_variants.sh [NAME ...]      (default: every variant in benchmarks/variants/)
# A variant NAME is benchmarks/variants/NAME.patch (a unified diff against csrc/, applied to a copy) and/or
# NAME.flags (extra nvcc flags on one line, e.g. -DTSI_THREADS=1024). Output:
# torch_sparse_indexer/_C/variant_NAME.so (sm_90a only: the H200) plus its ptxas report
# (variant_NAME.ptxas.txt: registers and spills per kernel). Builds run in parallel (~2 min each). Run it here,
# then carry torch_sparse_indexer/_C to the device machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
vdir="$root/benchmarks/variants"
outdir="$root/torch_sparse_indexer/_C"
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
pids=()
for name in "${names[@]}"; do
  [ -e "$vdir/$name.patch" ] || [ -e "$vdir/$name.flags" ] || { echo "unknown variant $name" >&2; exit 2; }
  src="$tmp/$name"
  cp -r "$root/csrc" "$src"
  if [ -e "$vdir/$name.patch" ]; then
    patch -s -d "$src" -p1 < "$vdir/$name.patch"
  fi
  flags=""
  [ -e "$vdir/$name.flags" ] && flags=$(head -n 1 "$vdir/$name.flags")
  # shellcheck disable=SC2086
  ( "${NVCC:-nvcc}" -O3 -std=c++20 --shared -Xcompiler -fPIC -cudart static \
      -gencode arch=compute_90a,code=sm_90a -Xptxas -v $flags "$src/topk.cu" -o "$outdir/variant_$name.so" \
      > "$outdir/variant_$name.ptxas.txt" 2>&1 && echo "built variant_$name.so" \
    || { echo "variant $name failed:"; tail -n 20 "$outdir/variant_$name.ptxas.txt"; exit 1; } ) &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
