"""Reference backend: pure PyTorch, every device. It defines the semantics (SPEC sections 2-4).

Scores are computed in float64 on dequantized inputs (exact dot products, a fixed head-sum order, so a row's
scores never depend on the other rows of the batch) and rounded to the logits dtype; selection is exact on a
float64 rank key.
Everything is chunked over rows and columns so no call materializes more than ``MEMORY_BUDGET`` bytes
of intermediates beyond its outputs, whatever the context length.

Signatures mirror the ops in :mod:`torch_sparse_indexer.ops` (outputs are written in place).
Documented handling of out-of-contract device values (shared by every backend):

* prefill ``ks``/``ke`` are clamped: ``ks' = clamp(ks, 0, N)``, ``ke' = clamp(ke, ks', N)``; the row has
  ``n = ke' - ks'`` positions.
* decode ``context_lens`` are clamped to ``[0, max_blocks * block_size]``; a row whose request index is
  outside ``[0, block_table.shape[0])`` has ``n = 0``; a position whose block-table entry is outside
  ``[0, num_cache_blocks)`` scores ``-inf``.
* candidate block ids ``< 0`` or starting at or past ``n`` contribute only ``-inf`` columns.
* top-k ``lengths`` are clamped to ``[0, width]``.
"""
from __future__ import annotations

import torch

from . import formats

MEMORY_BUDGET = 64 << 20  # bytes of float32 intermediates per chunk

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------------

