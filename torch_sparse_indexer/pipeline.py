"""End-to-end ops composed from the single-stage ops (their reference, and the default where no kernel
backend fuses them).

Rows are processed in chunks whose logits live in the caller's workspace (see
:mod:`torch_sparse_indexer.workspace`); the chunking depends only on static sizes. Per-row lengths are
computed on device into the workspace with in-place ops: no host sync and no allocation, so the
composition captures into a CUDA graph as long as the stages it calls do.
"""
from __future__ import annotations

import torch

from . import formats, workspace as ws_mod

_ops = torch.ops.sparse_indexer


def _chunks(total, ws, width):
    rc = min(total, ws_mod.rows_per_chunk(ws.numel(), width))
    return rc, range(0, total, max(rc, 1))


def _prefill_lengths(ks, ke, n_keys, width, out, tmp):
    """``out = clamp(clamp(ke, max=N) - clamp(ks, 0, N), 0, width)`` (the row's usable positions)."""
    torch.clamp(ks, 0, n_keys, out=tmp)
    torch.clamp(ke, max=n_keys, out=out)
    torch.maximum(out, tmp, out=out)
    out.sub_(tmp)
    out.clamp_(max=width)


def _decode_lengths(context_lens, req_indices, block_table, cache_block_size, width, out, tmp):
    """Context length clamped to the block table and ``width``; 0 for a request index out of range."""
    num_reqs, max_blocks = block_table.shape
    torch.clamp(context_lens, 0, min(max_blocks * cache_block_size, width), out=out)
    if req_indices is not None:
        torch.clamp(req_indices, 0, num_reqs - 1, out=tmp)
        tmp.sub_(req_indices).abs_().clamp_(max=1).neg_().add_(1)  # 1 where the index was in range
        out.mul_(tmp)


def _cache_block_size(kv_cache):
    return formats.as_3d_cache(kv_cache).shape[1]


def indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, max_context, topk, cbs, workspace, topk_indices,
                    candidate_blocks):
    T = q.shape[0]
    rc, starts = _chunks(T, workspace, max_context)
    if T == 0:
        return
    logits, lens, tmp = ws_mod.carve(workspace, rc, max_context)
    for r0 in starts:
        r1 = min(T, r0 + rc)
        n = r1 - r0
        qs = None if q_scale is None else q_scale[r0:r1]
        _ops.mqa_logits(q[r0:r1], qs, k, k_scale, weights[r0:r1], ks[r0:r1], ke[r0:r1], logits[:n])
        _prefill_lengths(ks[r0:r1], ke[r0:r1], k.shape[0], max_context, lens[:n], tmp[:n])
        _ops.topk(logits[:n], lens[:n], topk, topk_indices[r0:r1])
        if candidate_blocks is not None:
            _ops.block_topk(logits[:n], lens[:n], cbs, candidate_blocks[r0:r1])


def indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context, topk, cbs,
                   workspace, topk_indices, candidate_blocks):
    R = q.shape[0]
    rc, starts = _chunks(R, workspace, max_context)
    if R == 0:
        return
    logits, lens, tmp = ws_mod.carve(workspace, rc, max_context)
    bs = _cache_block_size(kv_cache)
    for r0 in starts:
        r1 = min(R, r0 + rc)
        n = r1 - r0
        qs = None if q_scale is None else q_scale[r0:r1]
        ri = None if req_indices is None else req_indices[r0:r1]
        bt = block_table if req_indices is not None else block_table[r0:r1]
        _ops.paged_mqa_logits(q[r0:r1], qs, kv_cache, weights[r0:r1], context_lens[r0:r1], bt, ri, logits[:n])
        _decode_lengths(context_lens[r0:r1], ri, bt, bs, max_context, lens[:n], tmp[:n])
        _ops.topk(logits[:n], lens[:n], topk, topk_indices[r0:r1])
        if candidate_blocks is not None:
            _ops.block_topk(logits[:n], lens[:n], cbs, candidate_blocks[r0:r1])


def sparse_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, topk, workspace,
                           topk_indices):
    T = q.shape[0]
    width = candidate_blocks.shape[1] * cbs
    rc, starts = _chunks(T, workspace, width)
    if T == 0:
        return
    logits, lens, tmp = ws_mod.carve(workspace, rc, width)
    big = 2 ** 31 - 1
    for r0 in starts:
        r1 = min(T, r0 + rc)
        n = r1 - r0
        qs = None if q_scale is None else q_scale[r0:r1]
        cb = candidate_blocks[r0:r1]
        _ops.sparse_mqa_logits(q[r0:r1], qs, k, k_scale, weights[r0:r1], ks[r0:r1], ke[r0:r1], cb, cbs, logits[:n])
        _prefill_lengths(ks[r0:r1], ke[r0:r1], k.shape[0], big, lens[:n], tmp[:n])
        _ops.sparse_topk(logits[:n], cb, cbs, lens[:n], topk, topk_indices[r0:r1])


def sparse_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks,
                          cbs, topk, workspace, topk_indices):
    R = q.shape[0]
    width = candidate_blocks.shape[1] * cbs
    rc, starts = _chunks(R, workspace, width)
    if R == 0:
        return
    logits, lens, tmp = ws_mod.carve(workspace, rc, width)
    bs = _cache_block_size(kv_cache)
    big = 2 ** 31 - 1
    for r0 in starts:
        r1 = min(R, r0 + rc)
        n = r1 - r0
        qs = None if q_scale is None else q_scale[r0:r1]
        ri = None if req_indices is None else req_indices[r0:r1]
        bt = block_table if req_indices is not None else block_table[r0:r1]
        cb = candidate_blocks[r0:r1]
        _ops.paged_sparse_mqa_logits(q[r0:r1], qs, kv_cache, weights[r0:r1], context_lens[r0:r1], bt, ri, cb, cbs,
                                     logits[:n])
        _decode_lengths(context_lens[r0:r1], ri, bt, bs, big, lens[:n], tmp[:n])
        _ops.sparse_topk(logits[:n], cb, cbs, lens[:n], topk, topk_indices[r0:r1])
