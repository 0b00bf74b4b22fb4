"""The DeepGEMM backend on a GPU (skipped without CUDA or without an importable ``deep_gemm`` >= 2.8).

Dense scoring through DeepGEMM (SM90 here; the H200 is what we have) must equal the reference backend on
the same quantized inputs (``calc_diff < 1e-5`` with identical -inf patterns, including out-of-contract
lengths, request ids and page ids); the end-to-end ops must select exactly what our top-k selects on the
very scores DeepGEMM produced; a step using them must compile with ``fullgraph=True`` and replay in a CUDA
graph with new data. The copy-back kernels of the sparse (SM100-only) path are checked here on synthetic
DeepGEMM-layout buffers built by the fake kernel of ``test_deepgemm_translate``.
"""
from __future__ import annotations

import logging

import pytest
import torch

from torch_sparse_indexer import backends, reference, testing, workspace
from torch_sparse_indexer.kernels import deepgemm as dgb
from torch_sparse_indexer.kernels import deepgemm_translate as tr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_ops = torch.ops.sparse_indexer
DEV = "cuda"


@pytest.fixture
def dg_arch():
    why = dgb.unavailable_reason()
    if why:
        pytest.skip(why)
    dgb.register()
    return dgb._arch(torch.device(DEV))


@pytest.fixture
def sm90(dg_arch):
    if dg_arch != "sm90":
        pytest.skip("the dense DeepGEMM path is verified on SM90 (the SM100 path is untested on hardware)")
    return dg_arch


def _both(op, args, out_index):
    """Run ``op`` with the DeepGEMM backend forced and with the reference; return both outputs."""
    outs = []
    for name in ("deepgemm", "reference"):
        a = list(args)
        o = a[out_index]
        a[out_index] = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).fill_(float("nan"))
        with backends.use_backend(name):
            op(*a)
        outs.append(a[out_index])
    torch.cuda.synchronize()
    return outs


