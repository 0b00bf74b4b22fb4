"""Every op against the independent float64 oracle (tests/oracle.py) on fresh random inputs.

Scores: the op's float32 (or bf16) output within a worst-case float32 accumulation bound of the float64
oracle (bit-equal on ``exact`` data), identical ``-inf`` masks, no NaN. Selections: exactly equal to the
oracle's selection on the same logits (selection ops) or on exact data (end-to-end ops).
"""
from __future__ import annotations

import pytest
import torch

from torch_sparse_indexer import backends, formats, workspace
from torch_sparse_indexer.testing import calc_diff

import cases
import oracle

ops = torch.ops.sparse_indexer

# (fmt, H, D, cache block size, candidate block size): every H x D per format, both block sizes of each kind.
SCORE_CASES = [
    ("fp8", 4, 64, 16, 8), ("fp8", 8, 128, 64, 16), ("fp8", 64, 64, 64, 8),
    ("fp8", 64, 128, 16, 16), ("fp8", 4, 128, 64, 8), ("fp8", 8, 64, 16, 16),
    ("mxfp4", 4, 64, 64, 16), ("mxfp4", 8, 128, 16, 8), ("mxfp4", 64, 64, 16, 16),
    ("mxfp4", 64, 128, 64, 8), ("mxfp4", 4, 128, 16, 8), ("mxfp4", 8, 64, 64, 16),
]
CASE_IDS = [f"{f}-H{h}-D{d}-bs{b}-cbs{c}" for f, h, d, b, c in SCORE_CASES]
MODES = [pytest.param(True, id="exact"), pytest.param(False, id="random")]


def _variant(case):
    """Per-case variations so the grid also covers bf16 weights, int8-viewed fp4 and 4-D cache views."""
    fmt, H, D, bs, cbs = case
    return dict(wdtype=torch.bfloat16 if H == 8 else torch.float32,
                int8=(fmt == "mxfp4" and D == 64),
                cache4d=(bs == 64 and H != 64))


def uses_kernel(op, *args):
    """Whether dispatch picks a GPU kernel (not the reference) for this call."""
    return backends.select(op, *args).name != "reference"


def assert_scores(got, orc, mag, D, H, exact, kernel=False, ctx=""):
    """``got`` (float32 or bf16) vs the float64 oracle: same -inf mask, no NaN, within
    ``(D + H + 2) * 2^-24 * sum|terms|`` (plus bf16 output rounding), bit-equal on exact data. A GPU
    kernel (``kernel``) on generic data may accumulate in another order or precision: SPEC section 7's
    ``calc_diff < 1e-5`` applies to it instead of the float32 bound."""
    g = got.detach().cpu().double()
    assert g.shape == orc.shape, ctx
    assert not torch.isnan(g).any(), f"NaN in scores {ctx}"
    assert torch.equal(torch.isneginf(g), torch.isneginf(orc)), f"-inf masks differ {ctx}"
    fin = ~torch.isneginf(orc)
    if kernel and not exact:
        assert calc_diff(g, orc) < 1e-5, ctx
        return
    if exact and got.dtype == torch.float32:
        assert torch.equal(g[fin], orc[fin]), f"exact scores differ {ctx}: max err {(g[fin] - orc[fin]).abs().max()}"
        return
    tol = (D + H + 2) * 2.0 ** -24 * mag[fin] + 1e-30
    if got.dtype == torch.bfloat16:
        tol = tol + orc[fin].abs() * 2.0 ** -8
    err = (g[fin] - orc[fin]).abs()
    assert torch.all(err <= tol), f"score error {float((err / tol).max()):.3g} x bound {ctx}"


def _seq_lens(gen, lo=1, hi=90):
    return [0, 1] + torch.randint(lo, hi, (3,), generator=gen).tolist()


# ----------------------------------------------------------------------------------------------------
# Scoring ops
# ----------------------------------------------------------------------------------------------------

