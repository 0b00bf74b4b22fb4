"""Context parallelism (torch_sparse_indexer.distributed).

* The ownership maps against the definition written out position by position.
* The selection / merge ops in one process, W ranks simulated by splitting a row's columns by owner: the
  merged result equals the brute-force oracle (tests/oracle.py) on the whole row -- ties across ranks,
  NaN, -inf, +inf, rows shorter than k, k up to 4096, blocks split over ranks.
* End to end over ``torch.distributed`` with gloo, 2-4 processes spawned here (bounded in time): every
  rank holds only its own positions in its own cache (written through ``cp_slot_mapping``), and the
  sharded dense level (top-k + published candidate blocks) and consumer level equal the single-process
  ops exactly, for prefill and decode, FP8 and MXFP4, interleave 1 and 64, ragged requests, rows
  shorter than k. Scores use ``cases``' exact data (small integers, power-of-two scales), so per-position
  scores are bit-equal whatever the BLAS summation order and ties are real.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_sparse_indexer import distributed as cp, formats, functional as F, testing

import cases
import oracle

ops = torch.ops.sparse_indexer


# ----------------------------------------------------------------------------------------------------
# Ownership maps
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W, I", [(1, 1), (2, 1), (3, 1), (4, 2), (2, 64), (3, 5)])
def test_shard_maps(W, I):
    N = 3 * I * W + 7
    owners = [(p // I) % W for p in range(N)]  # the definition
    total = [0] * (N + 1)
    for r in range(W):
        s = cp.CPShard(r, W, I)
        owned = [p for p in range(N) if owners[p] == r]
        assert [s.to_global(lp) for lp in range(len(owned))] == owned
        assert [s.to_local(p) for p in owned] == list(range(len(owned)))
        assert [bool(s.owns(p)) for p in range(N)] == [o == r for o in owners]
        lens = [s.local_length(n) for n in range(N + 1)]
        assert lens == [sum(1 for p in owned if p < n) for n in range(N + 1)]
        n_t = torch.arange(-2, N + 1, dtype=torch.int32)
        assert cp.local_lengths(n_t, s).tolist() == [0, 0] + lens
        lp_t = torch.arange(len(owned))
        assert s.to_global(lp_t).tolist() == owned
        total = [a + b for a, b in zip(total, lens)]
        assert s.local_capacity(N) == max(cp.CPShard(q, W, I).local_length(N) for q in range(W))
    assert total == list(range(N + 1))


def test_shard_rejects_bad_arguments():
    with pytest.raises(ValueError, match="^rank:"):
        cp.CPShard(2, 2, 1)
    with pytest.raises(ValueError, match="^world_size:"):
        cp.CPShard(0, 0, 1)
    with pytest.raises(ValueError, match="^interleave:"):
        cp.CPShard(0, 2, 0)
    with pytest.raises(TypeError, match="^rank:"):
        cp.CPShard(0.0, 2, 1)
    with pytest.raises(ValueError, match="^shard:"):
        cp.check_group(cp.CPShard(0, 2, 1))  # no process group in this process


def test_slot_mapping():
    """Owned tokens land at their local position's page/offset; the rest (and junk) get -1."""
    W, I, bs = 3, 2, 16
    seq = [40, 7]
    for r in range(W):
        s = cp.CPShard(r, W, I)
        nloc = [s.local_length(n) for n in seq]
        bt = torch.tensor([[5, 2, -1], [0, -1, -1]], dtype=torch.int32)
        pos = torch.tensor(list(range(seq[0])) + list(range(seq[1])) + [-1, 0, 200])
        req = torch.tensor([0] * seq[0] + [1] * seq[1] + [0, 2, 0])
        got = cp.cp_slot_mapping(pos, req, bt, bs, s).tolist()
        want = []
        for p, q in zip(pos.tolist(), req.tolist()):
            if p < 0 or q > 1 or (p // I) % W != r:
                want.append(-1)
                continue
            lp = (p // (I * W)) * I + p % I
            page = bt[q, lp // bs].item() if lp // bs < 3 else -1
            want.append(-1 if page < 0 else page * bs + lp % bs)
        assert got == want
        assert sum(1 for v in got if v >= 0) == sum(min(n, (bt[i] >= 0).sum().item() * bs) for i, n in enumerate(nloc))


# ----------------------------------------------------------------------------------------------------
# Selection and merge ops, W ranks simulated in one process
# ----------------------------------------------------------------------------------------------------

def _split(logits, n, shard, gen):
    """A rank's view of dense rows: its owned columns (shuffled: the ops must not rely on column order),
    their global positions (-1 past the row's length)."""
    L = logits.shape[1]
    owned = [p for p in range(L) if shard.owns(p)]
    perm = torch.randperm(len(owned), generator=gen)
    cols = torch.tensor(owned, dtype=torch.long)[perm]
    pos = torch.where(cols[None, :] < n[:, None], cols[None, :], torch.full((1, cols.numel()), -1))
    return logits[:, cols].contiguous(), pos.to(torch.int32).contiguous()


def _ranks_topk(logits, n, k, W, I, gen):
    scores, positions = [], []
    for r in range(W):
        lg, pos = _split(logits, n, cp.CPShard(r, W, I), gen)
        s = torch.empty(logits.shape[0], k)
        p = torch.empty(logits.shape[0], k, dtype=torch.int32)
        ops.cp_local_topk(lg, pos, k, s, p)
        scores.append(s)
        positions.append(p)
    return torch.stack(scores), torch.stack(positions)


def _clamped(lengths, L):
    return lengths.long().clamp(0, L)


# The merges: the ops (reference) and the steps' composition through topk (distributed._merge_*).
TOPK_MERGES = {"op": ops.cp_topk_merge, "composed": cp._merge_topk}
BLOCK_MERGES = {"op": ops.cp_block_merge, "composed": cp._merge_blocks}


@pytest.mark.parametrize("merge", TOPK_MERGES)
@pytest.mark.parametrize("W, I", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 4), (3, 16)])
@pytest.mark.parametrize("k", [1, 5, 16, 40])
def test_topk_merge_matches_oracle(gen, W, I, k, merge):
    R, L = 12, 37
    logits = cases.special_logits(R, L, gen)
    lengths = cases.lengths_for(R, L, k, gen)
    n = _clamped(lengths, L)
    s, p = _ranks_topk(logits, n, k, W, I, gen)
    out = torch.full((R, k), 7, dtype=torch.int32)
    TOPK_MERGES[merge](s, p, k, out)
    assert out.tolist() == oracle.topk(logits, lengths, k)


@pytest.mark.parametrize("merge", TOPK_MERGES)
def test_topk_merge_large_k(gen, merge):
    """k = 4096 (the op's maximum) with rows longer and shorter than k, over 3 ranks of interleave 64."""
    R, L, k = 3, 4500, 4096
    logits = torch.randint(-20, 20, (R, L), generator=gen).float()  # many ties
    logits[1, ::7] = float("nan")
    lengths = torch.tensor([L, 4096, 1000], dtype=torch.int32)
    s, p = _ranks_topk(logits, _clamped(lengths, L), k, 3, 64, gen)
    out = torch.empty(R, k, dtype=torch.int32)
    TOPK_MERGES[merge](s, p, k, out)
    assert out.tolist() == oracle.topk(logits, lengths, k)


def test_local_topk_outputs_scores_and_positions(gen):
    """The local op's entries are the oracle's choice among the rank's entries, with their exact scores
    (NaN and -inf included) and -inf / -1 padding."""
    R, L, k = 6, 20, 8
    logits = cases.special_logits(R, L, gen)
    pos = torch.randperm(1000, generator=gen)[: R * L].view(R, L).to(torch.int32)
    pos[torch.rand(R, L, generator=gen) < 0.4] = -1
    pos[0] = -1
    s = torch.empty(R, k)
    p = torch.empty(R, k, dtype=torch.int32)
    ops.cp_local_topk(logits, pos, k, s, p)
    for r in range(R):
        entries = [(int(q), float(v)) for q, v in zip(pos[r], logits[r]) if q >= 0]
        assert p[r].tolist() == oracle.select(entries, k)
        value = dict(entries)
        got = [float(x) for x in s[r]]
        want = [value[q] if q >= 0 else float("-inf") for q in p[r].tolist()]
        assert [("nan" if v != v else v) for v in got] == [("nan" if v != v else v) for v in want]


@pytest.mark.parametrize("merge", BLOCK_MERGES)
@pytest.mark.parametrize("W, I", [(1, 1), (2, 1), (3, 1), (2, 8), (4, 2), (2, 64)])
@pytest.mark.parametrize("cbs, m", [(8, 1), (8, 3), (16, 2), (64, 4)])
def test_block_merge_matches_oracle(gen, W, I, cbs, m, merge):
    """Partial block maxima per rank (blocks split over ranks when I < cbs) merged equal block_topk on
    the whole row."""
    R, L = 12, 150
    logits = cases.special_logits(R, L, gen)
    lengths = cases.lengths_for(R, L, cbs, gen)
    n = _clamped(lengths, L)
    scores, blocks = [], []
    for r in range(W):
        lg, pos = _split(logits, n, cp.CPShard(r, W, I), gen)
        s = torch.empty(R, m)
        b = torch.empty(R, m, dtype=torch.int32)
        ops.cp_local_block_topk(lg, pos, cbs, s, b)
        scores.append(s)
        blocks.append(b)
    out = torch.full((R, m), 7, dtype=torch.int32)
    BLOCK_MERGES[merge](torch.stack(scores), torch.stack(blocks), out)
    assert out.tolist() == oracle.block_topk(logits, lengths, cbs, m)


@pytest.mark.parametrize("merge", BLOCK_MERGES)
def test_block_merge_takes_max_over_ranks(gen, merge):
    """The same block from several ranks (or twice from one) counts once, with its best score (NaN below
    -inf)."""
    W, R, C, m = 3, 20, 6, 3
    scores = cases.special_logits(W * R, C, gen).view(W, R, C)
    blocks = torch.randint(-1, 6, (W, R, C), generator=gen, dtype=torch.int32)
    out = torch.empty(R, m, dtype=torch.int32)
    BLOCK_MERGES[merge](scores, blocks, out)
    for r in range(R):
        best = {}
        for w in range(W):
            for b, v in zip(blocks[w, r].tolist(), scores[w, r].tolist()):
                if b >= 0:
                    best[b] = min(best.get(b, v), v, key=oracle._rank)
        assert out[r].tolist() == oracle.select(list(best.items()), m)


def _bits(x):
    """float32 scores as comparable bits (NaN payloads and -0 included)."""
    return x.contiguous().view(torch.int32).tolist()


@pytest.mark.parametrize("W, I", [(1, 1), (2, 1), (2, 4), (3, 1), (3, 16), (2, 64), (4, 2)])
@pytest.mark.parametrize("cbs", [8, 16, 64])
def test_composed_local_selection_equals_ops(gen, W, I, cbs):
    """What a step's columns look like (dense: a valid prefix of increasing global positions), selected by
    topk / block_topk (distributed._local_*) and by the cp ops: the same entries, bit for bit. Block
    selection is composed only where global blocks are aligned local blocks (_local_block_map)."""
    R, C, k, m = 9, 70, 12, 5
    for r in range(W):
        shard = cp.CPShard(r, W, I)
        logits = cases.special_logits(R, C, gen)
        logits[0, :] = 2.0  # one row all tied
        n = torch.randint(0, C + 1, (R,), generator=gen, dtype=torch.int32)
        n[1], n[2] = 0, C
        gpos = shard.to_global(torch.arange(C)).to(torch.int32)
        pos = torch.where(torch.arange(C)[None, :] < n[:, None], gpos[None, :],
                          torch.full((1, C), -1, dtype=torch.int32))
        want_s, want_p = torch.empty(R, k), torch.empty(R, k, dtype=torch.int32)
        ops.cp_local_topk(logits, pos, k, want_s, want_p)
        got_s, got_p = torch.full((R, k), 7.0), torch.full((R, k), 7, dtype=torch.int32)
        cp._local_topk_dense(logits, n, gpos, k, got_s, got_p)
        assert got_p.tolist() == want_p.tolist() and _bits(got_s) == _bits(want_s)
        bmap = cp._local_block_map(shard, cbs)
        aligned = cbs % (I * W) == 0 and cbs // W >= 8 or I % cbs == 0
        assert (bmap is not None) == aligned
        if bmap is None:
            continue
        want_s, want_b = torch.empty(R, m), torch.empty(R, m, dtype=torch.int32)
        ops.cp_local_block_topk(logits, pos, cbs, want_s, want_b)
        got_s, got_b = torch.full((R, m), 7.0), torch.full((R, m), 7, dtype=torch.int32)
        cp._local_block_topk(logits, n, bmap[0], bmap[1], got_s, got_b)
        assert got_b.tolist() == want_b.tolist() and _bits(got_s) == _bits(want_s)


@pytest.mark.parametrize("W, I, cbs", [(1, 1, 8), (2, 1, 16), (2, 64, 8), (3, 16, 16), (1, 1, 64)])
def test_composed_sparse_local_topk_equals_op(gen, W, I, cbs):
    """Sparse local logits of an exact plan (ascending local blocks, then -1; positions past the local length
    not selectable), selected by sparse_topk (distributed._local_topk_sparse) and by cp_local_topk."""
    R, M, k = 8, 6, 10
    for r in range(W):
        shard = cp.CPShard(r, W, I)
        plan = cp.sparse_plan(shard, cbs)
        assert plan.exact
        g = plan.block
        width = M * plan.per_candidate * g
        n = torch.randint(0, 60, (R,), dtype=torch.int32, generator=gen)
        n[0] = 0
        nb = int(n.max()) // g + 3
        lc = torch.full((R, M * plan.per_candidate), -1, dtype=torch.int32)
        for row in range(R):
            ids = sorted(torch.randperm(nb, generator=gen)[: int(torch.randint(0, lc.shape[1] + 1, (1,),
                                                                                 generator=gen))].tolist())
            lc[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        logits = cases.special_logits(R, width, gen)
        col = torch.arange(width)
        lb = lc.long()[:, col // g]
        lp = lb * g + col % g
        pos = torch.where((lb >= 0) & (lp < n.long()[:, None]), shard.to_global(lp.clamp(min=0)),
                          torch.full_like(lp, -1)).to(torch.int32)
        want_s, want_p = torch.empty(R, k), torch.empty(R, k, dtype=torch.int32)
        ops.cp_local_topk(logits, pos, k, want_s, want_p)
        got_s, got_p = torch.full((R, k), 7.0), torch.full((R, k), 7, dtype=torch.int32)
        cp._local_topk_sparse(logits, lc, g, n, shard, k, got_s, got_p)
        assert got_p.tolist() == want_p.tolist() and _bits(got_s) == _bits(want_s)


def test_merge_of_gather_buffer_views(gen):
    """The merge ops read strided views of one gathered int32 payload (what the step passes them)."""
    W, R, k = 2, 4, 5
    s = cases.special_logits(W * R, k, gen).view(W, R, k)
    p = torch.stack([torch.arange(k) * 2 + w for w in range(W)])[:, None, :].expand(W, R, k).to(torch.int32)
    recv = torch.zeros(W, 3 * R * k, dtype=torch.int32)
    recv[:, : R * k].copy_(s.reshape(W, -1).view(torch.int32))
    recv[:, R * k: 2 * R * k].copy_(p.reshape(W, -1))
    sv = recv[:, : R * k].view(torch.float32).view(W, R, k)
    pv = recv[:, R * k: 2 * R * k].view(W, R, k)
    a = torch.empty(R, k, dtype=torch.int32)
    b = torch.empty(R, k, dtype=torch.int32)
    ops.cp_topk_merge(sv, pv, k, a)
    ops.cp_topk_merge(s.contiguous(), p.contiguous(), k, b)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------
# End to end: shared inputs, the single-process reference, one rank's shard
# ----------------------------------------------------------------------------------------------------

D, H, BS = 64, 8, 16
SEQ = [5, 37, 130, 0, 64, 20]   # ragged; 5 and 0 are shorter than TOPK
TOPK, M = 16, 4
MAX_CONTEXT = 144


def _pages(seq, bs, gen, spare=2):
    need = [(n + bs - 1) // bs for n in seq]
    total = sum(need) + spare
    perm = torch.randperm(total, generator=gen).tolist()
    bt = torch.full((len(seq), max(need + [1])), -1, dtype=torch.int32)
    it = iter(perm)
    for r, nb in enumerate(need):
        for b in range(nb):
            bt[r, b] = next(it)
    return total, bt


def _case_data(fmt, seed):
    """Everything every rank and the reference share (drawn from one seed, so equal on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    x = cases.with_duplicates(cases.raw_rows((sum(SEQ), D), fmt, gen, exact=True), gen, frac=0.4)
    req = torch.tensor([r for r, n in enumerate(SEQ) for _ in range(n)])
    pos = torch.tensor([p for n in SEQ for p in range(n)])
    cu = torch.tensor([0] + torch.tensor(SEQ).cumsum(0).tolist(), dtype=torch.int32)
    nan_tokens = torch.randperm(sum(SEQ), generator=gen)[:6] if fmt == "fp8" else torch.zeros(0, dtype=torch.long)
    ctx, dreq = cases.decode_rows(SEQ, gen, mtp=2)
    qd = cases.queries(ctx.shape[0], H, D, fmt, gen, exact=True)
    ks, ke = cases.prefill_rows(SEQ, gen)
    qp = cases.queries(ks.shape[0], H, D, fmt, gen, exact=True)
    prow_req = torch.searchsorted(cu[1:], ks, right=True).to(torch.int32)
    layout_seed = int(torch.randint(0, 2 ** 30, (1,), generator=gen))
    return dict(x=x, req=req, pos=pos, cu=cu, nan=nan_tokens, ctx=ctx, dreq=dreq, qd=qd, ks=ks, ke=ke, qp=qp,
                prow_req=prow_req, layout_seed=layout_seed)


def _poison(cache, slots, fmt):
    """Scales of the given slots set to NaN (garbage memory): their scores are NaN."""
    _, scales = formats.cache_views(cache, fmt)
    s = slots[slots >= 0]
    scales[s // BS, s % BS] = float("nan")


def _build_cache(d, fmt, seq, slot_fn, gen):
    total, bt = _pages(seq, BS, gen)
    cache = formats.allocate_k_cache(total, BS, D, fmt)
    slots = slot_fn(bt)
    F.write_k_cache(d["x"], slots, cache, fmt)
    if d["nan"].numel():
        _poison(cache, slots[d["nan"]], fmt)
    return cache, bt


def _reference(d, fmt, cbs):
    """The single-process results (one cache holding every position)."""
    gen = torch.Generator().manual_seed(d["layout_seed"])
    cache, bt = _build_cache(d, fmt, SEQ, lambda bt: (bt[d["req"], d["pos"] // BS].long() * BS + d["pos"] % BS),
                             gen)
    qd, qp = d["qd"], d["qp"]
    out = {}
    out["dec_idx"], out["dec_cb"] = F.indexer_decode(qd.q, qd.q_scale, cache, qd.weights, d["ctx"], bt, d["dreq"],
                                                     MAX_CONTEXT, TOPK, M, cbs)
    cand_gen = torch.Generator().manual_seed(d["layout_seed"] + 1)
    out["dec_cand"] = cases.candidates(d["ctx"].tolist(), M, cbs, cand_gen, junk=True)
    # Out-of-contract ids (documented: -inf columns, never selected or read out of bounds): int32 max,
    # and a -1 amid valid ids.
    out["dec_cand"][2, -1] = 2 ** 31 - 1
    out["dec_cand"][4, 1] = -1
    for name in ("dec_cb", "dec_cand"):
        out[name + "_sparse"] = F.sparse_indexer_decode(qd.q, qd.q_scale, cache, qd.weights, d["ctx"], bt, d["dreq"],
                                                        out[name], cbs, TOPK)
    k, k_scale = F.gather_k(cache, bt, d["cu"], int(d["cu"][-1]), fmt)
    out["pre_idx"], out["pre_cb"] = F.indexer_prefill(qp.q, qp.q_scale, k, k_scale, qp.weights, d["ks"], d["ke"],
                                                      MAX_CONTEXT, TOPK, M, cbs)
    out["pre_cand"] = cases.candidates((d["ke"] - d["ks"]).tolist(), M, cbs, cand_gen, junk=True)
    for name in ("pre_cb", "pre_cand"):
        out[name + "_sparse"] = F.sparse_indexer_prefill(qp.q, qp.q_scale, k, k_scale, qp.weights, d["ks"], d["ke"],
                                                         out[name], cbs, TOPK)
    return out


def _sharded(d, fmt, cbs, shard, group=None, compiled=False, device="cpu", capture=False):
    """This rank's results: its cache holds only its positions; every output is the merged global one.
    Inputs are built on the CPU (as the reference's) and the step runs on ``device``; ``capture`` (CUDA)
    also replays the dense decode step from a CUDA graph and requires the eager result."""
    gen = torch.Generator().manual_seed(d["layout_seed"] * 31 + shard.rank + 1)
    lseq = [shard.local_length(n) for n in SEQ]
    cache, bt = _build_cache(d, fmt, lseq, lambda bt: cp.cp_slot_mapping(d["pos"], d["req"], bt, BS, shard), gen)
    lcu = cp.local_cu_seq_lens(d["cu"], shard)
    n_local = int(lcu[-1])

    def to(t):
        return None if t is None else t.to(device)

    cache, bt, lcu = to(cache), to(bt), to(lcu)
    d = {k: (to(v) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    ref = {k: to(v) for k, v in d["ref"].items()}
    qd, qp = (dataclasses.replace(q, **{f.name: to(getattr(q, f.name)) for f in dataclasses.fields(q)})
              for q in (d["qd"], d["qp"]))
    R, T = qd.q.shape[0], qp.q.shape[0]
    out = {}
    dense = cp.dense_buffers(shard, max(R, T), MAX_CONTEXT, TOPK, M, cbs, device=device, group=group)
    sparse = cp.sparse_buffers(shard, max(R, T), M, cbs, TOPK, device=device, group=group)
    # aot_eager: Dynamo + functionalization of the whole step (the collective included), no codegen.
    step = {f.__name__: torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f
            for f in (cp.cp_indexer_decode, cp.cp_sparse_indexer_decode, cp.cp_indexer_prefill,
                      cp.cp_sparse_indexer_prefill)}
    i32 = dict(dtype=torch.int32, device=device)
    idx = torch.full((R, TOPK), 9, **i32)
    cb = torch.full((R, M), 9, **i32)

    def decode(idx, cb):
        step["cp_indexer_decode"](qd.q, qd.q_scale, cache, qd.weights, d["ctx"], bt, d["dreq"], MAX_CONTEXT, TOPK,
                                  cbs, dense, idx, cb, group=group)

    decode(idx, cb)
    out["dec_idx"], out["dec_cb"] = idx, cb
    if capture:
        gidx, gcb = torch.full_like(idx, 9), torch.full_like(cb, 9)
        graph = testing.capture_graph(lambda: decode(gidx, gcb))  # the worker's current device is this rank's
        for _ in range(3):
            gidx.fill_(9)
            gcb.fill_(9)
            graph.replay()
            torch.cuda.synchronize(device)
            assert torch.equal(gidx, idx) and torch.equal(gcb, cb), "replayed sharded decode step differs from eager"
    for name in ("dec_cb", "dec_cand"):
        idx = torch.full((R, TOPK), 9, **i32)
        step["cp_sparse_indexer_decode"](qd.q, qd.q_scale, cache, qd.weights, d["ctx"], bt, d["dreq"], ref[name], cbs,
                                    TOPK, sparse, idx, group=group)
        out[name + "_sparse"] = idx
    k, k_scale = F.gather_k(cache, bt, lcu, n_local, fmt)
    ks, ke = cp.local_prefill_bounds(d["ks"], d["ke"], d["prow_req"], lcu, shard)
    idx = torch.full((T, TOPK), 9, **i32)
    cb = torch.full((T, M), 9, **i32)
    step["cp_indexer_prefill"](qp.q, qp.q_scale, k, k_scale, qp.weights, ks, ke, MAX_CONTEXT, TOPK, cbs, dense, idx,
                               cb, group=group)
    out["pre_idx"], out["pre_cb"] = idx, cb
    for name in ("pre_cb", "pre_cand"):
        idx = torch.full((T, TOPK), 9, **i32)
        step["cp_sparse_indexer_prefill"](qp.q, qp.q_scale, k, k_scale, qp.weights, ks, ke, ref[name], cbs, TOPK,
                                          sparse, idx, group=group)
        out[name + "_sparse"] = idx
    return {k: v.cpu() for k, v in out.items()}


def _check_case(fmt, interleave, cbs, seed, rank, world_size, group=None, compiled=False, device="cpu",
                capture=False):
    d = _case_data(fmt, seed)
    d["ref"] = ref = _reference(d, fmt, cbs)
    # The data must exercise what the test claims: rows shorter than k, NaN scores (fp8), real ties.
    assert (ref["dec_idx"] == -1).any() and (ref["pre_idx"] == -1).any()
    got = _sharded(d, fmt, cbs, cp.CPShard(rank, world_size, interleave), group, compiled, device, capture)
    tag = f"{fmt} interleave={interleave} cbs={cbs} seed={seed} rank {rank}/{world_size}"
    for name, t in got.items():
        if not torch.equal(t, ref[name]):
            bad = (t != ref[name]).any(1).nonzero().flatten()[:3].tolist()
            raise AssertionError(f"{tag}: {name} differs from the single-process result at rows {bad}: "
                                 f"{t[bad].tolist()} vs {ref[name][bad].tolist()}")


@pytest.mark.parametrize("by_cp_ops", [False, True], ids=["composed", "cp-ops"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_world_size_one_equals_single_gpu(seed, fmt, by_cp_ops, monkeypatch):
    """W = 1 (no process group; the gather is a copy): the CP step equals the single-GPU ops, selecting through
    the single-GPU top-k ops (the default) or the cp ops."""
    monkeypatch.setattr(cp, "SELECT_BY_CP_OPS", by_cp_ops)
    _check_case(fmt, 1, 8, seed, 0, 1)


# ----------------------------------------------------------------------------------------------------
# Multi-process (gloo)
# ----------------------------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, case_list, backend="gloo"):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        for c in case_list:
            c = dict(c)
            if c.get("compiled"):
                torch._dynamo.reset()
            if c.pop("list_gather", False):  # the fallback for a gloo without all_gather_into_tensor
                cp._LIST_GATHER_BACKENDS.add("gloo")
            cp.SELECT_BY_CP_OPS = c.pop("by_cp_ops", False)
            _check_case(rank=rank, world_size=world_size, group=None, device=device, **c)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world_size, case_list, timeout_s=150, backend="gloo"):
    ctx = mp.start_processes(_worker, args=(world_size, _free_port(), case_list, backend), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world_size} {backend} processes did not finish within {timeout_s} s")


def test_gloo_two_ranks(seed):
    """Both formats, interleave 1 (blocks split over ranks; cbs 8 needs masked covering blocks, cbs 16
    not) and 64 (a rank owns whole blocks), plus all four steps compiled (fullgraph, aot_eager)."""
    case_list = [dict(fmt=f, interleave=i, cbs=c, seed=seed + j)
                 for j, (f, i, c) in enumerate([(f, i, c) for f in ("fp8", "mxfp4") for i in (1, 64) for c in (8, 16)])]
    case_list.append(dict(fmt="fp8", interleave=1, cbs=8, seed=seed, compiled=True))
    case_list.append(dict(fmt="mxfp4", interleave=1, cbs=16, seed=seed + 9, by_cp_ops=True))
    _spawn(2, case_list)


def test_gloo_three_ranks(seed):
    """An odd world size: no block size is a multiple of the period, ownership runs straddle blocks; the
    last case gathers through the list fallback."""
    _spawn(3, [dict(fmt="fp8", interleave=1, cbs=16, seed=seed),
               dict(fmt="mxfp4", interleave=64, cbs=8, seed=seed + 1),
               dict(fmt="fp8", interleave=4, cbs=8, seed=seed + 2, list_gather=True)])


def test_gloo_four_ranks(seed):
    _spawn(4, [dict(fmt="mxfp4", interleave=1, cbs=16, seed=seed),
               dict(fmt="fp8", interleave=64, cbs=16, seed=seed + 1)])


# ----------------------------------------------------------------------------------------------------
# Multi-GPU (NCCL): one rank per GPU of the machine
# ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA GPUs and NCCL")
def test_nccl_ranks(seed):
    """Every GPU of the machine a rank (one GPU: world size 1 still goes through NCCL's all-gather): the GPU
    kernels' sharded results equal the single-process CPU reference exactly, and the sharded dense decode
    step replays from a CUDA graph with the eager result."""
    n = torch.cuda.device_count()
    _spawn(n, [dict(fmt="fp8", interleave=1, cbs=8, seed=seed, capture=True),
               dict(fmt="mxfp4", interleave=64, cbs=16, seed=seed + 1, capture=True),
               dict(fmt="fp8", interleave=64, cbs=16, seed=seed + 2)], timeout_s=300, backend="nccl")
