"""Numeric checks and input generators shared by the tests and the benchmarks (one copy of each).

``calc_diff`` is DeepGEMM's metric ``1 - 2 sum(x y) / sum(x^2 + y^2)`` in float64 after zero-filling
``-inf`` (whose masks must agree exactly). Generators build valid quantized inputs through
:mod:`torch_sparse_indexer.formats`, never through the ops under test.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from . import formats, reference


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error; asserts the ``-inf`` masks are identical and there is no NaN."""
    x = x.double()
    y = y.double()
    mx, my = torch.isneginf(x), torch.isneginf(y)
    if not torch.equal(mx, my):
        bad = (mx != my).nonzero()[:5].tolist()
        raise AssertionError(f"-inf masks differ at {int((mx != my).sum())} entries, e.g. {bad}")
    if torch.isnan(x).any() or torch.isnan(y).any():
        raise AssertionError("NaN in scores")
    x = x.masked_fill(mx, 0)
    y = y.masked_fill(my, 0)
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor shaped like ``x``: the spacing of bfloat16 numbers at ``|x|`` (8 significant bits); 0 at 0."""
    a = x.float().abs()
    _, e = torch.frexp(a)
    return torch.where(a == 0, 0.0, torch.ldexp(torch.ones_like(a), e - 8))


# The fp8 tensor cores (SM90 wgmma, as Triton's tl.dot and csrc/scoring.cu use them) add products of different
# exponents with a narrower adder than float32: on the H200 a score's error reached 1.2e-5 of its terms' magnitude
# (``scripts/mma_error.py``, run 86; MXFP4's folded operands stay exact). The allowance keeps a 5x margin.
TENSOR_CORE_REL = 2.0 ** -14


def assert_scores_close(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5, ctx: str = "",
                        mag: Optional[torch.Tensor] = None) -> None:
    """Kernel scores ``out`` (float32 or bfloat16) against the float32 reference ``ref`` of the same shape:
    ``calc_diff < tol`` (identical ``-inf`` masks, no NaN) and, for a bf16 ``out``, every finite score within one
    bf16 ulp of ``ref``: half an ulp of rounding, the rest for float32 accumulation-order noise that can tip a value
    across a rounding boundary (which is why a comparison with ``ref`` rounded to bf16 can differ by a whole ulp),
    plus 1e-5 of the largest score for that noise on scores that cancel to near zero (tiny ulp, same noise).
    ``mag`` (shaped like ``ref``: each score's sum of ``|w| |q_d k_d|``, see :func:`score_magnitude`) allows each
    score ``TENSOR_CORE_REL * mag`` more: the fp8 tensor cores' accumulation error, which on a score that cancels
    to near zero exceeds both allowances above, and on a case of a few scores moves calc_diff past 1e-5 (calc_diff
    is then taken on the error beyond that allowance). GPU kernels need it; without it the check is as tight as
    CPU float32 noise."""
    if ref.dtype != torch.float32:
        raise AssertionError(f"ref: expected the float32 reference, got {ref.dtype} (a rounded one is no oracle)")
    o = out.float()
    allow = None if mag is None else TENSOR_CORE_REL * mag.to(ref.device, torch.float32)
    if allow is not None:
        diff = o - ref
        excess = (diff.abs() - allow).clamp_min(0)
        d = calc_diff(torch.where(torch.isfinite(ref) & torch.isfinite(o), ref + diff.sign() * excess, o), ref)
    else:
        d = calc_diff(out, ref)
    assert d < tol, f"calc_diff {d:.3g}{' beyond the tensor-core allowance' if mag is not None else ''} {ctx}"
    if out.dtype == torch.bfloat16:
        fin = torch.isfinite(ref)
        r = ref[fin]
        err = (o[fin] - r).abs()
        bound = bf16_ulp(r) + 1e-5 * r.abs().max() if r.numel() else r
        if allow is not None:
            bound = bound + allow[fin]
        bad = err > bound
        worst = float((err / bound).max()) if r.numel() else 0.0
        assert not bad.any(), f"{int(bad.sum())} bf16 scores over one ulp, worst {worst:.3g} ulp {ctx}"


def _abs_bytes(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (e4m3 values, or packed e2m1 pairs) with every sign bit cleared."""
    return (x.view(torch.uint8) & (0x7F if fmt == "fp8" else 0x77)).view(x.dtype)


def magnitude_inputs(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, fmt: str):
    """``(|q|, |kv_cache|, |weights|)``: the same quantized inputs with every sign bit cleared (e4m3 bit 7, or
    bit 3 of each e2m1 nibble; scales are positive already). A scoring op on them gives, per score, the sum over
    heads of ``|w| * sum_d |q_d k_d|``: the scale of the terms that a score's rounding errors are relative to
    (cancellation can make the score itself much smaller)."""
    formats.check_fmt(fmt)
    akv = kv_cache.clone()
    vals, _ = formats.cache_views(akv, fmt)
    vals.copy_(_abs_bytes(vals, fmt))
    return _abs_bytes(q, fmt), akv, weights.abs()


def score_magnitude(op: str, *args, shape) -> torch.Tensor:
    """float32 ``[shape]``: the reference scoring ``op`` (``"paged_mqa_logits"``, ``"paged_sparse_mqa_logits"``,
    ``"mqa_logits"`` or ``"sparse_mqa_logits"``) on the magnitudes of its inputs ``args`` (the op's arguments
    before the output), i.e. each score's sum of ``|w| |q_d k_d|`` (``mag`` of :func:`assert_scores_close`)."""
    q = args[0]
    fmt = "fp8" if q.dtype == formats.FP8_DTYPE else "mxfp4"
    a = list(args)
    if op.startswith("paged"):
        a[0], a[2], a[3] = magnitude_inputs(q, args[2], args[3], fmt)
    else:  # packed K: (q, q_scale, k, k_scale, weights, ...)
        a[0], a[2], a[4] = _abs_bytes(q, fmt), _abs_bytes(args[2], fmt), args[4].abs()
    out = torch.empty(shape, dtype=torch.float32, device=q.device)
    getattr(reference, op)(*a, out)
    return out


def assert_bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.shape != y.shape or x.dtype != y.dtype:
        raise AssertionError(f"shape/dtype differ: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
    xb = x.contiguous().view(torch.uint8)
    yb = y.contiguous().view(torch.uint8)
    if not torch.equal(xb, yb):
        raise AssertionError(f"not bitwise equal: {int((xb != yb).sum())} bytes differ")


def capture_graph(fn: Callable[[], None]) -> "torch.cuda.CUDAGraph":
    """``fn`` run once on a side stream (so lazy initialisation stays out of the capture), then captured
    into a CUDA graph on the current device, which is returned (replay it with ``.replay()``)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def count_bytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ----------------------------------------------------------------------------------------------------
# Input generators
# ----------------------------------------------------------------------------------------------------

@dataclass
class Queries:
    q: torch.Tensor          # fp8 [T, H, D] or uint8 [T, H, D/2]
    q_scale: Optional[torch.Tensor]
    weights: torch.Tensor    # float32 [T, H]


def make_queries(T: int, H: int, D: int, fmt: str, device="cpu", gen: Optional[torch.Generator] = None,
                 scale: float = 1.0) -> Queries:
    q = torch.randn(T, H, D, generator=gen, device="cpu").to(device) * scale
    w = torch.randn(T, H, generator=gen, device="cpu").to(device) * H ** -0.5
    qv, qs, wf = formats.quantize_q(q, w, fmt)
    return Queries(qv, qs, wf)


def make_packed_k(N: int, D: int, fmt: str, device="cpu", gen=None, pow2_scale: bool = True):
    x = torch.randn(N, D, generator=gen, device="cpu").to(device)
    return formats.quantize_rows(x, fmt, pow2_scale)


@dataclass
class PagedCase:
    kv_cache: torch.Tensor                 # uint8 [NB, BS, bpt]
    block_table: torch.Tensor              # int32 [num_reqs, max_blocks]
    seq_lens: list[int]                    # per request
    fmt: str
    head_dim: int
    block_size: int
    extra: dict = field(default_factory=dict)


def make_paged_cache(seq_lens: Sequence[int], block_size: int, D: int, fmt: str, device="cpu", gen=None,
                     max_blocks: Optional[int] = None, spare_blocks: int = 2, stale: bool = False,
                     rows: Optional[Callable[[int], torch.Tensor]] = None) -> PagedCase:
    """A cache holding K for each request, pages shuffled; table entries past a request's pages are -1, or
    with ``stale`` ids of real pages half the time (engines leave stale ids there).

    ``rows(n)`` gives the ``[n, D]`` float rows to quantize into the ``n`` token slots (default: Gaussian)."""
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    mb = max_blocks or max([1] + need)
    total = sum(need) + spare_blocks
    cache = formats.allocate_k_cache(total, block_size, D, fmt, device)
    vals_v, scales_v = formats.cache_views(cache, fmt)
    x = rows(total * block_size) if rows is not None else torch.randn(total * block_size, D, generator=gen)
    v, s = formats.quantize_rows(x.to(device), fmt)
    vals_v.view(torch.uint8).copy_(v.view(torch.uint8).view(total, block_size, -1))
    scales_v.copy_(s.view(total, block_size))
    perm = torch.randperm(total, generator=gen).tolist()
    bt = torch.full((len(seq_lens), mb), -1, dtype=torch.int32)
    it = iter(perm)
    for r, nb in enumerate(need):
        for b in range(nb):
            bt[r, b] = next(it)
        if stale:
            for b in range(nb, mb):
                if torch.rand(1, generator=gen).item() < 0.5:
                    bt[r, b] = perm[torch.randint(0, total, (1,), generator=gen).item()]
    return PagedCase(cache, bt.to(device), list(seq_lens), fmt, D, block_size)


def random_candidates(lengths: Sequence[int], num_blocks: int, cbs: int, gen=None, device="cpu",
                      cluster: bool = False) -> torch.Tensor:
    """int32 [R, num_blocks]: per row ``min(num_blocks, ceil(n / cbs))`` distinct ascending block ids in
    ``[0, ceil(n / cbs))``, then -1 (the candidate-list contract)."""
    out = torch.full((len(lengths), num_blocks), -1, dtype=torch.int32)
    for r, n in enumerate(lengths):
        nbk = (n + cbs - 1) // cbs
        m = min(num_blocks, nbk)
        if m == 0:
            continue
        if cluster and nbk > m:
            start = int(torch.randint(0, nbk - m + 1, (1,), generator=gen))
            ids = torch.arange(start, start + m)
        else:
            ids = torch.randperm(nbk, generator=gen)[:m].sort().values
        out[r, :m] = ids.to(torch.int32)
    return out.to(device)


EMULATED_OPS = ("mqa_logits", "sparse_mqa_logits", "paged_mqa_logits", "paged_sparse_mqa_logits", "write_k_cache",
                "gather_k", "quantize_q", "topk", "sparse_topk", "block_topk")


def register_cpu_emulation(topk_lib: Optional[str] = None, ops: Sequence[str] = EMULATED_OPS) -> None:
    """Developer hook: run the GPU kernels' own logic on CPU tensors. Registers the Triton kernels of ``ops``
    (``TRITON_INTERPRET=1`` must be set before triton is imported) and, given ``topk_lib`` (a CPU emulation
    build from ``csrc/emu/build_emu.sh``), the CUDA top-k kernels, as backends that accept any tensor. Logic
    only: interpreter numerics are not the GPU's. Used by ``tests/test_fuzz.py`` (``TSI_FUZZ_EMULATE``) and
    ``scripts/emulated_gpu_example.py``."""
    from . import backends
    from .kernels import triton_cache as tc, triton_scoring as ts

    fns = {"mqa_logits": ts.mqa_logits, "sparse_mqa_logits": ts.sparse_mqa_logits,
           "paged_mqa_logits": ts.paged_mqa_logits, "paged_sparse_mqa_logits": ts.paged_sparse_mqa_logits,
           "write_k_cache": tc.write_k_cache, "gather_k": tc.gather_k, "quantize_q": tc.quantize_q}
    if topk_lib:
        from .kernels import cuda_topk as ct
        ct.load(topk_lib)
        fns.update(topk=ct.topk, sparse_topk=ct.sparse_topk, block_topk=ct.block_topk)
    for op in ops:
        if op in fns:
            backends.register(op, "cuda" if op.endswith("topk") else "triton", fns[op],
                              priority=20 if op.endswith("topk") else 10)
