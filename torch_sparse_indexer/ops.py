"""Every op of ``torch.ops.sparse_indexer``: schema, input validation, fake, registration.

This module is the one place an op is declared. For each op you find here its schema (``SCHEMAS``),
its validation (``_validate_<op>``, run before any launch and by the fake), and its fake. Kernels
live elsewhere and register themselves with :mod:`torch_sparse_indexer.backends`:

* :mod:`torch_sparse_indexer.reference` -- pure PyTorch, all devices (defines the semantics)
* :mod:`torch_sparse_indexer.pipeline` -- the end-to-end ops composed from the other ops (their reference)
* :mod:`torch_sparse_indexer.kernels` -- GPU kernels (Triton, CUDA, DeepGEMM)

Mutable ops return nothing and name what they write with ``(a!)``. Errors are ``ValueError`` /
``TypeError`` naming the argument, the expectation and what was given. The ops are not differentiable (what
they write or return never requires grad) and run on their tensors' device whichever CUDA device is current.
"""
from __future__ import annotations

import contextlib

import torch
from torch.library import Library

from . import backends, formats, pipeline, reference, workspace

NAMESPACE = "sparse_indexer"

_Q = "Tensor q, Tensor? q_scale"
SCHEMAS = {
    "write_k_cache": "write_k_cache(Tensor k, Tensor slot_mapping, Tensor(a!) kv_cache, str fmt, bool pow2_scale) -> ()",
    "gather_k": "gather_k(Tensor kv_cache, Tensor block_table, Tensor cu_seq_lens, Tensor(a!) k, Tensor(b!) k_scale, str fmt) -> ()",
    "quantize_q": "quantize_q(Tensor q, Tensor weights, str fmt, float weight_scale) -> (Tensor, Tensor?, Tensor)",
    "mqa_logits": f"mqa_logits({_Q}, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke, Tensor(a!) logits) -> ()",
    "paged_mqa_logits": f"paged_mqa_logits({_Q}, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, Tensor? req_indices, Tensor(a!) logits) -> ()",
    "sparse_mqa_logits": f"sparse_mqa_logits({_Q}, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke, Tensor candidate_blocks, int cbs, Tensor(a!) logits) -> ()",
    "paged_sparse_mqa_logits": f"paged_sparse_mqa_logits({_Q}, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, Tensor? req_indices, Tensor candidate_blocks, int cbs, Tensor(a!) logits) -> ()",
    "topk": "topk(Tensor logits, Tensor lengths, int k, Tensor(a!) indices) -> ()",
    "sparse_topk": "sparse_topk(Tensor logits, Tensor candidate_blocks, int cbs, Tensor lengths, int k, Tensor(a!) indices) -> ()",
    "block_topk": "block_topk(Tensor logits, Tensor lengths, int cbs, Tensor(a!) candidate_blocks) -> ()",
    "indexer_prefill": f"indexer_prefill({_Q}, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke, int max_context, int topk, int cbs, Tensor(a!) workspace, Tensor(b!) topk_indices, Tensor(c!)? candidate_blocks) -> ()",
    "indexer_decode": f"indexer_decode({_Q}, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, Tensor? req_indices, int max_context, int topk, int cbs, Tensor(a!) workspace, Tensor(b!) topk_indices, Tensor(c!)? candidate_blocks) -> ()",
    "sparse_indexer_prefill": f"sparse_indexer_prefill({_Q}, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke, Tensor candidate_blocks, int cbs, int topk, Tensor(a!) workspace, Tensor(b!) topk_indices) -> ()",
    "sparse_indexer_decode": f"sparse_indexer_decode({_Q}, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, Tensor? req_indices, Tensor candidate_blocks, int cbs, int topk, Tensor(a!) workspace, Tensor(b!) topk_indices) -> ()",
    # Context parallelism (torch_sparse_indexer.distributed): per-rank candidates and their exact merge.
    "cp_local_topk": "cp_local_topk(Tensor logits, Tensor positions, int k, Tensor(a!) scores, Tensor(b!) out_positions) -> ()",
    "cp_topk_merge": "cp_topk_merge(Tensor scores, Tensor positions, int k, Tensor(a!) indices) -> ()",
    "cp_local_block_topk": "cp_local_block_topk(Tensor logits, Tensor positions, int cbs, Tensor(a!) scores, Tensor(b!) blocks) -> ()",
    "cp_block_merge": "cp_block_merge(Tensor scores, Tensor blocks, Tensor(a!) candidate_blocks) -> ()",
}


