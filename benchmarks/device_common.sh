# Sourced by the staged device calls (gpu_staged.sh, gpu_probe.sh): the output folder, the packed libraries
# (benchmarks/pack_carry.sh) unpacked, and `fits SECONDS NAME`, true when a step of that timeout still ends
# within BUDGET seconds of the call's start (a call's limit is 600) and, when ONLY_STEPS is set (a comma-separated
# list of step names, e.g. "roofline,cache bench"), NAME is one of them; else it logs the step to $OUT/skipped.txt.
# NCU: the Nsight Compute binary where the machine has one (else empty).
export OUT=${OUT:-/tmp/tsi-out} PYTHONPATH=. PYTHONUNBUFFERED=1; mkdir -p "$OUT"
[ -f .carry/c.tar.xz ] && tar xJf .carry/c.tar.xz -C torch_sparse_indexer
BUDGET=${BUDGET:-580}
fits() {
  [ -z "${ONLY_STEPS:-}" ] || [[ ",$ONLY_STEPS," == *",$2,"* ]] ||
    { echo "skipped (ONLY_STEPS): $2" >> "$OUT/skipped.txt"; return 1; }
  [ $((SECONDS + $1)) -le "$BUDGET" ] || { echo "skipped (budget): $2" | tee -a "$OUT/skipped.txt"; false; }
}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