def _prefill_inputs(case, exact, gen):
    fmt, H, D, _, _ = case
    v = _variant(case)
    seq = _seq_lens(gen)
    N = sum(seq)
    ks, ke = cases.prefill_rows(seq, gen, extra_rows=[(3, 3), (N, N)])
    Qs = cases.queries(len(ks), H, D, fmt, gen, exact, v["wdtype"], v["int8"])
    k, kscale = cases.packed_k(N, D, fmt, gen, exact)
    if fmt == "mxfp4" and v["int8"]:
        k = k.view(torch.int8)
    return Qs, k, kscale, ks, ke


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("case", SCORE_CASES, ids=CASE_IDS)
def test_mqa_logits(device, call_op, gen, case, exact):
    fmt, H, D, _, _ = case
    Qs, k, kscale, ks, ke = _prefill_inputs(case, exact, gen)
    L = int((ke - ks).max()) + 3  # extra columns past every row: -inf
    dt = torch.bfloat16 if (not exact and H == 4) else torch.float32
    logits = torch.full((len(ks), L), 7.0, dtype=dt, device=device)
    Qd = Qs.to(device)
    args = (Qd.q, Qd.q_scale, k.to(device), kscale.to(device), Qd.weights, ks.to(device), ke.to(device), logits)
    call_op(ops.mqa_logits, *args)
    orc, mag = oracle.mqa_logits(Qs.q, Qs.q_scale, k, kscale, Qs.weights, ks, ke, L)
    assert_scores(logits, orc, mag, D, H, exact, uses_kernel("mqa_logits", *args))


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("case", SCORE_CASES, ids=CASE_IDS)
def test_sparse_mqa_logits(device, call_op, gen, case, exact):
    fmt, H, D, _, cbs = case
    Qs, k, kscale, ks, ke = _prefill_inputs(case, exact, gen)
    n = (ke - ks).tolist()
    cb = cases.candidates(n, 3, cbs, gen, junk=True)
    dt = torch.bfloat16 if (not exact and H == 4) else torch.float32
    logits = torch.full((len(ks), 3 * cbs), 7.0, dtype=dt, device=device)
    Qd = Qs.to(device)
    args = (Qd.q, Qd.q_scale, k.to(device), kscale.to(device), Qd.weights, ks.to(device), ke.to(device),
            cb.to(device), cbs, logits)
    call_op(ops.sparse_mqa_logits, *args)
    orc, mag = oracle.sparse_mqa_logits(Qs.q, Qs.q_scale, k, kscale, Qs.weights, ks, ke, cb, cbs)
    assert_scores(logits, orc, mag, D, H, exact, uses_kernel("sparse_mqa_logits", *args))