# ----------------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------------

def _dt(dtypes):
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _tensor(name, t, *, dtypes=None, ndim=None, optional=False):
    if t is None:
        if optional:
            return
        raise TypeError(f"{name}: expected a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dt(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")


def _shape(name, t, expected):
    """``expected``: tuple of ints or None (any)."""
    got = tuple(t.shape)
    if len(got) != len(expected) or any(e is not None and g != e for g, e in zip(got, expected)):
        exp = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name}: expected shape {exp}, got {list(got)}")


def _contig(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()} for shape {tuple(t.shape)}")


def _last_dim_contig(name, t):
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected stride(-1) == 1, got strides {t.stride()}")


def _same_device(**tensors):
    devs = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devs.values()), None)
    for n, d in devs.items():
        if d != first:
            listing = ", ".join(f"{k}={v}" for k, v in devs.items())
            raise ValueError(f"{n}: expected all tensors on one device, got {listing}")


def _static_int(name, v, allowed=None, lo=None, hi=None):
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if allowed is not None and v not in allowed:
        raise ValueError(f"{name}: expected one of {tuple(allowed)}, got {v}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: expected <= {hi}, got {v}")


_INT32 = (torch.int32,)
_LOGITS = (torch.float32, torch.bfloat16)
_FP4_PACKED = (torch.uint8, torch.int8)


def _validate_q(q, q_scale, weights):
    """Returns (fmt, T, H, D)."""
    _tensor("q", q, dtypes=(formats.FP8_DTYPE,) + _FP4_PACKED, ndim=3)
    fmt = "fp8" if q.dtype == formats.FP8_DTYPE else "mxfp4"
    T, H, dq = q.shape
    D = dq if fmt == "fp8" else 2 * dq
    if D not in formats.HEAD_DIMS:
        raise ValueError(f"q: expected head dim in {formats.HEAD_DIMS} ({'D' if fmt == 'fp8' else 'D/2'} = "
                         f"{q.shape[2]} given for {fmt}), got D = {D}")
    if H % 4 != 0 or not 4 <= H <= formats.MAX_HEADS:
        raise ValueError(f"q: expected a head count that is a multiple of 4 in [4, {formats.MAX_HEADS}], got {H}")
    _contig("q", q)
    if fmt == "fp8":
        if q_scale is not None:
            raise ValueError("q_scale: expected None for fp8 queries (the scale is folded into weights), got a tensor")
    else:
        _tensor("q_scale", q_scale, dtypes=_INT32, ndim=2)
        _shape("q_scale", q_scale, (T, H))
        _contig("q_scale", q_scale)
    _tensor("weights", weights, dtypes=(torch.float32, torch.bfloat16), ndim=2)
    _shape("weights", weights, (T, H))
    _last_dim_contig("weights", weights)
    return fmt, T, H, D


