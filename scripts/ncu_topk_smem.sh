#!/usr/bin/env bash
# Nsight Compute on the shared-memory-row top-k kernels (development; a device call, carrying [".carry", ".whl"]):
# topk 4096 x 16K and sparse_topk 4096 x 2048 blocks of 8 (scripts/ncu_topk.py), each summarised on the device by
# scripts/ncu_hot.py (hot SASS regions, stall reasons, samples between barriers) and the headline metrics; the
# SASS source pages come back xz-packed ($OUT/k_dense.csv.xz, k_sparse.csv.xz). Usage: bash scripts/ncu_topk_smem.sh
set -u
source benchmarks/device_common.sh
for shape in "dense 4096 16384" "sparse 4096 2048"; do
  n=$(echo $shape | cut -d' ' -f1)
  timeout 200 "$NCU" --clock-control none --set full --import-source no -k regex:topk_kernel --launch-skip 1 \
    --launch-count 1 -f -o /tmp/$n python3 scripts/ncu_topk.py $shape > "$OUT/ncu_$n.log" 2>&1
  "$NCU" -i /tmp/$n.ncu-rep --page source --csv --print-source sass > "$OUT/k_$n.csv" 2>/dev/null &&
    python3 scripts/ncu_hot.py "$OUT/k_$n.csv" 16 | tee "$OUT/ncu_hot_$n.txt"
  "$NCU" -i /tmp/$n.ncu-rep --page details --csv > "$OUT/ncu_details_$n.csv" 2>/dev/null
  python3 scripts/ncu_hot.py --details "$OUT/ncu_details_$n.csv"
done
xz -9 "$OUT"/k_*.csv