# ----------------------------------------------------------------------------------------------------
# Dense scoring vs the reference
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H,D", [(64, 128), (32, 64)])
@pytest.mark.parametrize("ldtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_prefill_scores_match_reference(sm90, H, D, ldtype, wdtype, gen):
    T, N, L = 67, 1500, 700
    qs = testing.make_queries(T, H, D, "fp8", device=DEV, gen=gen)
    k, ksc = testing.make_packed_k(N, D, "fp8", device=DEV, gen=gen, pow2_scale=False)
    ks = torch.randint(-10, N, (T,), generator=gen)
    ke = ks + torch.randint(-5, L, (T,), generator=gen)
    ks[0], ke[0] = 0, N + 50          # past N (and longer than the width): clamped
    ks[1], ke[1] = 1400, 1400 + 650   # clamped to N
    ks[2], ke[2] = 3, 3               # empty
    ks, ke = ks.to(torch.int32).to(DEV), ke.to(torch.int32).to(DEV)
    out = torch.empty(T, L + 37, dtype=ldtype, device=DEV)[:, 3:3 + L]   # caller's row-strided buffer
    args = (qs.q, None, k, ksc, qs.weights.to(wdtype), ks, ke, out)
    assert backends.select("mqa_logits", *args).name == "deepgemm"
    got, want = _both(_ops.mqa_logits, args, 7)
    d = testing.calc_diff(got, want)
    assert d < 1e-5, d
    again = got.clone()
    with backends.use_backend("deepgemm"):
        _ops.mqa_logits(*args[:7], again)
    testing.assert_bitwise_equal(again, got)


@pytest.mark.parametrize("with_req", [False, True])
def test_decode_scores_match_reference(sm90, with_req, gen):
    H, D, BS = 64, 128, 64
    lens = [1, 64, 65, 300, 1000, 0, 2049]
    case = testing.make_paged_cache(lens, BS, D, "fp8", device=DEV, gen=gen, max_blocks=40)
    nb = case.kv_cache.shape[0]
    bt = case.block_table.clone()
    bt[3, 2] = nb + 5                 # page id past the cache inside the context
    bt[4, 0] = -1
    if with_req:
        req = torch.tensor([0, 3, 3, 4, 6, 6, 9, -1, 2, 1], dtype=torch.int32, device=DEV)
        ctx = torch.tensor([1, 290, 300, 1000, 2000, 2049, 50, 50, 65, 5000], dtype=torch.int32, device=DEV)
    else:
        req = None
        ctx = torch.tensor([1, 64, 65, 300, 1000, -3, 3000], dtype=torch.int32, device=DEV)  # negative, past table
    R, L = ctx.shape[0], 2600
    qs = testing.make_queries(R, H, D, "fp8", device=DEV, gen=gen)
    out = torch.empty(R, L + 5, device=DEV)[:, :L]
    args = (qs.q, None, case.kv_cache, qs.weights, ctx, bt, req, out)
    # SM90: automatic dispatch leaves dense decode to our faster Triton kernel (deepgemm.defer_decode); forced here.
    assert backends.select("paged_mqa_logits", *args).name == "triton"
    got, want = _both(_ops.paged_mqa_logits, args, 7)
    d = testing.calc_diff(got, want)
    assert d < 1e-5, d


def test_dg_output_strides_are_as_documented(sm90, gen):
    """Our statement of DeepGEMM's padded layouts (used in docs and the fake) matches what it allocates."""
    dg = dgb.deep_gemm()
    T, N, L = 8, 300, 257
    qs = testing.make_queries(T, 64, 128, "fp8", device=DEV, gen=gen)
    k, ksc = testing.make_packed_k(N, 128, "fp8", device=DEV, gen=gen)
    ks = torch.zeros(T, dtype=torch.int32, device=DEV)
    ke = torch.full((T,), L, dtype=torch.int32, device=DEV)
    out = dg.fp8_fp4_mqa_logits((qs.q, None), (k, ksc), qs.weights, ks, ke, L)
    assert out.shape == (T, L) and out.dtype == torch.float32 and out.stride(0) == tr.prefill_logits_stride(L, "sm90")
    case = testing.make_paged_cache([100] * T, 64, 128, "fp8", device=DEV, gen=gen)
    ctx = torch.full((T, 1), 100, dtype=torch.int32, device=DEV)
    meta = dg.get_paged_mqa_logits_metadata(ctx, 64, dg.get_num_sms())
    assert tuple(meta.shape) == tr.schedule_metadata_shape(dg.get_num_sms())
    out = dg.fp8_fp4_paged_mqa_logits((qs.q.view(T, 1, 64, 128), None), case.kv_cache.unsqueeze(2), qs.weights, ctx,
                                      case.block_table, meta, L)
    assert out.shape == (T, L) and out.stride(0) == tr.paged_logits_stride(L, "sm90")


# ----------------------------------------------------------------------------------------------------
# End-to-end ops: top-k runs directly on DeepGEMM's padded buffer
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("small_ws", [False, True])
def test_indexer_decode_selects_exactly_on_dg_scores(sm90, small_ws, gen):
    H, D, BS, R, MAXC, TOPK, CBS, NBK = 64, 128, 64, 16, 5120, 256, 16, 64
    lens = [int(x) for x in torch.randint(1, MAXC, (R,), generator=gen)]
    lens[0], lens[1] = 100, MAXC       # fewer than k valid positions; a full row
    case = testing.make_paged_cache(lens, BS, D, "fp8", device=DEV, gen=gen)
    bt = case.block_table.clone()
    bt[2, 1] = -1                      # an invalid page inside a row: -inf there, like the reference
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qs = testing.make_queries(R, H, D, "fp8", device=DEV, gen=gen)
    budget = 5 * workspace.row_stride(MAXC) * 4 if small_ws else workspace.DEFAULT_LOGITS_BUDGET
    ws = torch.empty(workspace.dense_workspace_bytes(R, MAXC, budget), dtype=torch.uint8, device=DEV)
    idx = torch.empty(R, TOPK, dtype=torch.int32, device=DEV)
    cand = torch.empty(R, NBK, dtype=torch.int32, device=DEV)
    args = (qs.q, None, case.kv_cache, qs.weights, ctx, bt, None, MAXC, TOPK, CBS, ws, idx, cand)
    assert backends.select("indexer_decode", *args).name == "reference"  # the composition: see defer_decode
    with backends.use_backend("deepgemm"):
        assert backends.select("indexer_decode", *args).name == "deepgemm"
        _ops.indexer_decode(*args)
    # The scores DeepGEMM produced, through our scoring op (deterministic, bitwise the same values).
    logits = torch.empty(R, MAXC, device=DEV)
    with backends.use_backend("deepgemm"):
        _ops.paged_mqa_logits(qs.q, None, case.kv_cache, qs.weights, ctx, bt, None, logits)
    n = torch.tensor([min(x, MAXC) for x in lens], dtype=torch.int32, device=DEV)
    want_idx = torch.empty_like(idx)
    want_cand = torch.empty_like(cand)
    reference.topk(logits, n, TOPK, want_idx)
    reference.block_topk(logits, n, CBS, want_cand)
    assert torch.equal(idx, want_idx)
    assert torch.equal(cand, want_cand)
    # Against the fully composed reference: the selected scores agree within the scoring tolerance.
    ref_logits = torch.empty_like(logits)
    with backends.use_backend("reference"):
        _ops.paged_mqa_logits(qs.q, None, case.kv_cache, qs.weights, ctx, bt, None, ref_logits)
    testing.calc_diff(logits, ref_logits)  # asserts identical -inf masks
    ref_idx = torch.empty_like(idx)
    reference.topk(ref_logits, n, TOPK, ref_idx)
    pick = lambda i: torch.where(i >= 0, ref_logits.gather(1, i.clamp(min=0).long()), 0.0).nan_to_num(neginf=0.0)  # noqa: E731
    assert torch.allclose(pick(idx).double().sum(1), pick(ref_idx).double().sum(1), rtol=1e-4, atol=1e-3)


def test_indexer_prefill_selects_exactly_on_dg_scores(sm90, gen):
    H, D, N, TOPK, CBS, NBK, MAXC = 64, 128, 3000, 512, 32, 32, 2048
    # two requests back to back in the packed K, causal rows
    T = 100
    ks = torch.tensor([0] * 50 + [1200] * 50, dtype=torch.int32)
    ke = torch.tensor([1150 + i for i in range(50)] + [1200 + 1750 + i for i in range(50)], dtype=torch.int32)
    ks, ke = ks.to(DEV), ke.to(DEV)
    qs = testing.make_queries(T, H, D, "fp8", device=DEV, gen=gen)
    k, ksc = testing.make_packed_k(N, D, "fp8", device=DEV, gen=gen)
    ws = torch.empty(workspace.dense_workspace_bytes(T, MAXC, 30 * workspace.row_stride(MAXC) * 4), dtype=torch.uint8,
                     device=DEV)
    idx = torch.empty(T, TOPK, dtype=torch.int32, device=DEV)
    cand = torch.empty(T, NBK, dtype=torch.int32, device=DEV)
    args = (qs.q, None, k, ksc, qs.weights, ks, ke, MAXC, TOPK, CBS, ws, idx, cand)
    assert backends.select("indexer_prefill", *args).name == "deepgemm"
    _ops.indexer_prefill(*args)
    logits = torch.empty(T, MAXC, device=DEV)
    with backends.use_backend("deepgemm"):
        _ops.mqa_logits(qs.q, None, k, ksc, qs.weights, ks, ke, logits)
    n = tr.prefill_bounds(ks, ke, N, MAXC).n
    want_idx, want_cand = torch.empty_like(idx), torch.empty_like(cand)
    reference.topk(logits, n, TOPK, want_idx)
    reference.block_topk(logits, n, CBS, want_cand)
    assert torch.equal(idx, want_idx)
    assert torch.equal(cand, want_cand)


# ----------------------------------------------------------------------------------------------------
# torch.compile + CUDA graph
# ----------------------------------------------------------------------------------------------------

def test_compile_fullgraph_and_cuda_graph_replay(sm90, gen):
    H, D, BS, R, MAXC, TOPK, CBS, NBK = 64, 128, 64, 8, 4096, 128, 16, 32
    T, N = 32, 2048
    warmed = dgb.warmup(DEV, H, D, "fp8", block_size=BS, max_rows=R)
    assert warmed, "warmup did nothing"
    lens = [MAXC] * R
    case = testing.make_paged_cache(lens, BS, D, "fp8", device=DEV, gen=gen)
    k, ksc = testing.make_packed_k(N, D, "fp8", device=DEV, gen=gen)

    def inputs():
        qd = testing.make_queries(R, H, D, "fp8", device=DEV, gen=gen)
        qp = testing.make_queries(T, H, D, "fp8", device=DEV, gen=gen)
        ctx = torch.randint(1, MAXC + 1, (R,), generator=gen).to(torch.int32).to(DEV)
        ke = torch.randint(1, N + 1, (T,), generator=gen).to(torch.int32).to(DEV)
        return [qd.q, qd.weights, ctx, qp.q, qp.weights, ke]

    ks = torch.zeros(T, dtype=torch.int32, device=DEV)
    ws = torch.empty(workspace.dense_workspace_bytes(R, MAXC), dtype=torch.uint8, device=DEV)

    def step(qd, wd, ctx, qp, wp, ke, ws, idx, cand, logits):
        _ops.indexer_decode(qd, None, case.kv_cache, wd, ctx, case.block_table, None, MAXC, TOPK, CBS, ws, idx, cand)
        _ops.mqa_logits(qp, None, k, ksc, wp, ks, ke, logits)

    def outputs():
        return [torch.full((R, TOPK), -7, dtype=torch.int32, device=DEV),
                torch.full((R, NBK), -7, dtype=torch.int32, device=DEV), torch.empty(T, N, device=DEV)]

    cstep = torch.compile(step, fullgraph=True, dynamic=False)
    static_in = inputs()
    static_out = outputs()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    # Forced: automatic dispatch would take our own kernels for the decode step on SM90 (defer_decode). The
    # backend is chosen when the ops run (here and in capture); replays run what capture recorded.
    with backends.use_backend("deepgemm"):
        with torch.cuda.stream(s):
            cstep(*static_in, ws, *static_out)          # compiles, and runs once outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            cstep(*static_in, ws, *static_out)
    for _ in range(2):
        new = inputs()
        for a, b in zip(static_in, new):
            a.copy_(b)
        g.replay()
        want = outputs()
        with backends.use_backend("deepgemm"):
            step(*new, torch.empty_like(ws), *want)     # eager, on the same new data
        torch.cuda.synchronize()
        assert torch.equal(static_out[0], want[0])
        assert torch.equal(static_out[1], want[1])
        testing.assert_bitwise_equal(static_out[2], want[2])


# ----------------------------------------------------------------------------------------------------
# Refusals and logging on this GPU
# ----------------------------------------------------------------------------------------------------

def test_refuses_what_dg_cannot_run_here(dg_arch, gen):
    if dg_arch != "sm90":
        pytest.skip("SM90 refusals")
    qs = testing.make_queries(4, 16, 128, "fp8", device=DEV, gen=gen)
    k, ksc = testing.make_packed_k(64, 128, "fp8", device=DEV, gen=gen)
    ks = torch.zeros(4, dtype=torch.int32, device=DEV)
    ke = torch.full((4,), 64, dtype=torch.int32, device=DEV)
    args = (qs.q, None, k, ksc, qs.weights, ks, ke, torch.empty(4, 64, device=DEV))
    assert "heads" in dgb.supports_mqa_logits(*args)
    assert backends.select("mqa_logits", *args).name != "deepgemm"
    with backends.use_backend("deepgemm"), pytest.raises(NotImplementedError, match="heads"):
        _ops.mqa_logits(*args)
    q4 = testing.make_queries(4, 64, 128, "mxfp4", device=DEV, gen=gen)
    k4, ks4 = testing.make_packed_k(64, 128, "mxfp4", device=DEV, gen=gen)
    assert "FP8" in dgb.supports_mqa_logits(q4.q, q4.q_scale, k4, ks4, q4.weights, ks, ke, args[-1])
    case = testing.make_paged_cache([40] * 4, 32, 128, "fp8", device=DEV, gen=gen)
    q8 = testing.make_queries(4, 64, 128, "fp8", device=DEV, gen=gen)
    assert "block_size 64" in dgb.supports_paged_mqa_logits(q8.q, None, case.kv_cache, q8.weights, ke, case.block_table,
                                                            None, args[-1])
    cand = testing.random_candidates([64] * 4, 4, 8, device=DEV)
    assert "SM100" in dgb.supports_sparse_mqa_logits(q4.q, q4.q_scale, k4, ks4, q4.weights.bfloat16(), ks, ke, cand,
                                                      8, torch.empty(4, 32, device=DEV))


def test_choice_is_logged_once(sm90, gen, caplog):
    qs = testing.make_queries(4, 64, 128, "fp8", device=DEV, gen=gen)
    k, ksc = testing.make_packed_k(64, 128, "fp8", device=DEV, gen=gen)
    ks = torch.zeros(4, dtype=torch.int32, device=DEV)
    ke = torch.full((4,), 64, dtype=torch.int32, device=DEV)
    args = (qs.q, None, k, ksc, qs.weights, ks, ke, torch.empty(4, 64, device=DEV))
    backends._logged.discard(("mqa_logits", "deepgemm"))
    with caplog.at_level(logging.INFO, logger="torch_sparse_indexer"):
        _ops.mqa_logits(*args)
        _ops.mqa_logits(*args)
    hits = [r for r in caplog.records if "mqa_logits: using backend 'deepgemm'" in r.getMessage()]
    assert len(hits) == 1


def test_sm90_decode_defers_to_our_kernels_unless_forced_or_triton_disabled(sm90, gen):
    """Automatic dispatch on SM90 passes DeepGEMM's dense decode entries over for our Triton kernel (faster, run
    117); forcing DeepGEMM, or disabling the Triton backend, runs DeepGEMM again; prefill stays on DeepGEMM."""
    case = testing.make_paged_cache([300, 1000], 64, 128, "fp8", device=DEV, gen=gen)
    qs = testing.make_queries(2, 64, 128, "fp8", device=DEV, gen=gen)
    ctx = torch.tensor([300, 1000], dtype=torch.int32, device=DEV)
    args = (qs.q, None, case.kv_cache, qs.weights, ctx, case.block_table, None, torch.empty(2, 1024, device=DEV))
    assert "faster" in dgb.defer_decode(*args)
    assert backends.select("paged_mqa_logits", *args).name == "triton"
    with backends.use_backend("deepgemm"):
        assert backends.select("paged_mqa_logits", *args).name == "deepgemm"
    backends.disable_backend("triton")
    try:
        assert dgb.defer_decode(*args) is None
        assert backends.select("paged_mqa_logits", *args).name == "deepgemm"
    finally:
        backends.disable_backend("triton", False)
    k, ksc = testing.make_packed_k(64, 128, "fp8", device=DEV, gen=gen)
    z = torch.zeros(2, dtype=torch.int32, device=DEV)
    pre = (qs.q, None, k, ksc, qs.weights, z, z + 64, torch.empty(2, 64, device=DEV))
    assert backends.select("mqa_logits", *pre).name == "deepgemm"


# ----------------------------------------------------------------------------------------------------
# Copy-back kernels of the sparse path (SM100-only in production) on synthetic DeepGEMM buffers
# ----------------------------------------------------------------------------------------------------

def test_sparse_copy_kernels_on_synthetic_dg_output(gen):
    if dgb.triton is None:
        pytest.skip("needs triton")
    from test_deepgemm_translate import (_messy_candidates, _page_value, expected_sparse_paged,
                                         fake_dg_sparse_paged)
    cbs, bs, R, nb = 32, 64, 7, 6
    lens = [int(x) for x in torch.randint(0, 5 * bs, (R,), generator=gen)]
    case = testing.make_paged_cache(lens, bs, 64, "mxfp4", gen=gen, max_blocks=5)
    num_pages = case.kv_cache.shape[0]
    bt = case.block_table.clone()
    bt[0, 0] = num_pages + 3
    ctx = torch.tensor(lens, dtype=torch.int32)
    req = torch.tensor([0, 0, 1, 9, 3, 3, 6], dtype=torch.int32)
    cand = _messy_candidates(R, nb, 5 * bs // cbs, gen, well_formed=False)
    rows = tr.decode_rows(ctx, bt, req, bs, num_pages)
    t = tr.translate_candidates(cand, cbs, rows.n)
    dg_out = fake_dg_sparse_paged(t.indices, rows.n, rows.block_table, bs, t.sbk, _page_value).float()
    want = expected_sparse_paged(cand, cbs, ctx, bt, req, bs, num_pages).float()
    cu = lambda x: x.to(DEV)  # noqa: E731
    t_cu = tr.SparseTranslation(*[cu(x) if isinstance(x, torch.Tensor) else x for x in t])
    src = torch.full((R, 512), float("nan"), device=DEV)
    src[:, : dg_out.shape[1]] = cu(dg_out)
    got = torch.empty(R, nb * cbs + 9, device=DEV)[:, : nb * cbs]
    dgb.copy_sparse(src, got, t_cu, cu(cand), cbs, cu(rows.n), paged=(cu(bt), cu(rows.req), bs, num_pages))
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    # In-place page patch on DeepGEMM's own layout: blocks on bad pages become -inf, nothing else changes.
    buf = src.clone()
    dgb.patch_sparse_bad_pages(buf, t_cu.dg_candidates, t.sbk, cu(bt), cu(rows.req), bs, num_pages)
    pos = tr.sparse_positions(t.dg_candidates, t.sbk)
    bad = (pos >= 0) & ~tr.page_valid(bt, rows.req, pos.clamp(min=0), bs, num_pages)
    exp = src.cpu().clone()
    exp[:, : pos.shape[1]][bad] = float("-inf")
    assert torch.equal(buf.cpu().nan_to_num(123.0), exp.nan_to_num(123.0))
