"""CPU tests of the DeepGEMM translation layer (``kernels/deepgemm_translate.py``) and of the backend's
refusals.

The translation is checked against an independent statement of DeepGEMM 2.8.2's contracts (written here
from csrc/apis/attention.hpp and the sparse metadata scheduler, ANCHORS.md section 2.5): a *fake* DeepGEMM
sparse kernel that infers each row's valid prefix from its KV length, asserts the prefix is strictly
increasing and inside the row's range, reads keys by DeepGEMM's block rule (unaligned-ks offset, paged
block-table lookup) and leaves everything past the prefix as NaN garbage. Our unpacking of that output must
equal what the reference semantics (SPEC section 4) put in each of our columns.
"""
from __future__ import annotations

import math

import pytest
import torch

from torch_sparse_indexer import backends, formats, testing
from torch_sparse_indexer.kernels import deepgemm as dgb
from torch_sparse_indexer.kernels import deepgemm_translate as tr

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------
# The independent statement of DeepGEMM's sparse contract
# ----------------------------------------------------------------------------------------------------

def fake_dg_sparse_prefill(indices, ks, ke, num_kv, sbk, key_value):
    """DeepGEMM ``fp8_fp4_sparse_mqa_logits`` with ``use_unaligned_ks=True``, scores replaced by
    ``key_value(key)`` (0 past the end of K, like its TMA zero fill). Columns past the prefix: NaN."""
    R, num_max = indices.shape
    out = torch.full((R, num_max * sbk), float("nan"), dtype=torch.float64)
    for r in range(R):
        kb = min(int(ks[r]), num_kv)
        kend = max(kb, min(int(ke[r]), num_kv))
        n_i = min(num_max, -(-(kend - kb) // sbk))
        blocks = indices[r, :n_i].tolist()
        assert all(a < b for a, b in zip(blocks, blocks[1:])), f"row {r}: prefix not strictly increasing {blocks}"
        off = int(ks[r]) % sbk
        for j, b in enumerate(blocks):
            start = b * sbk + off
            assert kb <= start < kend, f"row {r}: block {b} starts at key {start}, outside [{kb}, {kend})"
            for t in range(sbk):
                key = start + t
                out[r, j * sbk + t] = key_value(key) if key < num_kv else 0.0
    return out


def fake_dg_sparse_paged(indices, context_lens, block_table, page_kv, sbk, page_value):
    """DeepGEMM ``fp8_fp4_paged_sparse_mqa_logits``: logical block b of row r is page
    ``block_table[r, b // (page_kv / sbk)]`` at offset ``(b % (page_kv / sbk)) * sbk``; scores replaced by
    ``page_value(page, offset)``. It traps when the page index reaches ``block_table.stride(0)``."""
    R, num_max = indices.shape
    per_page = page_kv // sbk
    out = torch.full((R, num_max * sbk), float("nan"), dtype=torch.float64)
    for r in range(R):
        n_i = min(num_max, -(-int(context_lens[r]) // sbk))
        blocks = indices[r, :n_i].tolist()
        assert all(a < b for a, b in zip(blocks, blocks[1:])), f"row {r}: prefix not strictly increasing {blocks}"
        for j, b in enumerate(blocks):
            lp = b // per_page
            assert 0 <= lp < block_table.stride(0), f"row {r}: logical page {lp} would trap"
            page = int(block_table[r, lp])
            for t in range(sbk):
                out[r, j * sbk + t] = page_value(page, (b % per_page) * sbk + t)
    return out


def _key_value(key):
    return 1.0 + key * 0.25


def _page_value(page, off):
    return 1000.0 * page + off + 0.5


def expected_sparse_prefill(candidate_blocks, cbs, ks, ke, num_kv):
    """Our sparse layout per SPEC section 4 (reference rules), with scores = ``_key_value(absolute key)``."""
    R, nb = candidate_blocks.shape
    out = torch.full((R, nb * cbs), NEG_INF, dtype=torch.float64)
    for r in range(R):
        ksc = min(max(int(ks[r]), 0), num_kv)
        n = max(min(int(ke[r]), num_kv), ksc) - ksc
        for s in range(nb):
            b = int(candidate_blocks[r, s])
            for o in range(cbs):
                p = b * cbs + o
                if b >= 0 and p < n:
                    out[r, s * cbs + o] = _key_value(ksc + p)
    return out


def expected_sparse_paged(candidate_blocks, cbs, context_lens, block_table, req_indices, bs, num_pages):
    R, nb = candidate_blocks.shape
    num_reqs, mb = block_table.shape
    out = torch.full((R, nb * cbs), NEG_INF, dtype=torch.float64)
    for r in range(R):
        q = r if req_indices is None else int(req_indices[r])
        n = 0 if not 0 <= q < num_reqs else min(max(int(context_lens[r]), 0), mb * bs)
        for s in range(nb):
            b = int(candidate_blocks[r, s])
            for o in range(cbs):
                p = b * cbs + o
                if b >= 0 and p < n:
                    page = int(block_table[q, p // bs])
                    if 0 <= page < num_pages:
                        out[r, s * cbs + o] = _page_value(page, p % bs)
    return out


def _assert_same(got, want):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "the -inf patterns differ"
    assert not torch.isnan(got).any(), "garbage (NaN) leaked into our layout"
    fin = ~torch.isneginf(want)
    assert torch.equal(got[fin], want[fin])


def _messy_candidates(R, nb, max_block, gen, well_formed):
    """Candidate lists: contract-following (ascending unique, -1 tail) or arbitrary (unsorted, duplicates,
    -1 in the middle, ids past the row)."""
    out = torch.full((R, nb), -1, dtype=torch.int32)
    for r in range(R):
        if well_formed:
            m = int(torch.randint(0, min(nb, max_block) + 1, (1,), generator=gen))
            ids = torch.randperm(max_block, generator=gen)[:m].sort().values
            out[r, :m] = ids.to(torch.int32)
        else:
            out[r] = torch.randint(-2, max_block + 3, (nb,), generator=gen).to(torch.int32)
    return out


# ----------------------------------------------------------------------------------------------------
# Sparse translation
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cbs,sbk", [(8, 8), (16, 16), (32, 16), (64, 16)])
def test_sparse_block_kv_is_largest_of_16_8_dividing_cbs(cbs, sbk):
    assert tr.sparse_block_kv(cbs) == sbk


@pytest.mark.parametrize("cbs", [8, 16, 32, 64])
@pytest.mark.parametrize("well_formed", [True, False])
def test_sparse_prefill_translation_against_dg_contract(cbs, well_formed, gen):
    R, nb = 9, 6
    sbk = tr.sparse_block_kv(cbs)
    num_kv = int(torch.randint(cbs * 3, cbs * 12, (1,), generator=gen))
    # unaligned starts, rows past the end of K, empty rows, ke beyond N, negative ks
    ks = torch.randint(-5, num_kv + 3, (R,), generator=gen).to(torch.int32)
    ke = (ks + torch.randint(-3, num_kv, (R,), generator=gen)).to(torch.int32)
    ks[0], ke[0] = 3, 3 + 5 * cbs + 1          # unaligned, several blocks
    ks[1], ke[1] = 0, num_kv + 100             # past N
    cand = _messy_candidates(R, nb, 12, gen, well_formed)
    t, ks_dg, ke_dg, n = tr.sparse_prefill_bounds(ks, ke, num_kv, cand, cbs)
    assert t.indices.shape == (R, nb * cbs // sbk) and t.indices.is_contiguous() and t.indices.dtype == torch.int32
    assert t.sbk == sbk
    dg_out = fake_dg_sparse_prefill(t.indices, ks_dg, ke_dg, num_kv, sbk, _key_value)
    got = torch.empty(R, nb * cbs, dtype=torch.float64)
    tr.unpack_sparse(dg_out, t, cand, cbs, n, got)
    _assert_same(got, expected_sparse_prefill(cand, cbs, ks, ke, num_kv))


@pytest.mark.parametrize("cbs,bs", [(8, 16), (16, 64), (32, 64), (64, 128), (8, 256)])
@pytest.mark.parametrize("with_req", [False, True])
def test_sparse_paged_translation_against_dg_contract(cbs, bs, with_req, gen):
    R, nb = 8, 5
    sbk = tr.sparse_block_kv(cbs)
    lens = [int(x) for x in torch.randint(0, 6 * bs, (R,), generator=gen)]
    case = testing.make_paged_cache(lens, bs, 64, "mxfp4", gen=gen, max_blocks=6)
    num_pages = case.kv_cache.shape[0]
    bt = case.block_table.clone()
    bt[0, 0] = num_pages + 7                    # a page id past the cache inside a row's range
    ctx = torch.tensor(lens, dtype=torch.int32)
    ctx[1] = 10 * bs                            # past the block table: clamped
    ctx[2] = -4
    req = None
    if with_req:
        req = torch.tensor([0, 0, 1, 5, 3, 3, -1, 7], dtype=torch.int32)  # repeats, out of range
    cand = _messy_candidates(R, nb, 6 * bs // cbs, gen, well_formed=not with_req)
    rows = tr.decode_rows(ctx, bt, req, bs, num_pages)
    t = tr.translate_candidates(cand, cbs, rows.n)
    dg_out = fake_dg_sparse_paged(t.indices, rows.n, rows.block_table, bs, sbk, _page_value)
    got = torch.empty(R, nb * cbs, dtype=torch.float64)
    ok = tr.page_valid(bt, rows.req, tr.sparse_positions(cand, cbs).clamp(min=0), bs, num_pages)
    tr.unpack_sparse(dg_out, t, cand, cbs, rows.n, got, page_ok=ok)
    _assert_same(got, expected_sparse_paged(cand, cbs, ctx, bt, req, bs, num_pages))


def test_sparse_prefix_length_is_what_dg_infers_and_tail_is_ignored(gen):
    cbs, nb = 32, 8
    sbk, m = 16, 2
    n = torch.tensor([1000, 0, 70, 5000], dtype=torch.int32)
    cand = torch.tensor([[0, 3, 7, 30, -1, -1, -1, -1],      # 4 valid, short list: fillers complete the prefix
                         [0, 1, -1, -1, -1, -1, -1, -1],      # empty row: nothing valid
                         [2, 1, 1, 0, 9, -1, 2, -1],          # unsorted, duplicates, one past n, half of 2 past n
                         [5, 6, 7, 8, 9, 10, 11, 12]], dtype=torch.int32)
    t = tr.translate_candidates(cand, cbs, n)
    # DeepGEMM's inferred prefix length: min(num_max, ceil(n / sbk))
    assert t.num_blocks.tolist() == [min(nb * m, math.ceil(int(x) / sbk)) for x in n] == [16, 0, 5, 16]
    for r in range(4):
        prefix = t.indices[r, : int(t.num_blocks[r])].tolist()
        assert all(a < b for a, b in zip(prefix, prefix[1:]))
        assert all(0 <= b * sbk < int(n[r]) for b in prefix)
    assert t.indices[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 14, 15, 60, 61]
    assert t.dg_candidates[0].tolist() == [0, 1, -1, -1, -1, -1, 6, 7, -1, -1, -1, -1, 14, 15, 60, 61]
    assert t.slot_map[0].tolist() == [0, 6, 12, 14, -1, -1, -1, -1]
    assert t.slot_map[1].tolist() == [-1] * 8
    assert t.indices[2, :5].tolist() == [0, 1, 2, 3, 4]
    assert t.slot_map[2].tolist() == [4, 2, 2, 0, -1, -1, 4, -1]
    assert t.indices[3].tolist() == list(range(10, 26))
    # Tail entries are never read: scribbling over them leaves the unpacked result unchanged.
    ks = torch.zeros(4, dtype=torch.int32)
    N = 6000
    want = torch.empty(4, nb * cbs, dtype=torch.float64)
    tr.unpack_sparse(fake_dg_sparse_prefill(t.indices, ks, n, N, sbk, _key_value), t, cand, cbs, n, want)
    _assert_same(want, expected_sparse_prefill(cand, cbs, ks, n, N))
    scribbled = t.indices.clone()
    for r in range(4):
        scribbled[r, int(t.num_blocks[r]):] = -12345
    got = torch.empty_like(want)
    tr.unpack_sparse(fake_dg_sparse_prefill(scribbled, ks, n, N, sbk, _key_value), t, cand, cbs, n, got)
    assert torch.equal(got, want)


def test_dg_buffer_with_dg_candidates_is_a_valid_sparse_layout(gen):
    """The end-to-end path runs sparse_topk directly on DeepGEMM's buffer, with ``dg_candidates`` (blocks of
    sbk) as the candidate list: it must name exactly our valid positions, each once, at the column holding
    its score."""
    cbs, R, nb, N = 32, 6, 7, 900
    ks = torch.randint(0, 50, (R,), generator=gen).to(torch.int32)
    ke = (ks + torch.randint(0, 800, (R,), generator=gen)).to(torch.int32)
    cand = _messy_candidates(R, nb, 25, gen, well_formed=False)
    t, ks_dg, ke_dg, n = tr.sparse_prefill_bounds(ks, ke, N, cand, cbs)
    dg_out = fake_dg_sparse_prefill(t.indices, ks_dg, ke_dg, N, t.sbk, _key_value)
    pos = tr.sparse_positions(t.dg_candidates, t.sbk)
    valid = (pos >= 0) & (pos < n.long()[:, None])
    want = _key_value(ks_dg.double()[:, None] + pos.double())
    assert torch.equal(dg_out[valid], want[valid])
    ours = tr.sparse_positions(cand, cbs)
    ours_ok = (cand.long().repeat_interleave(cbs, 1) >= 0) & (ours < n.long()[:, None])
    for r in range(R):
        assert sorted(pos[r][valid[r]].tolist()) == sorted(set(ours[r][ours_ok[r]].tolist()))


# ----------------------------------------------------------------------------------------------------
# Dense bounds, decode rows, layouts
# ----------------------------------------------------------------------------------------------------

def test_prefill_bounds_follow_reference_clamping():
    ks = torch.tensor([-3, 0, 5, 90, 10, 7], dtype=torch.int32)
    ke = torch.tensor([4, 100, 2, 95, 60, 7], dtype=torch.int32)
    b = tr.prefill_bounds(ks, ke, 80, width=32)
    assert b.ks.tolist() == [0, 0, 5, 80, 10, 7]
    assert b.n.tolist() == [4, 32, 0, 0, 32, 0]        # clamped to N, never negative, capped at the width
    assert (b.ke - b.ks).tolist() == b.n.tolist()
    assert tr.prefill_bounds(ks, ke, 80).n.tolist() == [4, 80, 0, 0, 50, 0]


def test_decode_rows_flatten_to_one_table_row_each():
    bt = torch.tensor([[3, 1, -1], [0, 9, 2], [4, 4, 4]], dtype=torch.int32)
    ctx = torch.tensor([70, 200, 10, 33, 5, 64], dtype=torch.int32)
    req = torch.tensor([1, 1, 0, 7, 2, 1], dtype=torch.int32)
    rows = tr.decode_rows(ctx, bt, req, block_size=32, num_cache_blocks=5, width=80)
    assert rows.req.tolist() == [1, 1, 0, 2, 2, 1]
    assert rows.n.tolist() == [70, 80, 10, 0, 5, 64]   # clamp to 3 * 32 and the width; bad request -> 0
    assert rows.block_table.shape == (6, 3) and rows.block_table.is_contiguous()
    assert rows.block_table[0].tolist() == [0, 4, 2]    # page 9 clamped into the cache
    assert rows.block_table[2].tolist() == [3, 1, 0]
    # DeepGEMM pairs consecutive rows with equal varlen ids: they must share a block-table row.
    assert rows.run_ids.tolist() == [0, 0, 1, 2, 2, 3]
    for r in range(5):
        if rows.run_ids[r] == rows.run_ids[r + 1]:
            assert torch.equal(rows.block_table[r], rows.block_table[r + 1])
    # DeepGEMM's dense decode lengths: [R, 1], never 0 (its SM90 scheduler faults on an all-empty batch)
    assert tr.context_lens_2d(rows.n).tolist() == [[70], [80], [10], [1], [5], [64]]
    none = tr.decode_rows(ctx[:2], bt, None, 32, 5)
    assert none.req.tolist() == [0, 1] and none.n.tolist() == [70, 96]


def test_unpack_dense_masks_to_reference_pattern(gen):
    R, L = 5, 37
    dg = torch.randn(R, 64, generator=gen)
    dg[:, 30:] = float("nan")                           # uninitialized tail
    n = torch.tensor([0, 30, 12, 30, 1], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 2, 3], [1, -1, 2, 7]], dtype=torch.int32)
    req = torch.tensor([0, 1, 1, 0, 1], dtype=torch.int32)
    pos = torch.arange(L).expand(R, L)
    ok = tr.page_valid(bt, req, pos, 8, 4)
    out = torch.empty(R, 50)[:, :L]                     # row-strided like a caller's buffer
    tr.unpack_dense(dg, n, out, page_ok=ok)
    for r in range(R):
        for c in range(L):
            page = int(bt[int(req[r]), min(c // 8, 3)])
            good = c < n[r] and 0 <= page < 4
            assert (out[r, c] == dg[r, c]) if good else out[r, c] == NEG_INF


def test_output_strides_match_dg_allocation_rule():
    # ANCHORS 2.2/2.3/2.5: fp32 rows are 256-element (1 KiB) aligned on SM90; SM100 bf16 1536 / 384-split.
    assert tr.prefill_logits_stride(1, "sm90") == 256
    assert tr.prefill_logits_stride(4097, "sm90") == 4352
    assert tr.prefill_logits_stride(1000, "sm100") == 1536
    assert tr.paged_logits_stride(65536, "sm90") == 65536
    assert tr.paged_logits_stride(1000, "sm100") == 1536
    assert tr.sparse_logits_stride(2048, 8) == 16384
    assert tr.sparse_logits_stride(4, 8) == 512
    assert tr.schedule_metadata_shape(132) == (133, 2)
    assert [tr.sm90_metadata_bucket(r) for r in (1, 32, 33, 100)] == [32, 32, 64, 128]


# ----------------------------------------------------------------------------------------------------
# Support predicates: what DeepGEMM 2.8.2 cannot do is refused with a reason
# ----------------------------------------------------------------------------------------------------

F32, BF16 = torch.float32, torch.bfloat16


def _dense(arch="sm90", fmt="fp8", H=64, D=128, w=F32, paged=False, bs=64, stride=None, rows=4, width=64, nkv=64):
    return tr.supports_dense(arch, fmt, H, D, w, rows=rows, width=width, paged=paged, block_size=bs,
                             page_stride_bytes=stride, num_kv=nkv)


def test_dense_predicate_accepts_what_dg_runs():
    assert _dense() is None
    assert _dense(H=32, D=64, w=BF16) is None
    assert _dense(paged=True, stride=64 * 132) is None
    assert _dense("sm100", "mxfp4", H=12, D=64, w=BF16, paged=True, bs=128, stride=128 * 36) is None


@pytest.mark.parametrize("kwargs,needle", [
    (dict(arch=None), "SM90 and SM100"),
    (dict(fmt="mxfp4"), "FP8"),
    (dict(H=16), "heads"),
    (dict(H=128), "heads"),
    (dict(paged=True, bs=32), "block_size 64"),
    (dict(paged=True, stride=64 * 132 + 4), "page stride"),
    (dict(rows=0), "query row"),
    (dict(width=0), "width"),
    (dict(nkv=0), "key row"),
    (dict(arch="sm100"), "MXFP8/MXFP4"),
    (dict(arch="sm100", fmt="mxfp4", w=F32), "bfloat16"),
    (dict(arch="sm100", fmt="mxfp4", w=BF16, H=132), "heads"),
    (dict(arch="sm100", fmt="mxfp4", w=BF16, paged=True, bs=16), "block_size"),
])
def test_dense_predicate_refuses(kwargs, needle):
    why = _dense(**kwargs)
    assert why is not None and needle in why, why


def _sparse(arch="sm100", fmt="mxfp4", H=32, D=128, w=BF16, nb=64, cbs=8, paged=False, bs=64, stride=None,
            rows=4, nkv=64):
    return tr.supports_sparse(arch, fmt, H, D, w, rows=rows, num_candidate_blocks=nb, cbs=cbs, paged=paged,
                              block_size=bs, page_stride_bytes=stride, num_kv=nkv)


def test_sparse_predicate_accepts_what_dg_runs():
    assert _sparse() is None
    assert _sparse(H=8, nb=2048, cbs=16) is None
    assert _sparse(nb=2048, cbs=32) is None            # 4096 blocks of 16
    assert _sparse(paged=True, stride=128 * 34 * 2) is None


@pytest.mark.parametrize("kwargs,needle", [
    (dict(arch="sm90"), "SM100 only"),
    (dict(arch=None), "SM100 only"),
    (dict(fmt="fp8"), "MXFP8"),
    (dict(D=64), "head dim 128"),
    (dict(H=64), "heads"),
    (dict(H=6), "heads"),
    (dict(w=F32), "bfloat16"),
    (dict(nb=1), "% 4"),
    (dict(nb=3, cbs=16), "% 4"),
    (dict(nb=4096, cbs=32), "4096"),
    (dict(paged=True, stride=64 * 68 + 64), "128"),
    (dict(rows=0), "query rows"),
    (dict(rows=(1 << 20) + 1), "query rows"),
    (dict(nkv=0), "key row"),
])
def test_sparse_predicate_refuses(kwargs, needle):
    why = _sparse(**kwargs)
    assert why is not None and needle in why, why


# ----------------------------------------------------------------------------------------------------
# The backend on a machine without deep_gemm / a GPU
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def registered_deepgemm():
    with backends.registry_scope():
        dgb.register()
        yield


def test_backend_refuses_cpu_and_dispatch_falls_back(registered_deepgemm, gen):
    qs = testing.make_queries(3, 64, 128, "fp8", gen=gen)
    k, ksc = testing.make_packed_k(20, 128, "fp8", gen=gen)
    ks = torch.zeros(3, dtype=torch.int32)
    ke = torch.tensor([5, 20, 0], dtype=torch.int32)
    logits = torch.empty(3, 24)
    args = (qs.q, None, k, ksc, qs.weights, ks, ke, logits)
    assert dgb.supports_mqa_logits(*args) == "needs CUDA tensors"
    assert backends.select("mqa_logits", *args).name != "deepgemm"
    torch.ops.sparse_indexer.mqa_logits(*args)         # automatic dispatch still works
    with backends.use_backend("deepgemm"):
        with pytest.raises(NotImplementedError, match="deepgemm.*needs CUDA"):
            torch.ops.sparse_indexer.mqa_logits(*args)


def test_unavailable_reason_names_the_missing_piece():
    why = dgb.unavailable_reason()
    if why is not None:
        assert "deep_gemm" in why or "triton" in why
    assert dgb._version_tuple("2.8.2") == (2, 8) and dgb._version_tuple("2.6.1") < (2, 8)