def _validate_packed_k(fmt, D, k, k_scale):
    if fmt == "fp8":
        _tensor("k", k, dtypes=(formats.FP8_DTYPE,), ndim=2)
        _shape("k", k, (None, D))
        _tensor("k_scale", k_scale, dtypes=(torch.float32,), ndim=1)
    else:
        _tensor("k", k, dtypes=_FP4_PACKED, ndim=2)
        _shape("k", k, (None, D // 2))
        _tensor("k_scale", k_scale, dtypes=_INT32, ndim=1)
    _contig("k", k)
    _shape("k_scale", k_scale, (k.shape[0],))
    _contig("k_scale", k_scale)


def _validate_cache(kv_cache, fmt, D=None):
    """Returns (num_blocks, block_size, D)."""
    _tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=(3, 4))
    if kv_cache.dim() == 4 and kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache: expected a 4-D view [num_blocks, block_size, 1, bytes], got shape {list(kv_cache.shape)}")
    kv = formats.as_3d_cache(kv_cache)
    nb, bs, bpt = kv.shape
    if nb < 1:
        raise ValueError(f"kv_cache: expected at least one block (dim 0), got shape {list(kv_cache.shape)}")
    if bs not in formats.CACHE_BLOCK_SIZES:
        raise ValueError(f"kv_cache: expected block_size (dim 1) in {formats.CACHE_BLOCK_SIZES}, got {bs}")
    dc = formats.head_dim_from_bytes(fmt, bpt)
    if D is None and dc not in formats.HEAD_DIMS:
        raise ValueError(f"kv_cache: expected bytes per token (last dim) "
                         f"{[formats.bytes_per_token(fmt, d) for d in formats.HEAD_DIMS]} for {fmt}, got {bpt}")
    if D is not None and dc != D:
        raise ValueError(f"kv_cache: expected {formats.bytes_per_token(fmt, D)} bytes per token for {fmt} with "
                         f"head dim {D}, got {bpt}")
    if kv.stride(2) != 1 or (bs > 1 and kv.stride(1) != bpt):
        raise ValueError(f"kv_cache: expected each page contiguous (strides [*, {bpt}, 1]), got {kv.stride()}")
    if nb > 1 and (kv.stride(0) < bs * bpt or kv.stride(0) % 4 != 0):
        raise ValueError(f"kv_cache: expected a page stride >= {bs * bpt} and a multiple of 4, got {kv.stride(0)}")
    if kv.storage_offset() % 4 != 0:
        raise ValueError(f"kv_cache: expected a 4-byte aligned storage offset, got {kv.storage_offset()}")
    return nb, bs, dc


def _validate_rows_int32(name, t, n):
    _tensor(name, t, dtypes=_INT32, ndim=1)
    _shape(name, t, (n,))
    _contig(name, t)


def _validate_logits(logits, rows, width=None):
    _tensor("logits", logits, dtypes=_LOGITS, ndim=2)
    _shape("logits", logits, (rows, width))
    _last_dim_contig("logits", logits)


def _validate_block_table(block_table):
    _tensor("block_table", block_table, dtypes=_INT32, ndim=2)
    _last_dim_contig("block_table", block_table)
    if block_table.shape[0] < 1 or block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected at least one row and one column, got shape {list(block_table.shape)}")


def _validate_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices):
    fmt, R, H, D = _validate_q(q, q_scale, weights)
    nb, bs, _ = _validate_cache(kv_cache, fmt, D)
    _validate_rows_int32("context_lens", context_lens, R)
    _validate_block_table(block_table)
    if req_indices is not None:
        _validate_rows_int32("req_indices", req_indices, R)
    elif block_table.shape[0] < R:
        raise ValueError(f"block_table: expected at least {R} rows (one per query row when req_indices is None), "
                         f"got {block_table.shape[0]}")
    return fmt, R, H, D, bs


def _validate_candidates(candidate_blocks, rows, cbs, cache_block_size=None, name="candidate_blocks"):
    _static_int("cbs", cbs, formats.CANDIDATE_BLOCK_SIZES)
    if cache_block_size is not None and cache_block_size % cbs != 0:
        raise ValueError(f"cbs: expected a divisor of the cache block size {cache_block_size}, got {cbs}")
    _tensor(name, candidate_blocks, dtypes=_INT32, ndim=2)
    _shape(name, candidate_blocks, (rows, None))
    _contig(name, candidate_blocks)
    if candidate_blocks.shape[1] < 1:
        raise ValueError(f"{name}: expected at least one column, got shape {list(candidate_blocks.shape)}")
    return candidate_blocks.shape[1]


def _validate_topk_out(indices, rows, k, name="indices", kname="k"):
    _static_int(kname, k, lo=1, hi=formats.MAX_TOPK)
    _tensor(name, indices, dtypes=_INT32, ndim=2)
    _shape(name, indices, (rows, k))
    _contig(name, indices)


def _validate_workspace(ws, width):
    _tensor("workspace", ws, dtypes=(torch.uint8,), ndim=1)
    _contig("workspace", ws)
    need = workspace.min_workspace_bytes(width)
    if ws.numel() < need:
        raise ValueError(f"workspace: expected at least {need} bytes (see torch_sparse_indexer.workspace), "
                         f"got {ws.numel()}")
    if ws.storage_offset() % workspace.ALIGN != 0:
        raise ValueError(f"workspace: expected a {workspace.ALIGN}-byte aligned start, got storage offset "
                         f"{ws.storage_offset()}")


# ----------------------------------------------------------------------------------------------------
# Per-op validation (the fake and every backend run these first)
# ----------------------------------------------------------------------------------------------------

