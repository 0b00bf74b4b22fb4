"""Functional wrappers: allocate the outputs, call the mutable op, return the outputs.

Shapes: ``T`` query rows (prefill), ``R`` query rows (decode), ``H`` heads, ``D`` head dim, ``N`` packed
keys, ``L`` logits width, ``NB`` candidate blocks per row. See SPEC sections 3-5 for the layouts.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import formats, workspace as ws_mod

_ops = torch.ops.sparse_indexer


def write_k_cache(k: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor, fmt: str,
                  pow2_scale: bool = True) -> None:
    """Quantize ``k [T, D]`` (bf16/fp16/fp32) into ``kv_cache`` uint8 ``[NB, BS, bpt]`` at
    ``slot_mapping [T]`` (int64/int32; ``slot = block * BS + offset``; negative: skipped)."""
    _ops.write_k_cache(k, slot_mapping, kv_cache, fmt, pow2_scale)


def gather_k(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor, num_tokens: int,
             fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack requests' cached K: returns values (``float8_e4m3fn [N, D]`` or ``uint8 [N, D/2]``) and scales
    (``float32 [N]`` or ``int32 [N]``) with ``N = num_tokens`` (rows past ``cu_seq_lens[-1]`` are zero)."""
    kv = formats.as_3d_cache(kv_cache)
    D = formats.head_dim_from_bytes(fmt, kv.shape[2])
    if fmt == "fp8":
        k = torch.zeros(num_tokens, D, dtype=formats.FP8_DTYPE, device=kv.device)
        s = torch.zeros(num_tokens, dtype=torch.float32, device=kv.device)
    else:
        k = torch.zeros(num_tokens, D // 2, dtype=torch.uint8, device=kv.device)
        s = torch.zeros(num_tokens, dtype=torch.int32, device=kv.device)
    _ops.gather_k(kv_cache, block_table, cu_seq_lens, k, s, fmt)
    return k, s


def quantize_q(q: torch.Tensor, weights: torch.Tensor, fmt: str, weight_scale: float = 1.0):
    """``q [T, H, D]`` -> ``(q_values, q_scale or None, weights float32 [T, H])`` (SPEC section 3)."""
    return _ops.quantize_q(q, weights, fmt, weight_scale)


def _logits(rows, width, dtype, device):
    return torch.empty(rows, width, dtype=dtype, device=device)


def mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, max_context: int, logits_dtype=torch.float32):
    """Dense prefill logits ``[T, max_context]``, compressed layout (column c = key ``ks + c``)."""
    out = _logits(q.shape[0], max_context, logits_dtype, q.device)
    _ops.mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, out)
    return out


def paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context: int,
                     logits_dtype=torch.float32):
    """Dense decode logits ``[R, max_context]`` (column = position)."""
    out = _logits(q.shape[0], max_context, logits_dtype, q.device)
    _ops.paged_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, out)
    return out


def sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs: int,
                      logits_dtype=torch.float32):
    """Prefill logits on candidate blocks ``[T, NB * cbs]`` (sparse layout)."""
    out = _logits(q.shape[0], candidate_blocks.shape[1] * cbs, logits_dtype, q.device)
    _ops.sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, out)
    return out


def paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                            candidate_blocks, cbs: int, logits_dtype=torch.float32):
    """Decode logits on candidate blocks ``[R, NB * cbs]`` (sparse layout)."""
    out = _logits(q.shape[0], candidate_blocks.shape[1] * cbs, logits_dtype, q.device)
    _ops.paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                                 candidate_blocks, cbs, out)
    return out


def topk(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``int32 [R, k]``: best positions among columns ``[0, lengths[r])``, ascending, -1 padded."""
    out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    _ops.topk(logits, lengths, k, out)
    return out


def sparse_topk(logits, candidate_blocks, cbs: int, lengths, k: int) -> torch.Tensor:
    """``int32 [R, k]`` request-local positions selected from sparse logits."""
    out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    _ops.sparse_topk(logits, candidate_blocks, cbs, lengths, k, out)
    return out


def block_topk(logits, lengths, cbs: int, num_blocks: int) -> torch.Tensor:
    """``int32 [R, num_blocks]`` best candidate blocks (ascending, -1 padded)."""
    out = torch.empty(logits.shape[0], num_blocks, dtype=torch.int32, device=logits.device)
    _ops.block_topk(logits, lengths, cbs, out)
    return out


def _ws(rows, width, device):
    return torch.empty(ws_mod.workspace_bytes(max(rows, 1), width), dtype=torch.uint8, device=device)


def _publish(rows, num_candidate_blocks, device):
    if not num_candidate_blocks:
        return None
    return torch.empty(rows, num_candidate_blocks, dtype=torch.int32, device=device)


def indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, max_context: int, topk: int,
                    num_candidate_blocks: int = 0, cbs: int = 16, workspace: Optional[torch.Tensor] = None):
    """Dense level, prefill: ``(topk_indices int32 [T, topk], candidate_blocks int32 [T, NB] or None)``."""
    T = q.shape[0]
    ws = workspace if workspace is not None else _ws(T, max_context, q.device)
    idx = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    cb = _publish(T, num_candidate_blocks, q.device)
    _ops.indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, max_context, topk, cbs, ws, idx, cb)
    return idx, cb


def indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context: int,
                   topk: int, num_candidate_blocks: int = 0, cbs: int = 16,
                   workspace: Optional[torch.Tensor] = None):
    """Dense level, decode: ``(topk_indices int32 [R, topk], candidate_blocks int32 [R, NB] or None)``."""
    R = q.shape[0]
    ws = workspace if workspace is not None else _ws(R, max_context, q.device)
    idx = torch.empty(R, topk, dtype=torch.int32, device=q.device)
    cb = _publish(R, num_candidate_blocks, q.device)
    _ops.indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context, topk,
                        cbs, ws, idx, cb)
    return idx, cb


def sparse_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs: int, topk: int,
                           workspace: Optional[torch.Tensor] = None):
    """Consumer level, prefill: ``topk_indices int32 [T, topk]``."""
    T = q.shape[0]
    ws = workspace if workspace is not None else _ws(T, candidate_blocks.shape[1] * cbs, q.device)
    idx = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    _ops.sparse_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs, topk, ws, idx)
    return idx


def sparse_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, candidate_blocks,
                          cbs: int, topk: int, workspace: Optional[torch.Tensor] = None):
    """Consumer level, decode: ``topk_indices int32 [R, topk]``."""
    R = q.shape[0]
    ws = workspace if workspace is not None else _ws(R, candidate_blocks.shape[1] * cbs, q.device)
    idx = torch.empty(R, topk, dtype=torch.int32, device=q.device)
    _ops.sparse_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                               candidate_blocks, cbs, topk, ws, idx)
    return idx
