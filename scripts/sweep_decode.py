"""Launch configurations of the sparse decode scoring kernel at the issue's target shape (development; the
benchmark suite keeps its own fixed sweep). 128 decode rows, context 128K, page 64, 2048 candidate blocks of 8,
built by benchmarks/suite_scoring.py's helpers; every configuration's scores are compared with the default's
(bitwise, else ``calc_diff``; timed only below 1e-6) before it is timed (CUDA-graph replay median, L2 flushed).

    python3 scripts/sweep_decode.py [out.csv]

Rows: ``fmt, config, row_tiles, programs, time_us`` (config = ``triton_scoring._rows_config`` tuple or
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
SWEEP = {
    "fp8": [(None, None), ((128, 4, 3, 64, False, True, None, 3), None), ((128, 4, 3, 64, False, True, None, 3), 32),
            ((128, 4, 3, 64, False, True, None, 3), 26), ((128, 4, 3, 64, False, True, None, 3), 22)],
    "mxfp4": [(None, None)],
}


def main():
    out_csv = sys.argv[1] if len(sys.argv) > 1 else None
    rows = []
    for fmt, items in SWEEP.items():
        cache, bt, lens, qs = ss._decode_setup(B, CTX, fmt)
        cand = ss._cands(B, CTX // ss.CBS, NBK)
        out = torch.empty(B, NBK * ss.CBS, device="cuda")
        fn = lambda: ts.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand,  # noqa: E731
                                                ss.CBS, out)
        fn()
        base = out.clone()
        for cfg, nt in items:
            ts.CONFIG_OVERRIDES.clear()
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
                print(f"{fmt} {cfg} {nt}: failed {e!r}"[:300])
                continue
            full = ts._rows_config(64, fmt == "mxfp4")
            bn = full[0]
            tiles = nt or (ts._row_tiles(B, NBK * ss.CBS, bn, full[3], full[7] * ts._num_sms(out.device))
                           if full[7] else full[3])
            progs = B * -(-(NBK * ss.CBS) // (tiles * bn))
            row = dict(fmt=fmt, config=str(cfg or "default"), row_tiles=nt or f"auto({tiles})", programs=progs,
                       time_us=round(t, 2), bitwise_equal=same, calc_diff=diff)
            rows.append(row)
            print(row, flush=True)
        ts.CONFIG_OVERRIDES.clear()
    if out_csv:
        common.write_csv(rows, out_csv)


if __name__ == "__main__":
    main()