def _validate_write_k_cache(k, slot_mapping, kv_cache, fmt, pow2_scale):
    formats.check_fmt(fmt)
    _tensor("k", k, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    _contig("k", k)
    _, _, D = _validate_cache(kv_cache, fmt)
    _shape("k", k, (None, D))
    _tensor("slot_mapping", slot_mapping, dtypes=(torch.int64, torch.int32), ndim=1)
    _shape("slot_mapping", slot_mapping, (k.shape[0],))
    _contig("slot_mapping", slot_mapping)
    _same_device(k=k, slot_mapping=slot_mapping, kv_cache=kv_cache)


def _validate_gather_k(kv_cache, block_table, cu_seq_lens, k, k_scale, fmt):
    formats.check_fmt(fmt)
    _, _, D = _validate_cache(kv_cache, fmt)
    _validate_block_table(block_table)
    _tensor("cu_seq_lens", cu_seq_lens, dtypes=_INT32, ndim=1)
    _contig("cu_seq_lens", cu_seq_lens)
    if cu_seq_lens.shape[0] < 1:
        raise ValueError("cu_seq_lens: expected [num_reqs + 1] entries, got an empty tensor")
    _validate_packed_k(fmt, D, k, k_scale)
    _same_device(kv_cache=kv_cache, block_table=block_table, cu_seq_lens=cu_seq_lens, k=k, k_scale=k_scale)


def _validate_quantize_q(q, weights, fmt, weight_scale):
    formats.check_fmt(fmt)
    _tensor("q", q, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    T, H, D = q.shape
    if D not in formats.HEAD_DIMS:
        raise ValueError(f"q: expected head dim (dim 2) in {formats.HEAD_DIMS}, got {D}")
    _tensor("weights", weights, dtypes=(torch.float32, torch.bfloat16), ndim=2)
    _shape("weights", weights, (T, H))
    if not -float("inf") < weight_scale < float("inf"):  # NaN fails both comparisons
        raise ValueError(f"weight_scale: expected a finite float, got {weight_scale}")
    _same_device(q=q, weights=weights)


def _validate_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, logits):
    fmt, T, H, D = _validate_q(q, q_scale, weights)
    _validate_packed_k(fmt, D, k, k_scale)
    _validate_rows_int32("ks", ks, T)
    _validate_rows_int32("ke", ke, T)
    _validate_logits(logits, T)
    _same_device(q=q, q_scale=q_scale, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, logits=logits)


def _validate_paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, logits):
    _, R, *_ = _validate_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices)
    _validate_logits(logits, R)
    _same_device(q=q, q_scale=q_scale, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                 block_table=block_table, req_indices=req_indices, logits=logits)


def _validate_sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, logits):
    fmt, T, H, D = _validate_q(q, q_scale, weights)
    _validate_packed_k(fmt, D, k, k_scale)
    _validate_rows_int32("ks", ks, T)
    _validate_rows_int32("ke", ke, T)
    nb = _validate_candidates(candidate_blocks, T, cbs)
    _validate_logits(logits, T, nb * cbs)
    _same_device(q=q, q_scale=q_scale, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke,
                 candidate_blocks=candidate_blocks, logits=logits)


def _validate_paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                                      candidate_blocks, cbs, logits):
    _, R, H, D, bs = _validate_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices)
    nb = _validate_candidates(candidate_blocks, R, cbs, bs)
    _validate_logits(logits, R, nb * cbs)
    _same_device(q=q, q_scale=q_scale, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                 block_table=block_table, req_indices=req_indices, candidate_blocks=candidate_blocks, logits=logits)


def _validate_topk(logits, lengths, k, indices):
    _tensor("logits", logits, dtypes=_LOGITS, ndim=2)
    _last_dim_contig("logits", logits)
    R = logits.shape[0]
    _validate_rows_int32("lengths", lengths, R)
    _validate_topk_out(indices, R, k)
    _same_device(logits=logits, lengths=lengths, indices=indices)


def _validate_sparse_topk(logits, candidate_blocks, cbs, lengths, k, indices):
    _tensor("logits", logits, dtypes=_LOGITS, ndim=2)
    _last_dim_contig("logits", logits)
    R = logits.shape[0]
    nb = _validate_candidates(candidate_blocks, R, cbs)
    _shape("logits", logits, (R, nb * cbs))
    _validate_rows_int32("lengths", lengths, R)
    _validate_topk_out(indices, R, k)
    _same_device(logits=logits, candidate_blocks=candidate_blocks, lengths=lengths, indices=indices)


