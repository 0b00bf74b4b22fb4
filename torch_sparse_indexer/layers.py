"""The ``nn.Module`` layers an engine uses (SPEC section 6): the paged K cache and the two indexer levels.

* :class:`IndexerKCache` owns one layer's paged K cache (``fp8`` or ``mxfp4``) as a module buffer.
* :class:`MQAIndexer` is the dense level (DeepSeek V3.2's indexer; the V4.1 *candidate source* when it is
  given a ``candidate_blocks`` buffer to publish into).
* :class:`SparseMQAIndexer` is the consumer level: it scores only the published candidate blocks.

Both take vLLM's ``SparseMQAIndexer`` constructor arguments (``k_cache, topk_tokens, head_dim,
max_total_seq_len, topk_indices_buffer, candidate_blocks, candidate_block_size``) plus the static
``capacities`` (:class:`~torch_sparse_indexer.metadata.IndexerCapacities`), and ``forward(q, q_scale,
weights, k, metadata)`` fills the caller's ``topk_indices_buffer [max_tokens, topk]`` in place, rows in the
step's order (decode rows first, then prefill rows). Every op is called through
``torch.ops.sparse_indexer``; workspace, packed-K gather buffers and decode scratch are module buffers
allocated once here, so a step compiles to direct calls on static buffers and captures in one CUDA graph.

How a step runs (``c`` = the metadata's capacities, ``T = q.shape[0] <= c.max_tokens``):

1. ``k`` given: ``write_k_cache(k, metadata.slot_mapping[:len(k)])``.
2. ``c.max_prefill_rows > 0``: ``gather_k`` packs the prefill requests' K, then the prefill op runs on all
   ``T`` rows (decode rows have ``ks == ke``, so they come out ``-1``).
3. ``c.max_decode_rows > 0``: the decode op runs on rows ``[0, min(T, max_decode_rows))`` over the paged
   cache (prefill rows there have length 0, so they come out ``-1``). With a prefill part too it writes to
   a scratch buffer merged into those rows by an elementwise ``max`` (``sparse_indexer_layers.merge_rows``):
   exact, because on every row one of the two results is all ``-1`` and the other is ``>= -1``. Without a
   prefill part (decode-only capacities, ``T <= max_decode_rows``) it writes the rows directly.

The layers' capacities are the largest a step may have; a step's metadata may have smaller ones (a
decode-only graph, prefill buckets) as long as they fit (checked on the host in ``forward``).

Candidate blocks (``candidate_blocks [max_tokens, num_candidate_blocks]``, units of
``candidate_block_size``) are published and merged the same way.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from torch.library import Library

from . import backends, formats, workspace as ws_mod
from .metadata import IndexerCapacities, IndexerMetadata

__all__ = ["IndexerKCache", "MQAIndexer", "SparseMQAIndexer"]

_ops = torch.ops.sparse_indexer

# The decode scratch is merged into the step's rows by a mutable op of its own: written as an in-place
# aten op on a slice, functionalization would turn it into a slice_scatter that Inductor lowers as a read
# and write of the whole [max_tokens, k] buffer (and a full copy of the candidate buffer the consumers
# read); a custom op on the slice is re-inplaced to one call that touches only the decode rows.
_merge_lib = Library("sparse_indexer_layers", "DEF")
_merge_lib.define("merge_rows(Tensor(a!) dst, Tensor src) -> ()", tags=(torch.Tag.pt2_compliant_tag,))


def _merge_rows_impl(dst, src):
    torch.maximum(dst, src, out=dst)


def _merge_rows_fake(dst, src):
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"src: expected {dst.dtype} {list(dst.shape)} like dst, got {src.dtype} {list(src.shape)}")


_merge_lib.impl("merge_rows", _merge_rows_impl, "CompositeExplicitAutograd")
torch.library.register_fake("sparse_indexer_layers::merge_rows", _merge_rows_fake, lib=_merge_lib)
_merge_ops = torch.ops.sparse_indexer_layers


class IndexerKCache(nn.Module):
    """One layer's paged indexer K cache, ``uint8 [num_blocks, block_size, bytes_per_token]`` (SPEC section 3),
    as the module buffer ``kv_cache``.

    ``kv_cache``: wrap an engine-allocated cache instead of allocating one (3-D or the 4-D
    ``[num_blocks, block_size, 1, bytes]`` view). ``pow2_scale``: fp8 scales rounded up to a power of two
    (vLLM's ``ue8m0``, DeepSeek's default).
    """

    def __init__(self, num_blocks: int, block_size: int, head_dim: int, fmt: str = "fp8", *,
                 pow2_scale: bool = True, device=None, kv_cache: Optional[torch.Tensor] = None):
        super().__init__()
        formats.check_fmt(fmt)
        if kv_cache is None:
            if not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(f"num_blocks: expected an int >= 1, got {num_blocks!r}")
            kv_cache = formats.allocate_k_cache(num_blocks, block_size, head_dim, fmt, device)
        else:
            want = (num_blocks, block_size, formats.bytes_per_token(fmt, head_dim))
            got = tuple(formats.as_3d_cache(kv_cache).shape)
            if kv_cache.dtype != torch.uint8 or got != want:
                raise ValueError(f"kv_cache: expected uint8 {list(want)} for {fmt} with head_dim {head_dim}, "
                                 f"got {kv_cache.dtype} {list(kv_cache.shape)}")
        self.fmt = fmt
        self.block_size = block_size
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.pow2_scale = pow2_scale
        self.register_buffer("kv_cache", kv_cache, persistent=False)
        torch._dynamo.mark_static_address(kv_cache, guard=False)

    def write(self, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize ``k [T, head_dim]`` (bf16/fp16/fp32) into the slots ``slot_mapping [T]`` (int64/int32,
        ``block * block_size + offset``; negative: skipped)."""
        _ops.write_k_cache(k, slot_mapping, self.kv_cache, self.fmt, self.pow2_scale)

    def forward(self, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.write(k, slot_mapping)

    def extra_repr(self) -> str:
        return f"{self.fmt}, num_blocks={self.num_blocks}, block_size={self.block_size}, head_dim={self.head_dim}"


def _int32_rows(name, t, rows, cols=None):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2:
        raise TypeError(f"{name}: expected a 2-D int32 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
    if t.shape[0] < rows or (cols is not None and t.shape[1] != cols):
        raise ValueError(f"{name}: expected shape [>= {rows}, {cols if cols is not None else '*'}], "
                         f"got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


class _IndexerBase(nn.Module):
    _sparse = False

    def __init__(self, k_cache: IndexerKCache, topk_tokens: int, head_dim: int, max_total_seq_len: Optional[int],
                 topk_indices_buffer: torch.Tensor, candidate_blocks: Optional[torch.Tensor],
                 candidate_block_size: int, *, capacities: IndexerCapacities,
                 logits_budget_bytes: int = ws_mod.DEFAULT_LOGITS_BUDGET,
                 workspace: Optional[torch.Tensor] = None):
        super().__init__()
        if not isinstance(k_cache, IndexerKCache):
            raise TypeError(f"k_cache: expected an IndexerKCache, got {type(k_cache).__name__}")
        if not isinstance(capacities, IndexerCapacities):
            raise TypeError(f"capacities: expected IndexerCapacities, got {type(capacities).__name__}")
        if head_dim != k_cache.head_dim:
            raise ValueError(f"head_dim: expected the cache's head dim {k_cache.head_dim}, got {head_dim}")
        if capacities.block_size != k_cache.block_size:
            raise ValueError(f"capacities: expected block_size {k_cache.block_size} (the cache's), got "
                             f"{capacities.block_size}")
        if not isinstance(topk_tokens, int) or not 1 <= topk_tokens <= formats.MAX_TOPK:
            raise ValueError(f"topk_tokens: expected an int in [1, {formats.MAX_TOPK}], got {topk_tokens!r}")
        if max_total_seq_len is None:
            max_total_seq_len = capacities.max_packed_k
        if max_total_seq_len < capacities.max_packed_k:
            raise ValueError(f"max_total_seq_len: expected >= capacities.max_packed_k = {capacities.max_packed_k} "
                             f"(the packed-K rows a step gathers), got {max_total_seq_len}")
        c = capacities
        device = k_cache.kv_cache.device
        _int32_rows("topk_indices_buffer", topk_indices_buffer, c.max_tokens, topk_tokens)
        if topk_indices_buffer.device != device:
            raise ValueError(f"topk_indices_buffer: expected a tensor on {device} (the cache's), got "
                             f"{topk_indices_buffer.device}")
        if self._sparse and candidate_blocks is None:
            raise ValueError("candidate_blocks: expected the buffer the candidate source publishes into, got None")
        nbk = 0
        if candidate_blocks is not None:
            _int32_rows("candidate_blocks", candidate_blocks, c.max_tokens)
            if candidate_blocks.device != device:
                raise ValueError(f"candidate_blocks: expected a tensor on {device}, got {candidate_blocks.device}")
            nbk = candidate_blocks.shape[1]
            if nbk < 1:
                raise ValueError(f"candidate_blocks: expected at least one column, got {list(candidate_blocks.shape)}")
            if candidate_block_size not in formats.CANDIDATE_BLOCK_SIZES:
                raise ValueError(f"candidate_block_size: expected one of {formats.CANDIDATE_BLOCK_SIZES}, got "
                                 f"{candidate_block_size!r}")
            if k_cache.block_size % candidate_block_size:
                raise ValueError(f"candidate_block_size: expected a divisor of the cache block size "
                                 f"{k_cache.block_size}, got {candidate_block_size}")
        self.k_cache = k_cache
        self.topk_tokens = topk_tokens
        self.head_dim = head_dim
        self.max_total_seq_len = max_total_seq_len
        self.capacities = c
        self.candidate_block_size = candidate_block_size
        self.num_candidate_blocks = nbk
        self.fmt = k_cache.fmt
        reg = self.register_buffer
        reg("topk_indices_buffer", topk_indices_buffer, persistent=False)
        reg("candidate_blocks", candidate_blocks, persistent=False)

        # Workspace: one buffer for the prefill and decode calls (they run one after the other).
        need = self.workspace_bytes(c, nbk, candidate_block_size, logits_budget_bytes)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.uint8, device=device)
        elif (workspace.dtype != torch.uint8 or workspace.dim() != 1 or workspace.numel() < need
              or workspace.device != device or workspace.storage_offset() % ws_mod.ALIGN):
            raise ValueError(f"workspace: expected a {ws_mod.ALIGN}-byte aligned uint8 [>= {need}] tensor on {device}, "
                             f"got {workspace.dtype} {list(workspace.shape)} on {workspace.device}")
        reg("workspace", workspace, persistent=False)
        if c.has_prefill:
            vb = formats.value_bytes(self.fmt, head_dim)
            kv = torch.zeros(max_total_seq_len, vb, dtype=torch.uint8, device=device)
            reg("packed_k", kv.view(formats.FP8_DTYPE) if self.fmt == "fp8" else kv, persistent=False)
            reg("packed_k_scale", torch.zeros(max_total_seq_len, device=device,
                                              dtype=torch.float32 if self.fmt == "fp8" else torch.int32),
                persistent=False)
        else:
            reg("packed_k", None, persistent=False)
            reg("packed_k_scale", None, persistent=False)
        both = c.has_prefill and c.has_decode
        reg("decode_topk", torch.full((c.max_decode_rows, topk_tokens), -1, dtype=torch.int32, device=device)
            if both else None, persistent=False)
        reg("decode_candidates", torch.full((c.max_decode_rows, nbk), -1, dtype=torch.int32, device=device)
            if both and nbk and not self._sparse else None, persistent=False)
        for name in ("workspace", "packed_k", "packed_k_scale", "decode_topk", "decode_candidates",
                     "topk_indices_buffer", "candidate_blocks"):
            if getattr(self, name) is not None:
                torch._dynamo.mark_static_address(getattr(self, name), guard=False)

    # ------------------------------------------------------------------------------------------------
    @classmethod
    def workspace_bytes(cls, capacities: IndexerCapacities, num_candidate_blocks: int = 0,
                        candidate_block_size: int = 16,
                        logits_budget_bytes: int = ws_mod.DEFAULT_LOGITS_BUDGET) -> int:
        """Bytes of the layer's workspace for these capacities (pass a shared one of at least this size)."""
        c = capacities
        if cls._sparse:
            width = (num_candidate_blocks, candidate_block_size)
            size = lambda rows: ws_mod.sparse_workspace_bytes(rows, *width, logits_budget_bytes)  # noqa: E731
        else:
            size = lambda rows: ws_mod.dense_workspace_bytes(rows, c.max_context, logits_budget_bytes)  # noqa: E731
        need = 0
        if c.has_prefill:
            need = max(need, size(c.max_tokens))
        if c.has_decode:
            need = max(need, size(c.max_decode_rows))
        return need

    def _check_step(self, q, metadata):
        if not isinstance(metadata, IndexerMetadata):
            raise TypeError(f"metadata: expected IndexerMetadata, got {type(metadata).__name__}")
        mc, c = metadata.capacities, self.capacities
        if (mc.max_decode_rows > c.max_decode_rows or mc.max_tokens > c.max_tokens
                or mc.max_packed_k > self.max_total_seq_len or mc.max_context > c.max_context
                or mc.block_size != c.block_size or (mc.has_prefill and not c.has_prefill)
                or (mc.has_decode and mc.has_prefill and not (c.has_decode and c.has_prefill))):
            raise ValueError(f"metadata: expected capacities within the layer's {c} (max_packed_k up to "
                             f"max_total_seq_len = {self.max_total_seq_len}), got {mc}")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError(f"q: expected a 3-D tensor [T, H, D or D/2], got {getattr(q, 'shape', q)}")
        if q.shape[0] > mc.max_tokens:
            raise ValueError(f"q: expected at most max_tokens = {mc.max_tokens} rows, got {q.shape[0]}")
        return mc

    def forward(self, q: torch.Tensor, q_scale: Optional[torch.Tensor], weights: torch.Tensor,
                k: Optional[torch.Tensor], metadata: IndexerMetadata) -> torch.Tensor:
        """Fill ``topk_indices_buffer[:T]`` (int32, request-local positions ascending, -1 padded).

        ``q``: ``float8_e4m3fn [T, H, D]`` (fp8) or ``uint8 [T, H, D/2]`` + ``q_scale int32 [T, H]`` (mxfp4),
        from ``torch.ops.sparse_indexer.quantize_q``; ``weights float32/bf16 [T, H]`` (q scale and
        ``softmax_scale * H^-0.5`` folded in); ``k``: optional new keys ``[<= max_tokens, D]`` bf16/fp16/fp32
        written first at ``metadata.slot_mapping``; ``metadata``: this step's
        :class:`~torch_sparse_indexer.metadata.IndexerMetadata`. Returns ``topk_indices_buffer``.
        """
        mc = self._check_step(q, metadata)
        m = metadata
        if k is not None:
            if m.slot_mapping is None:
                raise ValueError("k: expected metadata with a slot_mapping to write new keys, got one without")
            self.k_cache.write(k, m.slot_mapping[: k.shape[0]])
        T = q.shape[0]
        Rd = min(T, mc.max_decode_rows)
        out = self.topk_indices_buffer
        cand = self.candidate_blocks
        kv = self.k_cache.kv_cache
        if mc.has_prefill:
            _ops.gather_k(kv, m.block_table, m.cu_seq_lens, self.packed_k, self.packed_k_scale, self.fmt)
            self._prefill(q, q_scale, weights, m.prefill_ks[:T], m.prefill_ke[:T], mc, out[:T],
                          None if cand is None else cand[:T])
            if Rd:
                dec_out = self.decode_topk[:Rd]
                dec_cand = None if self.decode_candidates is None else self.decode_candidates[:Rd]
                self._decode(q, q_scale, weights, m, Rd, mc, dec_out, cand, dec_cand)
                _merge_ops.merge_rows(out[:Rd], dec_out)
                if dec_cand is not None:
                    _merge_ops.merge_rows(cand[:Rd], dec_cand)
        else:  # decode-only capacities: T <= max_tokens == max_decode_rows
            self._decode(q, q_scale, weights, m, Rd, mc, out[:Rd], cand, None if cand is None else cand[:Rd])
        return out

    # ------------------------------------------------------------------------------------------------
    def _decode_args(self, q, q_scale, weights, m, Rd):
        qs = None if q_scale is None else q_scale[:Rd]
        return (q[:Rd], qs, self.k_cache.kv_cache, weights[:Rd], m.decode_context_lens[:Rd], m.block_table,
                m.decode_req_indices[:Rd])

    def warmup(self, num_heads: int, *, weights_dtype: torch.dtype = torch.float32,
               k_dtype: Optional[torch.dtype] = torch.bfloat16,
               capacities: Optional[Iterable[IndexerCapacities]] = None) -> None:
        """Run every op this configuration can launch once on dummy inputs at full capacity, so GPU kernels
        (Triton, DeepGEMM JIT) compile before any CUDA-graph capture.

        ``capacities``: the metadata capacities the layer will be stepped with (e.g. a decode-only one and
        the prefill buckets); default: the layer's own. ``k_dtype``: dtype of the new keys ``forward`` gets
        (``None``: the layer never writes K). The K cache is not modified (every dummy slot is -1); the
        ``topk_indices_buffer`` / ``candidate_blocks`` rows and the scratch buffers are overwritten.
        """
        dev = self.k_cache.kv_cache.device
        caps = list(capacities) if capacities is not None else [self.capacities]
        H, D = num_heads, self.head_dim
        if dev.type == "cuda":
            self._backend_warmups(dev, H, weights_dtype, caps)
        with torch.no_grad():
            for c in caps:
                T = c.max_tokens
                q, qs = _dummy_q(T, H, D, self.fmt, dev)
                w = torch.zeros(T, H, dtype=weights_dtype, device=dev)
                k = None if k_dtype is None else torch.zeros(T, D, dtype=k_dtype, device=dev)
                self.forward(q, qs, w, k, _dummy_metadata(c, dev, k is not None))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _backend_warmups(self, dev, H, weights_dtype, caps):
        """Kernel families with compile-time work that the plain forward does not reach (DeepGEMM: per-stream
        state on the capture stream, metadata buckets)."""
        if any(b.name == "deepgemm" for op in ("indexer_decode", "sparse_indexer_decode")
               for b in backends.candidates(op)):
            from .kernels import deepgemm
            rows = max(c.max_tokens for c in caps)
            deepgemm.warmup(dev, H, self.head_dim, self.fmt, self.k_cache.block_size,
                            self.candidate_block_size if self.num_candidate_blocks else 8, max_rows=rows,
                            weights_dtype=weights_dtype, num_candidate_blocks=self.num_candidate_blocks or None)

    def extra_repr(self) -> str:
        return (f"{self.fmt}, topk={self.topk_tokens}, head_dim={self.head_dim}, "
                f"candidates={self.num_candidate_blocks}x{self.candidate_block_size}, {self.capacities}")


class MQAIndexer(_IndexerBase):
    """Dense level: scores every position (prefill over gathered K, decode over the paged cache), writes the
    top ``topk_tokens`` positions per row and, given ``candidate_blocks int32 [>= max_tokens, NB]``,
    publishes the ``NB`` best blocks of ``candidate_block_size`` positions per row (SPEC section 4).

    ``max_total_seq_len``: packed-K rows (the most keys a step's prefill requests gather; default
    ``capacities.max_packed_k``). Dense logits are ``capacities.max_context`` wide.
    """

    def __init__(self, k_cache: IndexerKCache, topk_tokens: int, head_dim: int,
                 max_total_seq_len: Optional[int], topk_indices_buffer: torch.Tensor,
                 candidate_blocks: Optional[torch.Tensor] = None, candidate_block_size: int = 16, *,
                 capacities: IndexerCapacities, logits_budget_bytes: int = ws_mod.DEFAULT_LOGITS_BUDGET,
                 workspace: Optional[torch.Tensor] = None):
        super().__init__(k_cache, topk_tokens, head_dim, max_total_seq_len, topk_indices_buffer, candidate_blocks,
                         candidate_block_size, capacities=capacities, logits_budget_bytes=logits_budget_bytes,
                         workspace=workspace)

    def _prefill(self, q, q_scale, weights, ks, ke, mc, out, cand):
        _ops.indexer_prefill(q, q_scale, self.packed_k, self.packed_k_scale, weights, ks, ke, mc.max_context,
                             self.topk_tokens, self.candidate_block_size, self.workspace, out, cand)

    def _decode(self, q, q_scale, weights, m, Rd, mc, out, cand_all, cand):
        if Rd == 0:
            return
        _ops.indexer_decode(*self._decode_args(q, q_scale, weights, m, Rd), mc.max_context, self.topk_tokens,
                            self.candidate_block_size, self.workspace, out, cand)


class SparseMQAIndexer(_IndexerBase):
    """Consumer level: scores only the candidate blocks a source :class:`MQAIndexer` published into
    ``candidate_blocks`` (same buffer, same ``candidate_block_size``) and writes the top ``topk_tokens``
    positions per row. Work and memory are O(candidates), never O(context)."""
    _sparse = True

    def __init__(self, k_cache: IndexerKCache, topk_tokens: int, head_dim: int,
                 max_total_seq_len: Optional[int], topk_indices_buffer: torch.Tensor,
                 candidate_blocks: torch.Tensor, candidate_block_size: int, *,
                 capacities: IndexerCapacities, logits_budget_bytes: int = ws_mod.DEFAULT_LOGITS_BUDGET,
                 workspace: Optional[torch.Tensor] = None):
        super().__init__(k_cache, topk_tokens, head_dim, max_total_seq_len, topk_indices_buffer, candidate_blocks,
                         candidate_block_size, capacities=capacities, logits_budget_bytes=logits_budget_bytes,
                         workspace=workspace)

    def _prefill(self, q, q_scale, weights, ks, ke, mc, out, cand):
        _ops.sparse_indexer_prefill(q, q_scale, self.packed_k, self.packed_k_scale, weights, ks, ke, cand,
                                    self.candidate_block_size, self.topk_tokens, self.workspace, out)

    def _decode(self, q, q_scale, weights, m, Rd, mc, out, cand_all, cand):
        if Rd == 0:
            return
        _ops.sparse_indexer_decode(*self._decode_args(q, q_scale, weights, m, Rd), cand_all[:Rd],
                                   self.candidate_block_size, self.topk_tokens, self.workspace, out)


# ----------------------------------------------------------------------------------------------------
# Warmup inputs
# ----------------------------------------------------------------------------------------------------

def _dummy_q(T, H, D, fmt, dev):
    if fmt == "fp8":
        return torch.zeros(T, H, D, dtype=formats.FP8_DTYPE, device=dev), None
    return (torch.zeros(T, H, D // 2, dtype=torch.uint8, device=dev),
            torch.full((T, H), 0x7F7F7F7F, dtype=torch.int32, device=dev))


def _dummy_metadata(c: IndexerCapacities, dev, with_slots: bool) -> IndexerMetadata:
    """Every row active with length 1 over page 0 (the values do not matter for compilation; the shapes do)."""
    i32 = dict(dtype=torch.int32, device=dev)
    T, Rd, R = c.max_tokens, c.max_decode_rows, c.max_reqs
    cu = torch.ones(R + 1, **i32)
    cu[0] = 0
    return IndexerMetadata(
        capacities=c, block_table=torch.zeros(R, c.max_blocks_per_req, **i32), cu_seq_lens=cu,
        prefill_ks=torch.zeros(T, **i32), prefill_ke=torch.ones(T, **i32),
        decode_context_lens=torch.ones(Rd, **i32), decode_req_indices=torch.zeros(Rd, **i32),
        row_req=torch.zeros(T, **i32), row_len=torch.ones(T, **i32), counts=torch.zeros(6, **i32),
        slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev) if with_slots else None)