def _decode_inputs(case, exact, gen, mtp):
    fmt, H, D, bs, _ = case
    v = _variant(case)
    seq = _seq_lens(gen)
    pc = cases.paged_cache(seq, bs, D, fmt, gen, exact, max_blocks=(max(seq) + bs - 1) // bs + 1)
    if mtp:
        lens, req = cases.decode_rows(seq, gen)
    else:
        lens, req = torch.tensor(seq, dtype=torch.int32), None
    Qs = cases.queries(len(lens), H, D, fmt, gen, exact, v["wdtype"], v["int8"])
    cache = pc.kv_cache.unsqueeze(2) if v["cache4d"] else pc.kv_cache
    return Qs, cache, pc.block_table, lens, req


@pytest.mark.parametrize("mtp", [True, False], ids=["mtp", "one-row-per-req"])
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("case", SCORE_CASES, ids=CASE_IDS)
def test_paged_mqa_logits(device, call_op, gen, case, exact, mtp):
    fmt, H, D, bs, _ = case
    Qs, cache, bt, lens, req = _decode_inputs(case, exact, gen, mtp)
    L = int(lens.max()) + 5
    dt = torch.bfloat16 if (not exact and H == 4) else torch.float32
    logits = torch.full((len(lens), L), 7.0, dtype=dt, device=device)
    Qd = Qs.to(device)
    args = (Qd.q, Qd.q_scale, cache.to(device), Qd.weights, lens.to(device), bt.to(device),
            None if req is None else req.to(device), logits)
    call_op(ops.paged_mqa_logits, *args)
    orc, mag = oracle.paged_mqa_logits(Qs.q, Qs.q_scale, cache, Qs.weights, lens, bt, req, L)
    assert_scores(logits, orc, mag, D, H, exact, uses_kernel("paged_mqa_logits", *args))


@pytest.mark.parametrize("mtp", [True, False], ids=["mtp", "one-row-per-req"])
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("case", SCORE_CASES, ids=CASE_IDS)
def test_paged_sparse_mqa_logits(device, call_op, gen, case, exact, mtp):
    fmt, H, D, bs, cbs = case
    Qs, cache, bt, lens, req = _decode_inputs(case, exact, gen, mtp)
    cb = cases.candidates(lens.tolist(), 4, cbs, gen, junk=True)
    dt = torch.bfloat16 if (not exact and H == 4) else torch.float32
    logits = torch.full((len(lens), 4 * cbs), 7.0, dtype=dt, device=device)
    Qd = Qs.to(device)
    args = (Qd.q, Qd.q_scale, cache.to(device), Qd.weights, lens.to(device), bt.to(device),
            None if req is None else req.to(device), cb.to(device), cbs, logits)
    call_op(ops.paged_sparse_mqa_logits, *args)
    orc, mag = oracle.paged_sparse_mqa_logits(Qs.q, Qs.q_scale, cache, Qs.weights, lens, bt, req, cb, cbs)
    assert_scores(logits, orc, mag, D, H, exact, uses_kernel("paged_sparse_mqa_logits", *args))


# ----------------------------------------------------------------------------------------------------
# Selection ops
# ----------------------------------------------------------------------------------------------------

TOPK_SHAPES = [(37, 8), (64, 64), (20, 32), (300, 16), (5, 1), (130, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L, k", TOPK_SHAPES)
def test_topk(device, call_op, gen, L, k, dtype):
    R = 14
    logits = cases.special_logits(R, L, gen, dtype)
    lengths = cases.lengths_for(R, L, k, gen)
    out = torch.full((R, k), 123, dtype=torch.int32, device=device)
    call_op(ops.topk, logits.to(device), lengths.to(device), k, out)
    assert out.cpu().tolist() == oracle.topk(logits, lengths, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_blocks, cbs, k", [(3, 8, 8), (4, 16, 20), (2, 8, 32), (6, 16, 1)])
def test_sparse_topk(device, call_op, gen, num_blocks, cbs, k, dtype):
    R = 14
    ns = cases.lengths_for(R, 8 * cbs, k, gen)
    cb = cases.candidates(ns.tolist(), num_blocks, cbs, gen, junk=True)
    logits = cases.special_logits(R, num_blocks * cbs, gen, dtype)
    out = torch.full((R, k), 123, dtype=torch.int32, device=device)
    call_op(ops.sparse_topk, logits.to(device), cb.to(device), cbs, ns.to(device), k, out)
    assert out.cpu().tolist() == oracle.sparse_topk(logits, cb, cbs, ns, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L, cbs, num_blocks", [(37, 8, 3), (64, 16, 2), (40, 8, 10), (100, 16, 1), (96, 8, 5)])
def test_block_topk(device, call_op, gen, L, cbs, num_blocks, dtype):
    R = 14
    logits = cases.special_logits(R, L, gen, dtype)
    lengths = cases.lengths_for(R, L, cbs, gen)
    out = torch.full((R, num_blocks), 123, dtype=torch.int32, device=device)
    call_op(ops.block_topk, logits.to(device), lengths.to(device), cbs, out)
    assert out.cpu().tolist() == oracle.block_topk(logits, lengths, cbs, num_blocks)


def test_selection_hand_cases(call_op):
    """A few rows worked out by hand, independent of both implementations."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [1.0, 3.0, 3.0, 2.0, 3.0, 0.0],        # ties at 3: positions 1, 2 (lower wins over 4)
        [nan, -inf, 5.0, nan, -inf, 1.0],      # finite first, then -inf (lower position), NaN last
        [nan, nan, nan, nan, nan, nan],        # all NaN: still the k lowest positions
        [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],        # all equal: the k lowest positions
        [9.0, 8.0, 7.0, 6.0, 5.0, 4.0],        # length 2 < k: both, then -1
        [9.0, 8.0, 7.0, 6.0, 5.0, 4.0],        # length 0
    ])
    lengths = torch.tensor([6, 6, 6, 6, 2, 0], dtype=torch.int32)
    out = torch.empty(6, 3, dtype=torch.int32)
    call_op(ops.topk, logits, lengths, 3, out)
    assert out.tolist() == [[1, 2, 4], [1, 2, 5], [0, 1, 2], [0, 1, 2], [0, 1, -1], [-1, -1, -1]]
    # Blocks (cbs >= 8): repeat each value 8 times, so block b holds old position b's value.
    cb = torch.empty(6, 2, dtype=torch.int32)
    wide = logits.repeat_interleave(8, dim=1)
    call_op(ops.block_topk, wide, lengths * 8, 8, cb)
    assert cb.tolist() == [[1, 2], [2, 5], [0, 1], [0, 1], [0, 1], [-1, -1]]
    blocks = torch.tensor([[4, 0], [1, -1], [-1, -1], [0, 1], [0, 1], [0, 1]], dtype=torch.int32)
    sparse = torch.tensor([[1.0] * 8 + [2.0] * 8, [5.0] * 16, [0.0] * 16, [3.0] * 16, [1.0] * 16, [1.0] * 16])
    sidx = torch.empty(6, 3, dtype=torch.int32)
    call_op(ops.sparse_topk, sparse, blocks, 8, torch.tensor([48, 16, 16, 16, 10, 0], dtype=torch.int32), 3, sidx)
    # row 0: block 4 (positions 32..39, score 1) and block 0 (0..7, score 2) -> 0, 1, 2.
    # row 1: block 1 = positions 8..15, length 16 -> 8, 9, 10. row 4: block 1 starts at 8 < 10 -> 0, 1, 2.
    assert sidx.tolist() == [[0, 1, 2], [8, 9, 10], [-1, -1, -1], [0, 1, 2], [0, 1, 2], [-1, -1, -1]]


# ----------------------------------------------------------------------------------------------------
# Cache write / gather / query quantization
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt, D, bs, pow2", [("fp8", 64, 16, True), ("fp8", 128, 64, False),
                                               ("mxfp4", 64, 64, True), ("mxfp4", 128, 16, True)])
def test_write_k_cache(device, call_op, gen, fmt, D, bs, pow2, kdtype):
    nb = 3
    cache = torch.randint(0, 256, (nb, bs, formats.bytes_per_token(fmt, D)), generator=gen, dtype=torch.uint8)
    T = 20
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[::5] = -1                                   # skipped
    slots[3] = nb * bs + 7                            # past the cache: skipped
    k = (torch.randn(T, D, generator=gen) * 4).to(kdtype)
    k[2] = 0
    expected = oracle.write_k_cache(k, slots, cache, fmt, pow2)
    dev_cache = cache.to(device)
    view = dev_cache.unsqueeze(2) if bs == 64 else dev_cache
    call_op(ops.write_k_cache, k.to(device), slots.to(device).to(torch.int32 if bs == 16 else torch.int64), view,
            fmt, pow2)
    assert torch.equal(oracle.cache_pages(dev_cache), expected)


@pytest.mark.parametrize("fmt, D, bs", [("fp8", 128, 16), ("fp8", 64, 64), ("mxfp4", 64, 16), ("mxfp4", 128, 64)])
def test_gather_k(device, call_op, gen, fmt, D, bs):
    seq = _seq_lens(gen)
    pc = cases.paged_cache(seq, bs, D, fmt, gen)
    cu = torch.tensor([0] + torch.tensor(seq).cumsum(0).tolist(), dtype=torch.int32)
    N = int(cu[-1]) + 3                               # rows past cu[-1] stay untouched
    vb = formats.value_bytes(fmt, D)
    kbytes = torch.randint(0, 256, (N, vb), generator=gen, dtype=torch.uint8)
    sbytes = torch.randint(0, 256, (N, 4), generator=gen, dtype=torch.uint8)
    kdt = formats.FP8_DTYPE if fmt == "fp8" else torch.uint8
    k = kbytes.clone().view(kdt).to(device)
    ks = sbytes.clone().view(torch.float32 if fmt == "fp8" else torch.int32).view(N).to(device)
    call_op(ops.gather_k, pc.kv_cache.to(device), pc.block_table.to(device), cu.to(device), k, ks, fmt)
    ev, es = oracle.gather_k(pc.kv_cache, pc.block_table, cu, N, fmt)
    got_v = oracle.u8(k)
    got_s = oracle.u8(ks.view(torch.uint8) if ks.dtype != torch.uint8 else ks).view(N, 4)
    for t in range(N):
        assert got_v[t].tolist() == (kbytes[t].tolist() if ev[t] is None else ev[t].tolist()), t
        assert got_s[t].tolist() == (sbytes[t].tolist() if es[t] is None else es[t].tolist()), t


@pytest.mark.parametrize("fmt, H, D, wdtype, wscale", [("fp8", 4, 64, torch.float32, 0.3),
                                                       ("fp8", 64, 128, torch.bfloat16, 1.0),
                                                       ("mxfp4", 8, 128, torch.float32, 0.125),
                                                       ("mxfp4", 64, 64, torch.bfloat16, 0.7)])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_quantize_q(device, call_op, gen, fmt, H, D, wdtype, wscale, qdtype):
    T = 3
    q = (torch.randn(T, H, D, generator=gen) * torch.logspace(-2, 2, H).view(1, H, 1)).to(qdtype)
    q[0, 0] = 0
    w = torch.randn(T, H, generator=gen).to(wdtype)
    qv, qs, wf = call_op(ops.quantize_q, q.to(device), w.to(device), fmt, wscale)
    ev, es, ew = oracle.quantize_q(q, w, fmt, wscale)
    assert torch.equal(oracle.u8(qv).view(ev.shape), ev)
    if fmt == "fp8":
        assert qs is None and qv.dtype == formats.FP8_DTYPE
    else:
        assert qs.dtype == torch.int32 and torch.equal(oracle.int32_bytes(qs), es)
    assert wf.dtype == torch.float32 and torch.equal(wf.cpu().double(), ew)


# ----------------------------------------------------------------------------------------------------
# End-to-end ops (exact data: the float64 oracle's selections must be matched exactly)
# ----------------------------------------------------------------------------------------------------

E2E_CASES = [SCORE_CASES[i] for i in (0, 1, 3, 6, 7, 9)]
E2E_IDS = [CASE_IDS[i] for i in (0, 1, 3, 6, 7, 9)]


def _ws(kind, rows, width, device):
    if kind == "big":
        n = workspace.workspace_bytes(max(rows, 1), width)
    elif kind == "one-row":
        n = workspace.min_workspace_bytes(width)
    else:  # a budget of two rows per chunk, plus slack that must not change the chunking's results
        n = workspace.workspace_bytes(max(rows, 1), width, logits_budget_bytes=2 * workspace.row_stride(width) * 4) + 100
    return torch.full((n,), 0xAB, dtype=torch.uint8, device=device)


@pytest.mark.parametrize("ws_kind", ["big", "one-row", "two-rows"])
@pytest.mark.parametrize("case", E2E_CASES, ids=E2E_IDS)
def test_indexer_prefill(device, call_op, gen, case, ws_kind):
    fmt, H, D, _, cbs = case
    Qs, k, kscale, ks, ke = _prefill_inputs(case, True, gen)
    T = len(ks)
    max_context = int((ke - ks).max()) + 2
    topk, NB = 16, 3
    ws = _ws(ws_kind, T, max_context, device)
    idx = torch.full((T, topk), 77, dtype=torch.int32, device=device)
    cb = torch.full((T, NB), 77, dtype=torch.int32, device=device) if ws_kind != "two-rows" else None
    Qd = Qs.to(device)
    call_op(ops.indexer_prefill, Qd.q, Qd.q_scale, k.to(device), kscale.to(device), Qd.weights, ks.to(device),
            ke.to(device), max_context, topk, cbs, ws, idx, cb)
    orc, _ = oracle.mqa_logits(Qs.q, Qs.q_scale, k, kscale, Qs.weights, ks, ke, max_context)
    n = oracle.prefill_lengths(ks, ke, k.shape[0])
    assert idx.cpu().tolist() == oracle.topk(orc, n, topk)
    if cb is not None:
        assert cb.cpu().tolist() == oracle.block_topk(orc, n, cbs, NB)


@pytest.mark.parametrize("ws_kind", ["big", "one-row", "two-rows"])
@pytest.mark.parametrize("case", E2E_CASES, ids=E2E_IDS)
def test_indexer_decode(device, call_op, gen, case, ws_kind):
    fmt, H, D, bs, cbs = case
    Qs, cache, bt, lens, req = _decode_inputs(case, True, gen, mtp=(ws_kind != "big"))
    R = len(lens)
    max_context = int(lens.max()) + 1
    topk, NB = 16, 4
    ws = _ws(ws_kind, R, max_context, device)
    idx = torch.full((R, topk), 77, dtype=torch.int32, device=device)
    cb = torch.full((R, NB), 77, dtype=torch.int32, device=device) if ws_kind != "one-row" else None
    Qd = Qs.to(device)
    call_op(ops.indexer_decode, Qd.q, Qd.q_scale, cache.to(device), Qd.weights, lens.to(device), bt.to(device),
            None if req is None else req.to(device), max_context, topk, cbs, ws, idx, cb)
    orc, _ = oracle.paged_mqa_logits(Qs.q, Qs.q_scale, cache, Qs.weights, lens, bt, req, max_context)
    n = oracle.decode_lengths(lens, bt, req, bs)
    assert idx.cpu().tolist() == oracle.topk(orc, n, topk)
    if cb is not None:
        assert cb.cpu().tolist() == oracle.block_topk(orc, n, cbs, NB)


@pytest.mark.parametrize("ws_kind", ["big", "one-row", "two-rows"])
@pytest.mark.parametrize("case", E2E_CASES, ids=E2E_IDS)
def test_sparse_indexer_prefill(device, call_op, gen, case, ws_kind):
    fmt, H, D, _, cbs = case
    Qs, k, kscale, ks, ke = _prefill_inputs(case, True, gen)
    T = len(ks)
    NB, topk = 3, 20
    cb = cases.candidates((ke - ks).tolist(), NB, cbs, gen, junk=True)
    ws = _ws(ws_kind, T, NB * cbs, device)
    idx = torch.full((T, topk), 77, dtype=torch.int32, device=device)
    Qd = Qs.to(device)
    call_op(ops.sparse_indexer_prefill, Qd.q, Qd.q_scale, k.to(device), kscale.to(device), Qd.weights,
            ks.to(device), ke.to(device), cb.to(device), cbs, topk, ws, idx)
    orc, _ = oracle.sparse_mqa_logits(Qs.q, Qs.q_scale, k, kscale, Qs.weights, ks, ke, cb, cbs)
    n = oracle.prefill_lengths(ks, ke, k.shape[0])
    assert idx.cpu().tolist() == oracle.sparse_topk(orc, cb, cbs, n, topk)


@pytest.mark.parametrize("ws_kind", ["big", "one-row", "two-rows"])
@pytest.mark.parametrize("case", E2E_CASES, ids=E2E_IDS)
def test_sparse_indexer_decode(device, call_op, gen, case, ws_kind):
    fmt, H, D, bs, cbs = case
    Qs, cache, bt, lens, req = _decode_inputs(case, True, gen, mtp=(ws_kind != "big"))
    R = len(lens)
    NB, topk = 4, 24
    cb = cases.candidates(lens.tolist(), NB, cbs, gen, junk=True)
    ws = _ws(ws_kind, R, NB * cbs, device)
    idx = torch.full((R, topk), 77, dtype=torch.int32, device=device)
    Qd = Qs.to(device)
    call_op(ops.sparse_indexer_decode, Qd.q, Qd.q_scale, cache.to(device), Qd.weights, lens.to(device),
            bt.to(device), None if req is None else req.to(device), cb.to(device), cbs, topk, ws, idx)
    orc, _ = oracle.paged_sparse_mqa_logits(Qs.q, Qs.q_scale, cache, Qs.weights, lens, bt, req, cb, cbs)
    n = oracle.decode_lengths(lens, bt, req, bs)
    assert idx.cpu().tolist() == oracle.sparse_topk(orc, cb, cbs, n, topk)


def _assert_near_topk(sel, scores, n, k, tol):
    """``sel`` is a valid top-k of float64 ``scores`` up to ``tol``: min(n, k) distinct ascending positions
    below n, -1 after, and no unselected valid position beats a selected one by more than ``tol``."""
    for r in range(len(sel)):
        m = min(int(n[r]), k)
        row = sel[r]
        picked = row[:m]
        assert picked == sorted(set(picked)) and all(0 <= p < n[r] for p in picked), (r, row)
        assert row[m:] == [-1] * (k - m), (r, row)
        if m and m < n[r]:
            rest = [p for p in range(int(n[r])) if p not in set(picked)]
            worst = min(scores[r][p] for p in picked)
            best_rest = max(scores[r][p] for p in rest)
            assert worst >= best_rest - tol[r], (r, worst, best_rest)


@pytest.mark.parametrize("case", [SCORE_CASES[2], SCORE_CASES[10]], ids=[CASE_IDS[2], CASE_IDS[10]])
def test_end_to_end_random_data(device, call_op, gen, case):
    """Generic (non-exact) data: the end-to-end selection is a true top-k of the float64 scores up to the
    scoring error and, on the reference backend, equals the selection op run on the scoring op's own
    logits (a fused GPU kernel may round differently from the separate scoring kernel)."""
    fmt, H, D, bs, cbs = case
    Qs, cache, bt, lens, req = _decode_inputs(case, False, gen, mtp=True)
    R, topk, NB = len(lens), 8, 3
    L = int(lens.max()) + 1
    Qd, dv = Qs.to(device), dict(device=device)
    args = (Qd.q, Qd.q_scale, cache.to(device), Qd.weights, lens.to(device), bt.to(device), req.to(device))
    idx = torch.empty(R, topk, dtype=torch.int32, **dv)
    cb = torch.empty(R, NB, dtype=torch.int32, **dv)
    dense_args = (*args, L, topk, cbs, _ws("big", R, L, device), idx, cb)
    call_op(ops.indexer_decode, *dense_args)
    logits = torch.empty(R, L, **dv)
    call_op(ops.paged_mqa_logits, *args, logits)
    n = oracle.decode_lengths(lens, bt, req, bs)
    kernel = uses_kernel("indexer_decode", *dense_args) or uses_kernel("paged_mqa_logits", *args, logits)
    if not kernel:
        assert idx.cpu().tolist() == oracle.topk(logits, n, topk)
        assert cb.cpu().tolist() == oracle.block_topk(logits, n, cbs, NB)
    orc, mag = oracle.paged_mqa_logits(Qs.q, Qs.q_scale, cache, Qs.weights, lens, bt, req, L)
    rel = 1e-4 if kernel else 2 * (D + H + 2) * 2.0 ** -24
    tol = (rel * mag.max(1).values).tolist()
    _assert_near_topk(idx.cpu().tolist(), orc.tolist(), n.tolist(), topk, tol)

    sidx = torch.empty(R, topk, dtype=torch.int32, **dv)
    sparse_args = (*args, cb, cbs, topk, _ws("one-row", R, NB * cbs, device), sidx)
    call_op(ops.sparse_indexer_decode, *sparse_args)
    slog = torch.empty(R, NB * cbs, **dv)
    call_op(ops.paged_sparse_mqa_logits, *args, cb, cbs, slog)
    if not (uses_kernel("sparse_indexer_decode", *sparse_args) or uses_kernel("paged_sparse_mqa_logits", *args, cb,
                                                                               cbs, slog)):
        assert sidx.cpu().tolist() == oracle.sparse_topk(slog, cb.cpu(), cbs, n, topk)
    sorc, smag = oracle.paged_sparse_mqa_logits(Qs.q, Qs.q_scale, cache, Qs.weights, lens, bt, req, cb.cpu(), cbs)
    # As positions: map each sparse column back to its position for the near-top-k check.
    pos_scores = []
    for r in range(R):
        row = {}
        for c in range(NB * cbs):
            b = int(cb[r, c // cbs])
            if b >= 0 and b * cbs + c % cbs < n[r]:
                row[b * cbs + c % cbs] = float(sorc[r, c])
        pos_scores.append(row)
    for r in range(R):
        picked = [p for p in sidx[r].tolist() if p >= 0]
        assert len(picked) == min(topk, len(pos_scores[r])) and set(picked) <= set(pos_scores[r])
        if picked and len(picked) < len(pos_scores[r]):
            worst = min(pos_scores[r][p] for p in picked)
            best_rest = max(v for p, v in pos_scores[r].items() if p not in set(picked))
            assert worst >= best_rest - rel * float(smag[r].max()), r