def _validate_block_topk(logits, lengths, cbs, candidate_blocks):
    _tensor("logits", logits, dtypes=_LOGITS, ndim=2)
    _last_dim_contig("logits", logits)
    R = logits.shape[0]
    _validate_rows_int32("lengths", lengths, R)
    _validate_candidates(candidate_blocks, R, cbs)
    _same_device(logits=logits, lengths=lengths, candidate_blocks=candidate_blocks)


def _validate_publish(candidate_blocks, rows, cbs, bs=None):
    if candidate_blocks is not None:
        _validate_candidates(candidate_blocks, rows, cbs, bs)


def _validate_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, max_context, topk, cbs, ws, topk_indices,
                              candidate_blocks):
    fmt, T, H, D = _validate_q(q, q_scale, weights)
    _validate_packed_k(fmt, D, k, k_scale)
    _validate_rows_int32("ks", ks, T)
    _validate_rows_int32("ke", ke, T)
    _static_int("max_context", max_context, lo=1)
    _validate_topk_out(topk_indices, T, topk, "topk_indices", "topk")
    _validate_publish(candidate_blocks, T, cbs)
    _validate_workspace(ws, max_context)
    _same_device(q=q, q_scale=q_scale, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, workspace=ws,
                 topk_indices=topk_indices, candidate_blocks=candidate_blocks)


def _validate_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context,
                             topk, cbs, ws, topk_indices, candidate_blocks):
    _, R, H, D, bs = _validate_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices)
    _static_int("max_context", max_context, lo=1)
    _validate_topk_out(topk_indices, R, topk, "topk_indices", "topk")
    _validate_publish(candidate_blocks, R, cbs, bs)
    _validate_workspace(ws, max_context)
    _same_device(q=q, q_scale=q_scale, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                 block_table=block_table, req_indices=req_indices, workspace=ws, topk_indices=topk_indices,
                 candidate_blocks=candidate_blocks)


def _validate_sparse_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, topk, ws,
                                     topk_indices):
    fmt, T, H, D = _validate_q(q, q_scale, weights)
    _validate_packed_k(fmt, D, k, k_scale)
    _validate_rows_int32("ks", ks, T)
    _validate_rows_int32("ke", ke, T)
    nb = _validate_candidates(candidate_blocks, T, cbs)
    _validate_topk_out(topk_indices, T, topk, "topk_indices", "topk")
    _validate_workspace(ws, nb * cbs)
    _same_device(q=q, q_scale=q_scale, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke,
                 candidate_blocks=candidate_blocks, workspace=ws, topk_indices=topk_indices)


def _validate_sparse_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                                    candidate_blocks, cbs, topk, ws, topk_indices):
    _, R, H, D, bs = _validate_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices)
    nb = _validate_candidates(candidate_blocks, R, cbs, bs)
    _validate_topk_out(topk_indices, R, topk, "topk_indices", "topk")
    _validate_workspace(ws, nb * cbs)
    _same_device(q=q, q_scale=q_scale, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                 block_table=block_table, req_indices=req_indices, candidate_blocks=candidate_blocks,
                 workspace=ws, topk_indices=topk_indices)


def _validate_cp_entries(sname, scores, sdtypes, iname, ids, ndim):
    """Candidate entries: scores and int32 ids of one shape, stride(-1) == 1 (views of a gather buffer)."""
    _tensor(sname, scores, dtypes=sdtypes, ndim=ndim)
    _last_dim_contig(sname, scores)
    _tensor(iname, ids, dtypes=_INT32, ndim=ndim)
    _shape(iname, ids, tuple(scores.shape))
    _last_dim_contig(iname, ids)


def _validate_cp_out(sname, scores, iname, ids, rows, width=None):
    _tensor(sname, scores, dtypes=(torch.float32,), ndim=2)
    _shape(sname, scores, (rows, width))
    _contig(sname, scores)
    _tensor(iname, ids, dtypes=_INT32, ndim=2)
    _shape(iname, ids, (rows, scores.shape[1]))
    _contig(iname, ids)
    if scores.shape[1] < 1:
        raise ValueError(f"{sname}: expected at least one column, got shape {list(scores.shape)}")


