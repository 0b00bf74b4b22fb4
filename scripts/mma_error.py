"""How far the GPU decode scoring kernels' scores lie from the float32 reference, against the scale of the terms
(development; sizes the tolerance of ``testing.assert_scores_close`` for tensor-core paths). For random paged
cases like ``test_paged_no_req_indices_bf16``: per backend (triton, cuda) and format, the largest
``|out - ref| / mag`` with ``mag`` = the reference on the magnitudes of q, K and w (``testing.score_magnitude``:
an upper bound of every head's |q . k| summed with |w|), and the largest error in bf16 ulps of ``ref`` (f32 and
bf16 outputs). Prints one line per (backend, format, out dtype).
    python3 scripts/mma_error.py [cases]"""
import random
import sys

import torch

import torch_sparse_indexer  # noqa: F401  (registers the ops)
from torch_sparse_indexer import backends, reference, testing
from torch_sparse_indexer.kernels import cuda_scoring

ops = torch.ops.sparse_indexer
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("triton", "cuda") if DEV == "cuda" else ("reference",)  # (CPU: a smoke run of the script)
cases = int(sys.argv[1]) if len(sys.argv) > 1 else 40
cuda_scoring.CONFIG_OVERRIDES["fp8"] = True
for backend in BACKENDS:
    for fmt in ("fp8", "mxfp4"):
        for odt in (torch.float32, torch.bfloat16):
            worst_mag, worst_ulp, worst_rel = 0.0, 0.0, 0.0
            for seed in range(cases):
                rng = random.Random(seed)
                gen = torch.Generator().manual_seed(seed)
                D, H, bs = 128, 64, 64
                seq = [rng.randint(0, 300) for _ in range(rng.randint(1, 6))]
                case = testing.make_paged_cache(seq, bs, D, fmt, device=DEV, gen=gen)
                lens = torch.tensor(seq, dtype=torch.int32, device=DEV)
                qs = testing.make_queries(len(seq), H, D, fmt, device=DEV, gen=gen)
                w = qs.weights.to(torch.bfloat16)
                L = max(seq + [1])
                ref = torch.empty(len(seq), L, device=DEV)
                reference.paged_mqa_logits(qs.q, qs.q_scale, case.kv_cache, w, lens, case.block_table, None, ref)
                mag = testing.score_magnitude("paged_mqa_logits", qs.q, qs.q_scale, case.kv_cache, w, lens,
                                              case.block_table, None, shape=ref.shape)
                out = torch.empty(len(seq), L, device=DEV, dtype=odt)
                with backends.use_backend(backend):
                    ops.paged_mqa_logits(qs.q, qs.q_scale, case.kv_cache, w, lens, case.block_table, None, out)
                if DEV == "cuda":
                    torch.cuda.synchronize()
                fin = torch.isfinite(ref)
                if not fin.any():
                    continue
                r, o, m = ref[fin], out.float()[fin], mag[fin]
                err = (o - r).abs()
                worst_mag = max(worst_mag, float((err / m.clamp_min(1e-30)).max()))
                worst_ulp = max(worst_ulp, float((err / testing.bf16_ulp(r)).max()))
                worst_rel = max(worst_rel, float(err.max() / r.abs().max()))
            print(f"{backend:6s} {fmt:5s} {str(odt):14s} max err/mag {worst_mag:.3e} ({worst_mag * 2 ** 12:.3f} x 2^-12)"
                  f"  max err in bf16 ulps {worst_ulp:.2f}  max err/max|ref| {worst_rel:.2e}", flush=True)