def _dequant_q(q: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    if q.dtype == formats.FP8_DTYPE:
        return q.float()
    return formats.dequantize_mxfp4_rows(q, q_scale)


def _chunk(total_cols: int, per_col_bytes: int) -> int:
    return max(1, min(total_cols, MEMORY_BUDGET // max(1, per_col_bytes)))


def _score_positions(qd, w, rows_n, fetch, pos, valid, out):
    """Write ``out[r, c] = score(row r, position pos[r, c])`` or -inf where not ``valid``.

    ``qd [R, H, D]`` f32, ``w [R, H]`` f32, ``pos/valid [R, C]``; ``fetch(rows, pos, valid)`` returns the
    dequantized keys ``[r, c, D]`` f32 and their scale ``[r, c]`` f32 (scale applied after the head sum).
    """
    R, H, D = qd.shape
    C = pos.shape[1]
    if R == 0 or C == 0:
        return
    per_elem = (3 * D + 2 * H + 8) * 4
    rc = max(1, min(R, MEMORY_BUDGET // max(1, per_elem * min(C, 1024))))
    for r0 in range(0, R, rc):
        r1 = min(R, r0 + rc)
        cc = _chunk(C, per_elem * (r1 - r0))
        for c0 in range(0, C, cc):
            c1 = min(C, c0 + cc)
            p = pos[r0:r1, c0:c1]
            v = valid[r0:r1, c0:c1]
            kd, kscale = fetch(r0, r1, p, v)
            # A row's scores must not depend on which rows share the batch or on the chunking: float32 BLAS
            # picks its summation order by shape. In float64 the dots of e4m3 (and e2m1) values are exact, so
            # any order gives the same bits, and the head sum runs in a fixed order.
            dots = torch.einsum("rhd,rcd->rhc", qd[r0:r1].double(), kd.double()).relu_()
            wr = w[r0:r1].double()
            s = wr[:, 0, None] * dots[:, 0]
            for h in range(1, H):
                s += wr[:, h, None] * dots[:, h]
            s *= kscale
            out[r0:r1, c0:c1] = torch.where(v, s, torch.full_like(s, _NEG_INF)).to(out.dtype)


def _packed_fetch(k, k_scale, ks_abs):
    """fetch() over packed K: key index = ks_abs[row] + position."""
    N = k.shape[0]
    is_fp8 = k.dtype == formats.FP8_DTYPE

    def fetch(r0, r1, p, v):
        idx = (ks_abs[r0:r1, None] + p).clamp(0, max(N - 1, 0))
        if N == 0:
            shape = (*p.shape, k.shape[1] * (1 if is_fp8 else 2))
            return torch.zeros(shape, device=p.device), torch.zeros(p.shape, device=p.device)
        vals = k[idx]
        sc = k_scale[idx]
        if is_fp8:
            return vals.float(), sc.float()
        return formats.dequantize_mxfp4_rows(vals, sc), torch.ones(p.shape, device=p.device)
    return fetch


def _paged_fetch(kv_cache, fmt, block_table, req):
    """fetch() over a paged cache for rows whose request is ``req[row]`` (already validated)."""
    vals_v, scales_v = formats.cache_views(kv_cache, fmt)
    NB, BS = scales_v.shape
    MB = block_table.shape[1]

    def fetch(r0, r1, p, v):
        rq = req[r0:r1, None].expand_as(p)
        bi = (p // BS).clamp(0, MB - 1)
        page = block_table[rq, bi].long().clamp(0, max(NB - 1, 0))
        off = p % BS
        vals = vals_v[page, off]
        sc = scales_v[page, off]
        if fmt == "fp8":
            return vals.float(), sc.float()
        return formats.dequantize_mxfp4_rows(vals, sc), torch.ones(p.shape, device=p.device)
    return fetch


def _prefill_bounds(ks, ke, N):
    ks_c = ks.long().clamp(0, N)
    ke_c = torch.maximum(ke.long().clamp(max=N), ks_c)
    return ks_c, ke_c - ks_c


def _paged_rows(context_lens, block_table, req_indices, kv_cache, fmt):
    """(request per row [R] long (clamped), valid length n [R] long, page-valid(pos) function)."""
    R = context_lens.shape[0]
    num_reqs, MB = block_table.shape
    _, scales_v = formats.cache_views(kv_cache, fmt)
    NB, BS = scales_v.shape
    if req_indices is None:
        req = torch.arange(R, device=context_lens.device)
    else:
        req = req_indices.long()
    req_ok = (req >= 0) & (req < num_reqs)
    n = context_lens.long().clamp(0, MB * BS)
    n = torch.where(req_ok, n, torch.zeros_like(n))
    req = req.clamp(0, max(num_reqs - 1, 0))

    def page_ok(p):
        bi = (p // BS).clamp(0, MB - 1)
        page = block_table[req[:, None].expand_as(p), bi].long()
        return (page >= 0) & (page < NB)
    return req, n, page_ok


def _sparse_positions(candidate_blocks, cbs, n):
    nblk = candidate_blocks.shape[1]
    blk = candidate_blocks.long()
    o = torch.arange(cbs, device=blk.device)
    pos = (blk[:, :, None] * cbs + o).reshape(blk.shape[0], nblk * cbs)
    valid = (blk[:, :, None] >= 0).expand(-1, -1, cbs).reshape_as(pos) & (pos < n[:, None])
    return pos.clamp(min=0), valid


def mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, logits):
    """Dense prefill scores, compressed layout: ``logits[i, c]`` = score of key ``ks[i] + c``."""
    T, L = logits.shape
    ks_c, n = _prefill_bounds(ks, ke, k.shape[0])
    pos = torch.arange(L, device=logits.device).expand(T, L)
    valid = pos < n[:, None]
    _score_positions(_dequant_q(q, q_scale), weights.float(), n, _packed_fetch(k, k_scale, ks_c),
                     pos, valid, logits)


def sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, logits):
    """Prefill scores on candidate blocks only: column c = position ``blocks[i, c // cbs] * cbs + c % cbs``."""
    ks_c, n = _prefill_bounds(ks, ke, k.shape[0])
    pos, valid = _sparse_positions(candidate_blocks, cbs, n)
    _score_positions(_dequant_q(q, q_scale), weights.float(), n, _packed_fetch(k, k_scale, ks_c),
                     pos, valid, logits)


def _cache_fmt(q):
    return "fp8" if q.dtype == formats.FP8_DTYPE else "mxfp4"


def paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, logits):
    """Dense decode scores: ``logits[r, p]`` = score of position p of row r's request."""
    fmt = _cache_fmt(q)
    R, L = logits.shape
    req, n, page_ok = _paged_rows(context_lens, block_table, req_indices, kv_cache, fmt)
    pos = torch.arange(L, device=logits.device).expand(R, L)
    valid = (pos < n[:, None]) & page_ok(pos)
    _score_positions(_dequant_q(q, q_scale), weights.float(), n,
                     _paged_fetch(kv_cache, fmt, block_table, req), pos, valid, logits)


def paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                            candidate_blocks, cbs, logits):
    """Decode scores on candidate blocks only (sparse layout)."""
    fmt = _cache_fmt(q)
    req, n, page_ok = _paged_rows(context_lens, block_table, req_indices, kv_cache, fmt)
    pos, valid = _sparse_positions(candidate_blocks, cbs, n)
    valid = valid & page_ok(pos)
    _score_positions(_dequant_q(q, q_scale), weights.float(), n,
                     _paged_fetch(kv_cache, fmt, block_table, req), pos, valid, logits)


# ----------------------------------------------------------------------------------------------------
# Cache write / gather / query quantization
# ----------------------------------------------------------------------------------------------------

def write_k_cache(k, slot_mapping, kv_cache, fmt, pow2_scale):
    """Quantize ``k [T, D]`` and scatter token t to slot ``slot_mapping[t]`` (< 0 or past the cache: skip)."""
    vals_v, scales_v = formats.cache_views(kv_cache, fmt)
    NB, BS = scales_v.shape
    slot = slot_mapping.long()
    keep = (slot >= 0) & (slot < NB * BS)
    vals, sc = formats.quantize_rows(k, fmt, pow2_scale)
    # Boolean indexing syncs on CUDA; the reference is not the capturable backend.
    slot, vals, sc = slot[keep], vals[keep], sc[keep]
    page, off = slot // BS, slot % BS
    vals_v.view(torch.uint8)[page, off] = vals.view(torch.uint8)
    scales_v[page, off] = sc.to(scales_v.dtype)


def gather_k(kv_cache, block_table, cu_seq_lens, k, k_scale, fmt):
    """Pack requests' cached K back to back: rows ``[cu[r], cu[r+1])`` from request r's pages.

    Rows at or past ``cu[-1]`` are left untouched. A row whose position maps past the block table or to a
    page id outside the cache is written as zero values with a zero scale.
    """
    vals_v, scales_v = formats.cache_views(kv_cache, fmt)
    NB, BS = scales_v.shape
    N = k.shape[0]
    num_reqs, MB = block_table.shape
    cu = cu_seq_lens.long()
    R = cu.shape[0] - 1
    if N == 0 or R <= 0:
        return
    cu = torch.cummax(cu.clamp(min=0), dim=0).values  # decreasing offsets are out of contract: clamp
    t = torch.arange(N, device=k.device)
    r = (torch.searchsorted(cu[1:].contiguous(), t, right=True)).clamp(max=R - 1)
    inside = t < cu[-1]
    p = t - cu[r]
    bi = p // BS
    req_ok = r < num_reqs
    rr = r.clamp(max=max(num_reqs - 1, 0))
    page = block_table[rr, bi.clamp(0, MB - 1)].long()
    ok = inside & req_ok & (p >= 0) & (bi < MB) & (page >= 0) & (page < NB)  # p < 0 only if cu[0] > 0
    page = page.clamp(0, max(NB - 1, 0))
    off = p % BS
    src_v = vals_v.view(torch.uint8)[page, off]
    src_s = scales_v[page, off]
    new_v = torch.where(ok[:, None], src_v, torch.zeros_like(src_v))
    new_s = torch.where(ok, src_s, torch.zeros_like(src_s))
    kv = k.view(torch.uint8)
    ksc = k_scale
    kv.copy_(torch.where(inside[:, None], new_v, kv))
    ksc.copy_(torch.where(inside, new_s.to(ksc.dtype), ksc))


def quantize_q(q, weights, fmt, weight_scale):
    return formats.quantize_q(q, weights, fmt, weight_scale)


# ----------------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------------

_FINITE_FLOOR = -1e300  # where -inf goes on the rank key; NaN ranks below it, invalid entries lowest
_NAN_KEY = -1e301


def rank_key(x: torch.Tensor) -> torch.Tensor:
    """float64 key with the selection order: values ascending as usual, -inf above NaN."""
    k = x.double()
    k = torch.where(torch.isneginf(k), torch.full_like(k, _FINITE_FLOOR), k)
    return torch.where(torch.isnan(k), torch.full_like(k, _NAN_KEY), k)


def _select(key, pos, valid, k, out):
    """Write the ``k`` best valid entries' positions (ascending, -1 padded) into ``out [R, k]``.

    Order: key descending, then position ascending. ``key/pos/valid [R, C]``.
    """
    R, C = key.shape
    if R == 0:
        return
    key = torch.where(valid, key, torch.full_like(key, _NEG_INF))
    by_pos = torch.argsort(pos, dim=1, stable=True)
    key = key.gather(1, by_pos)
    pos_s = pos.gather(1, by_pos)
    order = torch.argsort(key, dim=1, descending=True, stable=True)
    take = min(k, C)
    best = pos_s.gather(1, order[:, :take])
    count = valid.sum(dim=1).clamp(max=k)
    sel = torch.arange(take, device=key.device)[None, :] < count[:, None]
    big = torch.iinfo(torch.int64).max
    best = torch.where(sel, best, torch.full_like(best, big))
    best = torch.sort(best, dim=1).values
    best = torch.where(best == big, torch.full_like(best, -1), best)
    res = torch.full((R, k), -1, dtype=torch.int64, device=key.device)
    res[:, :take] = best
    out.copy_(res.to(out.dtype))


def _row_chunks(R, C):
    rc = max(1, min(R, MEMORY_BUDGET // max(1, C * 40)))
    return range(0, R, rc), rc


def topk(logits, lengths, k, indices):
    """Top-k over columns ``[0, lengths[r])`` of dense logits; positions ascending then -1."""
    R, L = logits.shape
    n = lengths.long().clamp(0, L)
    starts, rc = _row_chunks(R, L)
    pos_all = torch.arange(L, device=logits.device)
    for r0 in starts:
        r1 = min(R, r0 + rc)
        key = rank_key(logits[r0:r1])
        pos = pos_all.expand(r1 - r0, L)
        _select(key, pos, pos < n[r0:r1, None], k, indices[r0:r1])


def sparse_topk(logits, candidate_blocks, cbs, lengths, k, indices):
    """Top-k over sparse logits; outputs request-local positions (ascending, -1 padded)."""
    R, C = logits.shape
    n = lengths.long().clamp(min=0)
    starts, rc = _row_chunks(R, C)
    for r0 in starts:
        r1 = min(R, r0 + rc)
        pos, valid = _sparse_positions(candidate_blocks[r0:r1], cbs, n[r0:r1])
        _select(rank_key(logits[r0:r1]), pos, valid, k, indices[r0:r1])


def block_scores(logits, lengths, cbs):
    """Rank-key block scores ``[R, ceil(L / cbs)]`` (max over the block's valid positions) and the number
    of valid blocks per row ``ceil(n / cbs)``."""
    R, L = logits.shape
    n = lengths.long().clamp(0, L)
    nb = (L + cbs - 1) // cbs
    key = rank_key(logits)
    pos = torch.arange(L, device=logits.device).expand(R, L)
    key = torch.where(pos < n[:, None], key, torch.full_like(key, _NEG_INF))
    pad = nb * cbs - L
    if pad:
        key = torch.nn.functional.pad(key, (0, pad), value=_NEG_INF)
    return key.view(R, nb, cbs).amax(dim=2), (n + cbs - 1) // cbs


def block_topk(logits, lengths, cbs, candidate_blocks):
    """Publish the ``min(num_blocks, ceil(n / cbs))`` best blocks by max valid logit (ascending, -1 padded)."""
    R, L = logits.shape
    nbk = candidate_blocks.shape[1]
    starts, rc = _row_chunks(R, L)
    for r0 in starts:
        r1 = min(R, r0 + rc)
        scores, nvalid = block_scores(logits[r0:r1], lengths[r0:r1], cbs)
        b = torch.arange(scores.shape[1], device=logits.device).expand_as(scores)
        _select(scores, b, b < nvalid[:, None], nbk, candidate_blocks[r0:r1])


# ----------------------------------------------------------------------------------------------------
# Context-parallel selection (see torch_sparse_indexer.distributed): per-rank candidates and their merge.
# An entry is (score, global position or block id); an id < 0 marks an empty entry. The order is the one
# above (rank_key descending, then lower id), so the merged result equals the single-GPU selection.
# ----------------------------------------------------------------------------------------------------

_BIG_ID = torch.iinfo(torch.int64).max


def _best_columns(key, ids, valid, k):
    """Columns of the ``min(k, #valid)`` best valid entries per row (key descending, then id ascending),
    reordered by id ascending; and the mask of real ones among the ``min(k, C)`` returned (a prefix)."""
    R, C = key.shape
    key = torch.where(valid, key, torch.full_like(key, _NEG_INF))
    by_id = torch.argsort(torch.where(valid, ids, torch.full_like(ids, _BIG_ID)), dim=1, stable=True)
    order = torch.argsort(key.gather(1, by_id), dim=1, descending=True, stable=True)
    take = min(k, C)
    cols = by_id.gather(1, order[:, :take])
    real = torch.arange(take, device=key.device)[None, :] < valid.sum(dim=1, keepdim=True)
    by_id2 = torch.argsort(torch.where(real, ids.gather(1, cols), torch.full_like(cols, _BIG_ID)), dim=1, stable=True)
    return cols.gather(1, by_id2), real


def _keep_block_max(key, ids, valid):
    """``valid`` restricted to one entry per (row, id): the one with the best key (first column on ties)."""
    key = torch.where(valid, key, torch.full_like(key, _NEG_INF))
    by_key = torch.argsort(key, dim=1, descending=True, stable=True)
    ids_k = torch.where(valid, ids, torch.full_like(ids, _BIG_ID)).gather(1, by_key)
    by_id = torch.argsort(ids_k, dim=1, stable=True)
    order = by_key.gather(1, by_id)  # id ascending, then key descending
    ids_s = ids_k.gather(1, by_id)
    first = torch.ones_like(ids_s, dtype=torch.bool)
    first[:, 1:] = ids_s[:, 1:] != ids_s[:, :-1]
    keep = torch.zeros_like(valid)
    keep.scatter_(1, order, first & (ids_s != _BIG_ID))
    return keep


def _write_entries(cols, real, values, ids, scores_out, ids_out):
    take = cols.shape[1]
    s = torch.where(real, values.gather(1, cols).float(), torch.full(cols.shape, _NEG_INF, device=cols.device))
    p = torch.where(real, ids.gather(1, cols), torch.full_like(cols, -1))
    scores_out[:, take:].fill_(_NEG_INF)
    ids_out[:, take:].fill_(-1)
    scores_out[:, :take].copy_(s)
    ids_out[:, :take].copy_(p.to(ids_out.dtype))


def cp_local_topk(logits, positions, k, scores, out_positions):
    """One rank's top-k candidates: ``logits [R, C]`` with the global position of each column
    (``positions [R, C]`` int32, < 0: not selectable). Writes the best ``min(k, #valid)`` entries as
    ``out_positions [R, k]`` ascending then -1, and their scores (float32 ``[R, k]``, -inf on padding)."""
    R, C = logits.shape
    starts, rc = _row_chunks(R, C)
    for r0 in starts:
        r1 = min(R, r0 + rc)
        pos = positions[r0:r1].long()
        cols, real = _best_columns(rank_key(logits[r0:r1]), pos, pos >= 0, k)
        _write_entries(cols, real, logits[r0:r1], pos, scores[r0:r1], out_positions[r0:r1])


def _flatten_ranks(x):
    """``[W, R, C]`` -> ``[R, W * C]`` (every rank's entries of a row side by side)."""
    W, R, C = x.shape
    return x.permute(1, 0, 2).reshape(R, W * C)


def cp_topk_merge(scores, positions, k, indices):
    """Exact global top-k from every rank's candidates ``scores/positions [W, R, C]`` (positions distinct
    across ranks; < 0: empty): ``indices [R, k]`` ascending, -1 padded, as ``topk`` on the whole row."""
    s, p = _flatten_ranks(scores), _flatten_ranks(positions).long()
    starts, rc = _row_chunks(s.shape[0], s.shape[1])
    for r0 in starts:
        r1 = min(s.shape[0], r0 + rc)
        _select(rank_key(s[r0:r1]), p[r0:r1], p[r0:r1] >= 0, k, indices[r0:r1])


def cp_local_block_topk(logits, positions, cbs, scores, blocks):
    """One rank's candidate blocks: the partial block score of global block ``b`` is the max of the
    row's selectable entries with ``positions // cbs == b``; writes the ``m = blocks.shape[1]`` best
    (score descending, lower id) as ``blocks [R, m]`` ascending then -1, with their partial scores."""
    R, C = logits.shape
    m = blocks.shape[1]
    starts, rc = _row_chunks(R, C)
    for r0 in starts:
        r1 = min(R, r0 + rc)
        pos = positions[r0:r1].long()
        valid = pos >= 0
        ids = torch.where(valid, pos.div(cbs, rounding_mode="floor"), torch.full_like(pos, -1))
        key = rank_key(logits[r0:r1])
        cols, real = _best_columns(key, ids, _keep_block_max(key, ids, valid), m)
        _write_entries(cols, real, logits[r0:r1], ids, scores[r0:r1], blocks[r0:r1])


def cp_block_merge(scores, blocks, candidate_blocks):
    """Exact global candidate blocks from every rank's partial block scores ``scores/blocks [W, R, C]``
    (a block may come from several ranks: its score is the max): ``candidate_blocks [R, m]`` as
    ``block_topk`` on the whole row."""
    s, b = _flatten_ranks(scores), _flatten_ranks(blocks).long()
    m = candidate_blocks.shape[1]
    starts, rc = _row_chunks(s.shape[0], s.shape[1])
    for r0 in starts:
        r1 = min(s.shape[0], r0 + rc)
        key = rank_key(s[r0:r1])
        valid = b[r0:r1] >= 0
        _select(key, b[r0:r1], _keep_block_max(key, b[r0:r1], valid), m, candidate_blocks[r0:r1])