def _validate_cp_local_topk(logits, positions, k, scores, out_positions):
    _validate_cp_entries("logits", logits, _LOGITS, "positions", positions, 2)
    _static_int("k", k, lo=1, hi=formats.MAX_TOPK)
    _validate_cp_out("scores", scores, "out_positions", out_positions, logits.shape[0], k)
    _same_device(logits=logits, positions=positions, scores=scores, out_positions=out_positions)


def _validate_cp_topk_merge(scores, positions, k, indices):
    _validate_cp_entries("scores", scores, (torch.float32,), "positions", positions, 3)
    _validate_topk_out(indices, scores.shape[1], k)
    _same_device(scores=scores, positions=positions, indices=indices)


def _validate_cp_local_block_topk(logits, positions, cbs, scores, blocks):
    _validate_cp_entries("logits", logits, _LOGITS, "positions", positions, 2)
    _static_int("cbs", cbs, formats.CANDIDATE_BLOCK_SIZES)
    _validate_cp_out("scores", scores, "blocks", blocks, logits.shape[0])
    _same_device(logits=logits, positions=positions, scores=scores, blocks=blocks)


def _validate_cp_block_merge(scores, blocks, candidate_blocks):
    _validate_cp_entries("scores", scores, (torch.float32,), "blocks", blocks, 3)
    _tensor("candidate_blocks", candidate_blocks, dtypes=_INT32, ndim=2)
    _shape("candidate_blocks", candidate_blocks, (scores.shape[1], None))
    _contig("candidate_blocks", candidate_blocks)
    if candidate_blocks.shape[1] < 1:
        raise ValueError(f"candidate_blocks: expected at least one column, got shape {list(candidate_blocks.shape)}")
    _same_device(scores=scores, blocks=blocks, candidate_blocks=candidate_blocks)


VALIDATORS = {name: globals()[f"_validate_{name}"] for name in SCHEMAS}


# ----------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------

_lib = Library(NAMESPACE, "DEF")  # module scope: the ops live as long as the module


def _fake_quantize_q(q, weights, fmt, weight_scale):
    _validate_quantize_q(q, weights, fmt, weight_scale)
    T, H, D = q.shape
    w = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if fmt == "fp8":
        return torch.empty((T, H, D), dtype=formats.FP8_DTYPE, device=q.device), None, w
    return (torch.empty((T, H, D // 2), dtype=torch.uint8, device=q.device),
            torch.empty((T, H), dtype=torch.int32, device=q.device), w)


def _other_cuda_device(args) -> int | None:
    """The CUDA device index of the op's tensors where it is not the current device, else None.

    Triton, the CUDA libraries and DeepGEMM launch on the *current* device (with that device's stream), and a
    Python kernel registered through ``torch.library`` gets no device guard from the dispatcher; so a call on
    ``cuda:1`` tensors while ``cuda:0`` is current (``device_map``-style placement, one process driving several
    GPUs) would launch on the wrong GPU. Validation has already checked that all tensors share one device.
    """
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cuda":
                return None
            idx = a.device.index
            return idx if idx is not None and idx != torch.cuda.current_device() else None
    return None


def _make_impl(name):
    validate = VALIDATORS[name]

    def impl(*args):
        validate(*args)
        dev = _other_cuda_device(args)
        # no_grad: the ops are not differentiable, and a backend written in PyTorch (the reference) would
        # otherwise record an autograd graph through its writes (CPU gradients that no GPU backend gives).
        with torch.no_grad(), (torch.cuda.device(dev) if dev is not None else contextlib.nullcontext()):
            return backends.dispatch(name, *args)
    impl.__name__ = f"{name}_impl"
    return impl


def _make_fake(name):
    validate = VALIDATORS[name]

    def fake(*args):
        validate(*args)
    fake.__name__ = f"{name}_fake"
    return fake


for _name, _schema in SCHEMAS.items():
    _lib.define(_schema, tags=(torch.Tag.pt2_compliant_tag,))
    _impl = _make_impl(_name)
    _lib.impl(_name, _impl, "CPU")
    _lib.impl(_name, _impl, "CUDA")
    # Not differentiable: outputs never require grad, and no autograd warning at backward (torch's advice for
    # ops without a derivative).
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake_quantize_q if _name == "quantize_q" else _make_fake(_name),
                                lib=_lib)
    # The end-to-end ops' reference is the composition of the other ops (each dispatched on its own).
    backends.register(_name, "reference", getattr(reference, _name, None) or getattr(pipeline, _name), priority=-100)
