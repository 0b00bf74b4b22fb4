#!/usr/bin/env bash
# The second staged device call (benchmarks/NOTES.md, "Session 20"), ~7 minutes, in priority order: the MXFP4
# decode copy-depth probe (the copies-only ablation at depths 3, 4, 6: scripts/sweep_cuda_decode.py), an Nsight
# Compute profile of the CUDA MXFP4 sparse decode kernel (stall reasons and hot SASS regions, summarised on the
# device: the report stays there), then compute-sanitizer racecheck and memcheck on every GPU op (the three-CTA
# top-k kernel forced on among them). Prepare here: csrc/build.sh, KIND=scoring bash benchmarks/build_variants.sh
# ablate_compute, bash benchmarks/pack_carry.sh; then on the device, carrying [".carry", ".whl"]:
# bash benchmarks/gpu_probe.sh
set -u
source "$(dirname "$0")/device_common.sh"
v=torch_sparse_indexer/_C/scoring_variant_ablate_compute.so
[ -f $v ] && fits 200 "depth probe" && SWEEP_DEPTHS=0,3,6 timeout 200 python3 scripts/sweep_cuda_decode.py $v \
  > "$OUT/sweep.log" 2>&1; grep -sE "calc_diff|mxfp4" "$OUT/sweep.log" | cut -c1-200
if [ -n "$NCU" ] && fits 120 "ncu"; then
  timeout 120 "$NCU" --clock-control none --set full -k regex:decode_kernel --launch-skip 2 --launch-count 1 \
    -f -o /tmp/mx python3 scripts/ncu_scoring.py sparse mxfp4 cuda > "$OUT/ncu.log" 2>&1
  "$NCU" -i /tmp/mx.ncu-rep --page source --csv --print-source sass > /tmp/k.csv 2>/dev/null &&
    python3 scripts/ncu_hot.py /tmp/k.csv 12 | tee "$OUT/ncu_hot.txt"
  "$NCU" -i /tmp/mx.ncu-rep --page details --csv > "$OUT/ncu_details.csv" 2>/dev/null
  python3 scripts/ncu_hot.py --details "$OUT/ncu_details.csv"
fi
fits 240 "sanitizer" && OUT=$OUT/san SAN_QUICK=1 SAN_TOOL_S=110 timeout 240 bash scripts/sanitize.sh racecheck memcheck \
  2>&1 | tail -n 8
echo "elapsed ${SECONDS} s"
