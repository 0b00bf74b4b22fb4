"""Launch configurations of the decode scoring kernels at the issue's target shapes (development; the benchmark
suite keeps its own fixed sweep). 128 decode rows, context 128K, page 64 (sparse: 2048 candidate blocks of 8),
built by benchmarks/suite_scoring.py's helpers; every configuration's scores are compared with the default's
(bitwise, else ``calc_diff``; timed only below 1e-6) before it is timed (CUDA-graph replay median, L2 flushed).

    [TSI_SWEEP_ONLY=sparse-mxfp4,...] python3 scripts/sweep_decode.py [out.csv]

Rows: ``kind, fmt, config, row_tiles, programs, time_us`` (config = ``triton_scoring._rows_config`` tuple or
``default``; row_tiles ``auto`` = the launcher's wave sizing)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import common  # noqa: E402
import suite_scoring as ss  # noqa: E402
from torch_sparse_indexer import testing  # noqa: E402
from torch_sparse_indexer.kernels import triton_scoring as ts  # noqa: E402

B, CTX, NBK = 128, 131072, 2048
DENSE = (128, 4, 2, 32, True, False, 96, 5)  # dense decode, up to 32 tiles per program, 5 CTAs per SM
# the folded kernel: other depths, caps and tile counts
QF_VARIANTS = [(128, 4, 4, 32, False, True, 168, 3), (128, 4, 3, 32, False, True, 160, 3),
               (128, 4, 3, 32, False, True, 184, 2), (64, 4, 3, 64, False, True, 120, 4)]
QF_DENSE = [(128, 4, 3, 16, False, False, 168, 3), (128, 4, 3, 16, True, False, 168, 3),
            (64, 4, 3, 16, True, False, 128, 4)]
SWEEP = {
    ("sparse", "fp8"): [(None, None)],
    ("sparse", "mxfp4"): [(None, None), (None, None, {"qfold": False})]
    + [(cfg, None) for cfg in QF_VARIANTS],
    ("dense", "mxfp4"): [(None, None)] + [(cfg, None) for cfg in QF_DENSE] + [(None, None, {"qfold": False})],
    ("dense", "fp8"): [(None, None), (DENSE, None), (DENSE, 16), (DENSE, 20), (DENSE, 32)],
}


def main():
    out_csv = sys.argv[1] if len(sys.argv) > 1 else None
    rows = []
    only = os.environ.get("TSI_SWEEP_ONLY")  # e.g. "sparse-mxfp4"
    for (kind, fmt), items in SWEEP.items():
        if only and f"{kind}-{fmt}" not in only.split(","):
            continue
        fn, out = ss.decode_call(kind, fmt, B, CTX, NBK)
        width = out.shape[1]
        fn()
        base = out.clone()
        for item in items:
            cfg, nt = item[:2]
            ts.CONFIG_OVERRIDES.clear()
            ts.CONFIG_OVERRIDES.update(item[2] if len(item) > 2 else {})
            if cfg is not None:
                ts.CONFIG_OVERRIDES["rows"] = cfg
            if nt is not None:
                ts.CONFIG_OVERRIDES["row_tiles"] = nt
            try:
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                same = torch.equal(out, base)
                diff = 0.0 if same else testing.calc_diff(out, base)
                t = common.time_us(fn) if diff < 1e-6 else float("nan")
            except Exception as e:  # noqa: BLE001
                print(f"{kind} {fmt} {cfg} {nt}: failed {e!r}"[:300])
                continue
            full = ts._rows_config(64, fmt == "mxfp4", True, kind == "sparse", True,
                                   fmt == "mxfp4" and ts.CONFIG_OVERRIDES.get("qfold", True))
            bn = full[0]
            tiles = ts._program_tiles(B, width, bn, full[3], full[7], out.device)
            progs = B * -(-width // (tiles * bn))
            row = dict(kind=kind, fmt=fmt, config=str(cfg or "default") + (f" {item[2]}" if len(item) > 2 else ""),
                       row_tiles=nt or f"auto({tiles})",
                       programs=progs, time_us=round(t, 2), bitwise_equal=same, calc_diff=diff)
            rows.append(row)
            print(row, flush=True)
        ts.CONFIG_OVERRIDES.clear()
        del fn, out, base
        torch.cuda.empty_cache()
    if out_csv:
        common.write_csv(rows, out_csv)


if __name__ == "__main__":
    main()
