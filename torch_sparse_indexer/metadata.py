"""Per-step indexer metadata built on the device from what a serving engine has (SPEC sections 4 and 6).

:class:`IndexerMetadataBuilder` (an ``nn.Module``) owns every buffer as a module buffer, sized once from
:class:`IndexerCapacities`. ``build(...)`` fills them from the engine's step inputs with device ops into
preallocated scratch (``out=`` / in-place): no host read of a device value, no allocation, no
``.item()``. It returns an :class:`IndexerMetadata` whose tensors are those buffers, so a CUDA graph (or a
``torch.compile`` graph) recorded once replays for every batch that fits the capacities. (On CUDA a scan or
reduction kernel may take transient scratch from PyTorch's caching allocator -- the graph's own pool
inside a capture; nothing the builder owns or returns is allocated after construction.)

Rows of a step (vLLM's order): token rows ``[0, num_decode_tokens)`` are decode rows (the first
``num_decode_reqs`` requests, MTP = several rows per request), then the prefill rows. For token ``j`` of
request ``b`` with ``q_b`` new tokens and length ``L_b`` (cached + new), the position is
``p = L_b - q_b + j`` and the row may use positions ``[0, p + 1)``:

* decode row ``t < max_decode_rows``: ``decode_context_lens[t] = p + 1``, ``decode_req_indices[t] = b``;
* prefill row: ``prefill_ks[t] = cu_seq_lens[b]``, ``prefill_ke[t] = cu_seq_lens[b] + p + 1`` into the packed
  K that ``gather_k`` builds from ``block_table`` and ``cu_seq_lens`` (prefill requests only; decode requests
  have length 0 there);
* ``slot_mapping[t] = block_table[b, p // bs] * bs + p % bs`` (when asked; ``-1`` where not written).

Masking (what makes one graph serve every batch within the capacities): a row that is not a served row of
its kind has ``decode_context_lens == 0`` / ``prefill_ks == prefill_ke == 0``, so every op outputs ``-1``
for it. Rows past the step's tokens, padded requests (``q_b = 0``), decode rows on the prefill side and
prefill rows on the decode side are all masked that way.

Out-of-contract and over-capacity inputs:

* host-known sizes (number of requests, block-table width, given ``slot_mapping`` length, an ``int``
  ``num_decode_reqs``) past a capacity raise ``ValueError`` in ``build``;
* device-known sizes are clamped on the device and the affected rows are masked (and counted in
  ``num_dropped_rows``): tokens past ``max_tokens``; decode tokens past ``max_decode_rows``; a prefill request
  whose packed K would end past ``max_packed_k`` (that request and every later one: the packed prefix
  stops at the first that does not fit). A request with ``q_b > L_b`` or ``L_b > block_table width *
  block_size`` is invalid: no rows, no slots, not counted as dropped (engines pad batches with such
  requests). A decreasing ``query_start_loc`` is made monotone (running max, negative
  entries read as 0); a device ``num_decode_reqs`` is clamped to ``[0, num_reqs]``.
* K of a valid request is still written (``slot_mapping``) when its rows are dropped for capacity.
* ``num_dropped_rows`` = tokens of valid requests that got no served row; an engine can watch it
  (asynchronously) to detect capacity overflow.

One graph per capacity: pass the step's inputs padded to fixed shapes (``query_start_loc [max_reqs + 1]``
repeating its last entry, ``seq_lens`` 0 for padding requests, ``block_table [max_reqs, width]``) and
``num_decode_reqs`` as a device tensor; then nothing the graph depends on changes between steps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.utils._pytree as pytree
from torch import nn

from . import formats

__all__ = ["IndexerCapacities", "IndexerMetadata", "IndexerMetadataBuilder", "COUNT_NAMES"]

COUNT_NAMES = ("num_tokens", "num_decode_tokens", "num_prefill_tokens", "num_packed_k", "num_decode_reqs",
               "num_dropped_rows")


@dataclass(frozen=True)
class IndexerCapacities:
    """Static capacities of one step (host ints; every buffer is sized from them).

    ``max_decode_rows``: decode query rows (decode tokens, MTP included) a step can serve.
    ``max_prefill_rows``: prefill query rows; a step has at most ``max_tokens = max_decode_rows +
    max_prefill_rows`` token rows (prefill rows may use decode capacity a step leaves unused).
    ``max_packed_k``: keys gathered for the prefill requests of a step (sum of their lengths).
    ``max_reqs``: requests per step (decode + prefill + padding). ``max_blocks_per_req``: block-table width.
    ``block_size``: the paged cache's block size (for slot mapping and ``max_context``).
    """
    max_decode_rows: int
    max_prefill_rows: int
    max_packed_k: int
    max_reqs: int
    max_blocks_per_req: int
    block_size: int

    def __post_init__(self):
        for name in ("max_decode_rows", "max_prefill_rows", "max_packed_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        for name in ("max_reqs", "max_blocks_per_req"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.block_size not in formats.CACHE_BLOCK_SIZES:
            raise ValueError(f"block_size: expected one of {formats.CACHE_BLOCK_SIZES}, got {self.block_size!r}")
        if self.max_tokens < 1:
            raise ValueError("max_decode_rows, max_prefill_rows: expected at least one row in total, got 0 and 0")
        if self.max_prefill_rows > 0 and self.max_packed_k < 1:
            raise ValueError(f"max_packed_k: expected >= 1 when max_prefill_rows > 0, got {self.max_packed_k}")

    @property
    def max_tokens(self) -> int:
        return self.max_decode_rows + self.max_prefill_rows

    @property
    def max_context(self) -> int:
        """Longest request the block table can hold: ``max_blocks_per_req * block_size``."""
        return self.max_blocks_per_req * self.block_size

    @property
    def has_decode(self) -> bool:
        return self.max_decode_rows > 0

    @property
    def has_prefill(self) -> bool:
        return self.max_prefill_rows > 0


@dataclass
class IndexerMetadata:
    """Device tensors of one step (int32 unless noted), all of capacity size; a pytree node whose static
    part is ``capacities`` (so it can be passed into compiled functions).

    * ``block_table [max_reqs, max_blocks_per_req]``: the step's table (rows past the step's requests and
      columns past its width are stale; no masked row reads them).
    * ``cu_seq_lens [max_reqs + 1]``: packed-K offsets for ``gather_k`` (decode/invalid requests: length 0).
    * ``prefill_ks``, ``prefill_ke [max_tokens]``: per token row, into the packed K (masked: both 0).
    * ``decode_context_lens``, ``decode_req_indices [max_decode_rows]`` (masked: length 0).
    * ``row_req [max_tokens]``: request of each token row (-1: none); ``row_len [max_tokens]``: positions the
      row is served over (0: masked), i.e. its ``-1``-padded top-k row covers ``[0, row_len)``.
    * ``slot_mapping`` int64 ``[max_tokens]`` or ``None``: cache slot of each token row's K (-1: skip).
    * ``counts [6]``: ``COUNT_NAMES`` (also as 1-element views: ``num_tokens``, ...).
    """
    capacities: IndexerCapacities
    block_table: torch.Tensor
    cu_seq_lens: torch.Tensor
    prefill_ks: torch.Tensor
    prefill_ke: torch.Tensor
    decode_context_lens: torch.Tensor
    decode_req_indices: torch.Tensor
    row_req: torch.Tensor
    row_len: torch.Tensor
    counts: torch.Tensor
    slot_mapping: Optional[torch.Tensor] = None

    def count(self, name: str) -> torch.Tensor:
        """1-element int32 view of ``counts`` by name (see ``COUNT_NAMES``)."""
        return self.counts[COUNT_NAMES.index(name):COUNT_NAMES.index(name) + 1]

    @property
    def num_tokens(self):
        return self.count("num_tokens")

    @property
    def num_decode_tokens(self):
        return self.count("num_decode_tokens")

    @property
    def num_prefill_tokens(self):
        return self.count("num_prefill_tokens")

    @property
    def num_packed_k(self):
        return self.count("num_packed_k")

    @property
    def num_dropped_rows(self):
        return self.count("num_dropped_rows")


_TENSOR_FIELDS = [f.name for f in dataclasses.fields(IndexerMetadata) if f.name != "capacities"]


def _flatten(m: IndexerMetadata):
    present = tuple(n for n in _TENSOR_FIELDS if getattr(m, n) is not None)
    return [getattr(m, n) for n in present], (m.capacities, present)


def _flatten_with_keys(m: IndexerMetadata):
    leaves, ctx = _flatten(m)
    return [(pytree.GetAttrKey(n), v) for n, v in zip(ctx[1], leaves)], ctx


def _unflatten(leaves, ctx):
    caps, present = ctx
    return IndexerMetadata(capacities=caps, **dict(zip(present, leaves)))


pytree.register_pytree_node(IndexerMetadata, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys,
                            serialized_type_name="torch_sparse_indexer.metadata.IndexerMetadata")


def _check_int_tensor(name, t, ndim, n=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {list(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries in dim 0, got shape {list(t.shape)}")


class IndexerMetadataBuilder(nn.Module):
    """Fills :class:`IndexerMetadata` on the device, into buffers allocated here once.

    ``with_slot_mapping``: also produce ``slot_mapping`` (computed from the block table, or copied from the
    engine's when ``build`` gets one). ``build`` is safe to call eagerly before a graph replay or inside a
    captured / compiled step; in a captured step pass ``num_decode_reqs`` as a device tensor (a Python int
    is baked into the graph).
    """

    def __init__(self, capacities: IndexerCapacities, device=None, with_slot_mapping: bool = True):
        super().__init__()
        if not isinstance(capacities, IndexerCapacities):
            raise TypeError(f"capacities: expected IndexerCapacities, got {type(capacities).__name__}")
        self.capacities = c = capacities
        self.with_slot_mapping = with_slot_mapping
        R, MB, T, Rd = c.max_reqs, c.max_blocks_per_req, c.max_tokens, c.max_decode_rows
        i32 = dict(dtype=torch.int32, device=device)
        b = dict(dtype=torch.bool, device=device)
        reg = self.register_buffer
        # Outputs (the fields of the metadata).
        reg("block_table", torch.full((R, MB), -1, **i32), persistent=False)
        reg("cu_seq_lens", torch.zeros(R + 1, **i32), persistent=False)
        reg("prefill_ks", torch.zeros(T, **i32), persistent=False)
        reg("prefill_ke", torch.zeros(T, **i32), persistent=False)
        reg("decode_context_lens", torch.zeros(Rd, **i32), persistent=False)
        reg("decode_req_indices", torch.zeros(Rd, **i32), persistent=False)
        reg("row_req", torch.full((T,), -1, **i32), persistent=False)
        reg("row_len", torch.zeros(T, **i32), persistent=False)
        reg("counts", torch.zeros(len(COUNT_NAMES), **i32), persistent=False)
        reg("slot_mapping", torch.full((T,), -1, dtype=torch.int64, device=device) if with_slot_mapping else None,
            persistent=False)
        # Constants and scratch (every intermediate of build() lives here: build allocates nothing).
        reg("_ar_req", torch.arange(R, **i32), persistent=False)
        reg("_ar_tok", torch.arange(T, **i32), persistent=False)
        reg("_qsl_raw", torch.zeros(R + 1, **i32), persistent=False)
        reg("_qsl", torch.zeros(R + 1, **i32), persistent=False)
        reg("_qsl_arg", torch.zeros(R + 1, dtype=torch.int64, device=device), persistent=False)
        reg("_qsl_ends", torch.zeros(R, **i32), persistent=False)
        reg("_nd", torch.zeros(1, **i32), persistent=False)
        reg("_nd_long", torch.zeros(1, dtype=torch.int64, device=device), persistent=False)
        for name in ("_len", "_nq", "_start", "_plen", "_cu_raw"):
            reg(name, torch.zeros(R, **i32), persistent=False)
        for name in ("_dec", "_valid", "_pre", "_rtmp"):
            reg(name, torch.zeros(R, **b), persistent=False)
        for name in ("_treq", "_tj", "_tpos", "_tend", "_ttmp"):
            reg(name, torch.zeros(T, **i32), persistent=False)
        for name in ("_tin", "_tdec", "_tpre", "_tok", "_tbtmp"):
            reg(name, torch.zeros(T, **b), persistent=False)
        if with_slot_mapping:
            reg("_tflat", torch.zeros(T, dtype=torch.int64, device=device), persistent=False)
            reg("_tpage", torch.zeros(T, **i32), persistent=False)
        # Static for cudagraph trees (reduce-overhead): graphs mutate them in place at fixed addresses.
        for t in self.buffers():
            torch._dynamo.mark_static_address(t, guard=False)

    def metadata_tensors(self):
        return [getattr(self, n) for n in _TENSOR_FIELDS if getattr(self, n) is not None]

    def metadata(self) -> IndexerMetadata:
        """The metadata view of this builder's buffers (valid after ``build``)."""
        return IndexerMetadata(capacities=self.capacities, **{n: getattr(self, n) for n in _TENSOR_FIELDS})

    # ------------------------------------------------------------------------------------------------
    def _check(self, query_start_loc, seq_lens, block_table, num_decode_reqs, slot_mapping):
        c = self.capacities
        _check_int_tensor("query_start_loc", query_start_loc, 1)
        n = query_start_loc.shape[0] - 1
        if n < 0:
            raise ValueError("query_start_loc: expected [num_reqs + 1] entries, got an empty tensor")
        if n > c.max_reqs:
            raise ValueError(f"query_start_loc: expected at most max_reqs + 1 = {c.max_reqs + 1} entries, "
                             f"got {n + 1}")
        _check_int_tensor("seq_lens", seq_lens, 1, n)
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError(f"block_table: expected an int32 tensor, got "
                            f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
        if block_table.dim() != 2 or block_table.shape[0] < n:
            raise ValueError(f"block_table: expected shape [>= {n}, <= {c.max_blocks_per_req}], got "
                             f"{list(block_table.shape)}")
        if block_table.shape[1] > c.max_blocks_per_req or block_table.shape[1] < 1:
            raise ValueError(f"block_table: expected 1 to max_blocks_per_req = {c.max_blocks_per_req} columns, "
                             f"got {block_table.shape[1]}")
        if isinstance(num_decode_reqs, bool) or not isinstance(num_decode_reqs, (int, torch.Tensor)):
            raise TypeError(f"num_decode_reqs: expected an int or a 1-element integer tensor, got "
                            f"{type(num_decode_reqs).__name__}")
        if isinstance(num_decode_reqs, int):
            if not 0 <= num_decode_reqs <= n:
                raise ValueError(f"num_decode_reqs: expected 0 <= num_decode_reqs <= num_reqs = {n}, "
                                 f"got {num_decode_reqs}")
            if num_decode_reqs and not c.has_decode:
                raise ValueError(f"num_decode_reqs: expected 0 (capacities have max_decode_rows = 0), "
                                 f"got {num_decode_reqs}")
        else:
            if num_decode_reqs.dtype not in (torch.int32, torch.int64) or num_decode_reqs.numel() != 1:
                raise ValueError(f"num_decode_reqs: expected a 1-element int32/int64 tensor, got dtype "
                                 f"{num_decode_reqs.dtype} shape {list(num_decode_reqs.shape)}")
        if slot_mapping is not None:
            if not self.with_slot_mapping:
                raise ValueError("slot_mapping: this builder was made with with_slot_mapping=False, got a tensor")
            _check_int_tensor("slot_mapping", slot_mapping, 1)
            if slot_mapping.shape[0] > c.max_tokens:
                raise ValueError(f"slot_mapping: expected at most max_tokens = {c.max_tokens} entries, got "
                                 f"{slot_mapping.shape[0]}")
        dev = self.cu_seq_lens.device
        for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table),
                        ("num_decode_reqs", num_decode_reqs), ("slot_mapping", slot_mapping)):
            if isinstance(t, torch.Tensor) and t.device != dev:
                raise ValueError(f"{name}: expected a tensor on {dev} (the builder's device), got {t.device}")
        return n

    def build(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              num_decode_reqs: Union[int, torch.Tensor], slot_mapping: Optional[torch.Tensor] = None
              ) -> IndexerMetadata:
        """Fill the metadata for one step.

        ``query_start_loc`` int32/int64 ``[num_reqs + 1]`` (cumulative new tokens; decode requests first),
        ``seq_lens`` int32/int64 ``[num_reqs]`` (cached + new tokens), ``block_table`` int32
        ``[>= num_reqs, <= max_blocks_per_req]``, ``num_decode_reqs`` int or 1-element device tensor,
        ``slot_mapping`` (optional, int32/int64 ``[<= max_tokens]``): the engine's own slots, copied instead
        of computed. ``num_decode_tokens`` is ``query_start_loc[num_decode_reqs]``, read on the device.
        """
        n = self._check(query_start_loc, seq_lens, block_table, num_decode_reqs, slot_mapping)
        c = self.capacities
        R, T, Rd, bs = c.max_reqs, c.max_tokens, c.max_decode_rows, c.block_size
        mb = block_table.shape[1]

        if block_table is not self.block_table:
            self.block_table[:n, :mb].copy_(block_table[:n])

        # ---- per request ------------------------------------------------------------------------
        raw, qsl = self._qsl_raw, self._qsl
        raw[: n + 1].copy_(query_start_loc)
        raw[: n + 1].clamp_(min=0)
        torch.cummax(raw[: n + 1], 0, out=(qsl[: n + 1], self._qsl_arg[: n + 1]))
        if n < R:  # padding requests: no tokens
            qsl[n + 1:].copy_(qsl[n: n + 1].expand(R - n))
        L, nq, start = self._len, self._nq, self._start
        L[:n].copy_(seq_lens)
        L[n:].zero_()
        torch.sub(qsl[1:], qsl[:-1], out=nq)
        torch.sub(L, nq, out=start)                                  # position of the first new token
        nd = self._nd
        if isinstance(num_decode_reqs, int):
            nd.fill_(num_decode_reqs)
        else:
            nd.copy_(num_decode_reqs.reshape(1))
            nd.clamp_(0, n)
        dec, valid, pre, rtmp = self._dec, self._valid, self._pre, self._rtmp
        torch.lt(self._ar_req, nd, out=dec)
        torch.ge(start, 0, out=valid)                                # q_b <= L_b (and L_b >= 0)
        torch.le(L, mb * bs, out=rtmp)
        valid.logical_and_(rtmp)
        torch.logical_not(dec, out=pre)
        pre.logical_and_(valid)
        plen, cu_raw, cu = self._plen, self._cu_raw, self.cu_seq_lens
        torch.mul(L, pre, out=plen)
        torch.cumsum(plen, 0, dtype=torch.int32, out=cu_raw)
        torch.le(cu_raw, c.max_packed_k, out=rtmp)                   # packed prefix that fits
        pre.logical_and_(rtmp)
        torch.mul(L, pre, out=plen)
        torch.cumsum(plen, 0, dtype=torch.int32, out=cu[1:])         # cu[0] stays 0

        # ---- per token row ----------------------------------------------------------------------
        tok = self._ar_tok
        treq, tj, tpos, tend, ttmp = self._treq, self._tj, self._tpos, self._tend, self._ttmp
        tin, tdec, tpre, tok_ok, tbtmp = self._tin, self._tdec, self._tpre, self._tok, self._tbtmp
        # The sorted sequence is computed into a buffer of its own, never passed as the view qsl[1:]: on the
        # H200 (torch 2.11), Inductor's GPU lowering of searchsorted ignored that view's storage offset and
        # searched qsl itself, so every row landed in the next request (pytorch/pytorch#182343). qsl is
        # non-decreasing, so this max equals qsl[1:]; being a computation, Inductor gives it a buffer of its
        # own (a plain copy_ into the buffer was tried once on the H200 and the compiled step still differed).
        torch.maximum(qsl[1:], qsl[:-1], out=self._qsl_ends)
        torch.searchsorted(self._qsl_ends, tok, right=True, out_int32=True, out=treq)
        torch.lt(tok, qsl[R:], out=tin)                              # token exists in the step
        treq.clamp_(max=R - 1)
        torch.index_select(qsl, 0, treq, out=tj)
        torch.sub(tok, tj, out=tj)                                   # index within its request
        torch.ge(tj, 0, out=tbtmp)
        tin.logical_and_(tbtmp)
        torch.index_select(start, 0, treq, out=tpos)
        tpos.add_(tj)
        torch.add(tpos, 1, out=tend)                                 # causal end of the row
        torch.index_select(valid, 0, treq, out=tok_ok)
        tok_ok.logical_and_(tin)                                     # token of a valid request
        torch.index_select(dec, 0, treq, out=tdec)
        tdec.logical_and_(tok_ok)
        torch.index_select(pre, 0, treq, out=tpre)
        tpre.logical_and_(tin)

        ks, ke = self.prefill_ks, self.prefill_ke
        torch.index_select(cu, 0, treq, out=ks)
        ks.mul_(tpre)
        torch.add(ks, tend, out=ke)
        ke.mul_(tpre)
        if Rd:
            torch.mul(tend[:Rd], tdec[:Rd], out=self.decode_context_lens)
            self.decode_req_indices.copy_(treq[:Rd])
            tbtmp.copy_(tpre)
            tbtmp[:Rd].logical_or_(tdec[:Rd])                       # served rows
        else:
            tbtmp.copy_(tpre)
        torch.mul(tend, tbtmp, out=self.row_len)
        self.row_req.copy_(treq)
        torch.logical_not(tin, out=tdec)                             # tdec is free now
        self.row_req.masked_fill_(tdec, -1)

        if self.with_slot_mapping:
            slots = self.slot_mapping
            if slot_mapping is not None:
                ns = slot_mapping.shape[0]
                slots[:ns].copy_(slot_mapping)
                slots[ns:].fill_(-1)
            else:
                MB = c.max_blocks_per_req
                flat, page = self._tflat, self._tpage
                torch.div(tpos, bs, rounding_mode="floor", out=ttmp)
                ttmp.clamp_(0, MB - 1)
                torch.mul(treq, MB, out=flat)
                flat.add_(ttmp)
                torch.index_select(self.block_table.view(-1), 0, flat, out=page)
                torch.ge(page, 0, out=tin)
                tin.logical_and_(tok_ok)                             # tin is free now
                torch.remainder(tpos, bs, out=ttmp)
                torch.mul(page, bs, out=slots)
                slots.add_(ttmp)
                tin.logical_not_()
                slots.masked_fill_(tin, -1)

        # ---- counts -------------------------------------------------------------------------------
        cnt = self.counts
        total = qsl[R:]
        torch.clamp(total, max=T, out=cnt[0:1])
        torch.index_select(qsl, 0, self._nd_long.copy_(nd), out=cnt[1:2])
        cnt[1:2].clamp_(max=T)
        torch.sub(cnt[0:1], cnt[1:2], out=cnt[2:3])
        cnt[3:4].copy_(cu[R:])
        cnt[4:5].copy_(nd)
        torch.mul(nq, valid, out=cu_raw)                             # cu_raw is free now: valid requests' tokens
        torch.sum(cu_raw, 0, keepdim=True, dtype=torch.int32, out=cnt[5:6])
        torch.sum(tbtmp, 0, keepdim=True, dtype=torch.int32, out=ttmp[:1])
        cnt[5:6].sub_(ttmp[:1])
        return self.metadata()

    def forward(self, *args, **kwargs) -> IndexerMetadata:
        return self.build(*args, **kwargs)
