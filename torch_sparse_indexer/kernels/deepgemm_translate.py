"""Pure translation between this library's contracts and DeepGEMM 2.8.2's indexer APIs (no deep_gemm import).

Everything here is plain PyTorch on whatever device the inputs live on (CPU tests exercise it), runs
without host syncs (graph-capturable), and encodes one DeepGEMM rule each (ANCHORS.md section 2):

* :func:`supports_dense` / :func:`supports_sparse`: what DeepGEMM 2.8.2 can run, from static facts only
  (architecture, format, heads, head dim, block size, widths); a reason string otherwise.
* :func:`prefill_bounds`: our clamping of ``ks``/``ke`` turned into the absolute bounds DeepGEMM reads.
* :func:`decode_rows`: decode rows flattened to one block-table row each (DeepGEMM's ``next_n = 1``), with
  sanitized context lengths / page ids and the varlen ``indices`` DeepGEMM SM100 wants.
* :func:`translate_candidates`: our candidate lists (any cbs in {8, 16, 32, 64}, -1 padded) into
  DeepGEMM's sparse block-index contract (``sparse_block_kv`` 8 or 16, valid prefix strictly increasing,
  its length inferred by DeepGEMM from the row's KV length, tail never read).
* layout helpers: the padded row strides DeepGEMM allocates, and :func:`unpack_dense` /
  :func:`unpack_sparse`, the torch statement of how DeepGEMM's output maps back into our layouts
  (the Triton copy kernels in :mod:`.deepgemm` do the same in one pass).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# ----------------------------------------------------------------------------------------------------
# DeepGEMM 2.8.2 facts (csrc/apis/attention.hpp, csrc/jit_kernels/impls/*mqa_logits*.hpp)
# ----------------------------------------------------------------------------------------------------

DG_VERSION = "2.8.2"
SM90_HEADS = (32, 64)
SM90_HEAD_DIMS = (32, 64, 128)
SM90_BLOCK_KV = 64               # paged decode page size on SM90
SM90_SPLIT_KV = 256              # logits row stride granule on SM90 (fp32)
SM100_SPLIT_KV = 384             # prefill / paged split on SM100 (bf16 logits)
SM100_PAGED_BLOCK_KV = (32, 64, 128)
SM100_MAX_HEADS = 128
SM100_MXFP4_HEAD_DIMS = (64, 128)
SPARSE_BLOCK_KVS = (8, 16)
SPARSE_MAX_HEADS = 32
SPARSE_HEAD_DIM = 128
SPARSE_MAX_BLOCKS = 4096         # num_max_sparse_blocks in (0, 4096], % 4 == 0
SPARSE_MAX_Q_TOKENS = 1 << 20    # per-stream sparse-metadata workspace holds this many query tokens
SPARSE_PAGE_STRIDE_ALIGN = 128   # bytes, paged sparse KV
TMA_ALIGN = 16                   # bytes: TMA base / stride alignment


def arch_family(capability) -> Optional[str]:
    """``"sm90"`` (Hopper), ``"sm100"`` (datacenter Blackwell, SM100/SM103) or None for other devices."""
    major = capability[0]
    return "sm90" if major == 9 else "sm100" if major == 10 else None


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ----------------------------------------------------------------------------------------------------
# Support predicates (static facts only)
# ----------------------------------------------------------------------------------------------------

def supports_dense(arch: Optional[str], fmt: str, num_heads: int, head_dim: int, weights_dtype: torch.dtype, *,
                   rows: int, width: int, paged: bool, block_size: Optional[int] = None,
                   page_stride_bytes: Optional[int] = None, num_kv: Optional[int] = None) -> Optional[str]:
    """Can DeepGEMM 2.8.2's dense ``fp8_fp4_mqa_logits`` (prefill) / ``fp8_fp4_paged_mqa_logits`` (decode)
    run this case? None, or the reason it cannot.

    ``width``: our logits width (max_seqlen_k / max_context_len); ``num_kv``: packed K rows (prefill).
    SM100 additionally needs bf16 weights: DeepGEMM 2.8 reduces heads in bf16 there, which only a caller
    that already passes bf16 weights has opted into (fp32 weights would be silently rounded).
    """
    if arch is None:
        return "DeepGEMM 2.8 has indexer kernels for SM90 and SM100 only"
    if rows < 1:
        return "DeepGEMM needs at least one query row"
    if width < 1:
        return "DeepGEMM needs a logits width >= 1"
    if not paged and (num_kv is None or num_kv < 1):
        return "DeepGEMM needs at least one key row"
    if arch == "sm90":
        if fmt != "fp8":
            return "DeepGEMM on SM90 takes FP8 (e4m3 + fp32 per-token K scale) only, not mxfp4"
        if num_heads not in SM90_HEADS:
            return f"DeepGEMM on SM90 takes {SM90_HEADS} heads, got {num_heads}"
        if head_dim not in SM90_HEAD_DIMS:
            return f"DeepGEMM on SM90 takes head dim {SM90_HEAD_DIMS}, got {head_dim}"
        if weights_dtype not in (torch.float32, torch.bfloat16):
            return f"weights must be float32 or bfloat16, got {weights_dtype}"
        if paged and block_size != SM90_BLOCK_KV:
            return f"DeepGEMM paged decode on SM90 needs cache block_size {SM90_BLOCK_KV}, got {block_size}"
    else:
        if fmt != "mxfp4":
            return ("DeepGEMM 2.8 on SM100 takes MXFP8/MXFP4 (per-32 UE8M0 scales) only; this library's fp8 "
                    "format has one fp32 scale per token, which DeepGEMM 2.8 SM100 does not accept")
        if num_heads % 4 != 0 or not 4 <= num_heads <= SM100_MAX_HEADS:
            return f"DeepGEMM on SM100 takes a multiple of 4 heads up to {SM100_MAX_HEADS}, got {num_heads}"
        if head_dim not in SM100_MXFP4_HEAD_DIMS:
            return f"DeepGEMM MXFP4 takes head dim {SM100_MXFP4_HEAD_DIMS}, got {head_dim}"
        if weights_dtype != torch.bfloat16:
            return ("DeepGEMM 2.8 on SM100 reduces heads in bf16 with bf16 weights (error above this library's "
                    "fp32 tolerance); pass bfloat16 weights to opt in")
        if paged and block_size not in SM100_PAGED_BLOCK_KV:
            return f"DeepGEMM paged decode on SM100 needs cache block_size in {SM100_PAGED_BLOCK_KV}, got {block_size}"
    if paged and page_stride_bytes is not None and page_stride_bytes % TMA_ALIGN != 0:
        return f"DeepGEMM reads pages with TMA: page stride must be a multiple of {TMA_ALIGN} bytes, got {page_stride_bytes}"
    return None


def sparse_block_kv(cbs: int) -> int:
    """DeepGEMM's sparse block size for our candidate block size: the largest of {16, 8} dividing ``cbs``."""
    if cbs % 16 == 0:
        return 16
    if cbs % 8 == 0:
        return 8
    raise ValueError(f"cbs: expected a multiple of 8, got {cbs}")


def supports_sparse(arch: Optional[str], fmt: str, num_heads: int, head_dim: int, weights_dtype: torch.dtype, *,
                    rows: int, num_candidate_blocks: int, cbs: int, paged: bool, block_size: Optional[int] = None,
                    page_stride_bytes: Optional[int] = None, num_kv: Optional[int] = None) -> Optional[str]:
    """Can DeepGEMM 2.8.2's ``fp8_fp4_sparse_mqa_logits`` / ``fp8_fp4_paged_sparse_mqa_logits`` (SM100 only)
    run this consumer-level case? None, or the reason."""
    if arch != "sm100":
        return "DeepGEMM's sparse indexer kernels exist on SM100 only"
    if fmt != "mxfp4":
        return ("DeepGEMM 2.8 sparse kernels take MXFP4/MXFP8 only; this library has no MXFP8 format and its fp8 "
                "format (fp32 per-token scale) is not accepted on SM100")
    if head_dim != SPARSE_HEAD_DIM:
        return f"DeepGEMM sparse kernels take head dim {SPARSE_HEAD_DIM} only, got {head_dim}"
    if num_heads % 4 != 0 or not 4 <= num_heads <= SPARSE_MAX_HEADS:
        return f"DeepGEMM sparse kernels take a multiple of 4 heads up to {SPARSE_MAX_HEADS}, got {num_heads}"
    if weights_dtype != torch.bfloat16:
        return ("DeepGEMM sparse kernels reduce heads in bf16 with bf16 weights (error above this library's fp32 "
                "tolerance); pass bfloat16 weights to opt in")
    if not 1 <= rows <= SPARSE_MAX_Q_TOKENS:
        return f"DeepGEMM sparse kernels take 1..{SPARSE_MAX_Q_TOKENS} query rows, got {rows}"
    if not paged and (num_kv is None or num_kv < 1):
        return "DeepGEMM needs at least one key row"
    sbk = sparse_block_kv(cbs)
    num_max = num_candidate_blocks * (cbs // sbk)
    if num_max % 4 != 0 or not 0 < num_max <= SPARSE_MAX_BLOCKS:
        return (f"DeepGEMM needs num_max_sparse_blocks % 4 == 0 and <= {SPARSE_MAX_BLOCKS}; {num_candidate_blocks} "
                f"candidate blocks of {cbs} give {num_max} blocks of {sbk}")
    if paged:
        if block_size is None or block_size % sbk != 0:
            return f"DeepGEMM paged sparse needs the page size to be a multiple of {sbk}, got {block_size}"
        if page_stride_bytes is not None and page_stride_bytes % SPARSE_PAGE_STRIDE_ALIGN != 0:
            return (f"DeepGEMM paged sparse needs a page stride multiple of {SPARSE_PAGE_STRIDE_ALIGN} bytes, got "
                    f"{page_stride_bytes} (allocate pages padded to 128 B)")
    return None


# ----------------------------------------------------------------------------------------------------
# Output layouts DeepGEMM allocates (for checks and documentation; our ops never expose them)
# ----------------------------------------------------------------------------------------------------

def prefill_logits_stride(max_seqlen_k: int, arch: str) -> int:
    """Row stride (elements) of ``fp8_fp4_mqa_logits``'s compressed output: whole splits, 1024-B rows."""
    split, elt = (SM90_SPLIT_KV, 4) if arch == "sm90" else (SM100_SPLIT_KV, 2)
    return _align(_align(max_seqlen_k, split), 1024 // elt)


def paged_logits_stride(max_context_len: int, arch: str) -> int:
    """Row stride (elements) of ``fp8_fp4_paged_mqa_logits``'s output: ``align(L, lcm(split, 1024 / elt))``."""
    import math
    split, elt = (SM90_SPLIT_KV, 4) if arch == "sm90" else (SM100_SPLIT_KV, 2)
    return _align(max_context_len, math.lcm(split, 1024 // elt))


def sparse_logits_stride(num_max_sparse_blocks: int, sbk: int) -> int:
    """Row stride (bf16 elements) of the sparse kernels' output: 1024-B rows."""
    return _align(num_max_sparse_blocks * sbk, 512)


def schedule_metadata_shape(num_sms: int) -> tuple[int, int]:
    """``get_paged_mqa_logits_metadata``'s int32 output: per-SM ``(q_idx, split_idx)`` plus a sentinel."""
    return (num_sms + 1, 2)


def sm90_metadata_bucket(rows: int) -> int:
    """SM90 ``get_paged_mqa_logits_metadata`` is JIT-templated on ``align(rows, 32)``: one compile per bucket."""
    return _align(max(rows, 1), 32)


# ----------------------------------------------------------------------------------------------------
# Bounds and rows
# ----------------------------------------------------------------------------------------------------

class PrefillBounds(NamedTuple):
    ks: torch.Tensor     # int32 [T]: clamp(ks, 0, N)  (absolute, what DeepGEMM reads)
    ke: torch.Tensor     # int32 [T]: ks + n
    n: torch.Tensor      # int32 [T]: usable positions of the row (<= width when width is given)


def prefill_bounds(ks: torch.Tensor, ke: torch.Tensor, num_kv: int, width: Optional[int] = None) -> PrefillBounds:
    """Our documented clamping (``ks' = clamp(ks, 0, N)``, ``ke' = clamp(ke, ks', N)``), additionally capped at
    ``ks' + width`` so DeepGEMM never writes past the columns it allocated for ``max_seqlen_k = width``."""
    ks_c = ks.clamp(0, num_kv)
    ke_c = torch.maximum(ke.clamp(max=num_kv), ks_c)
    if width is not None:
        ke_c = torch.minimum(ke_c, ks_c + width)
    return PrefillBounds(ks_c.to(torch.int32), ke_c.to(torch.int32), (ke_c - ks_c).to(torch.int32))


class DecodeRows(NamedTuple):
    req: torch.Tensor          # int32 [R]: request row of each query row, clamped into the table
    n: torch.Tensor            # int32 [R]: usable positions (0 for a request index out of range)
    block_table: torch.Tensor  # int32 [R, max_blocks] contiguous: one row per query row, page ids clamped
    run_ids: torch.Tensor      # int32 [R]: varlen `indices` for DeepGEMM SM100 (equal only for consecutive rows
                               #   of one request, so rows DeepGEMM pairs always share a block-table row)


def decode_rows(context_lens: torch.Tensor, block_table: torch.Tensor, req_indices: Optional[torch.Tensor],
                block_size: int, num_cache_blocks: int, width: Optional[int] = None) -> DecodeRows:
    """Flatten decode rows for DeepGEMM (``next_n = 1``: one block-table row and one context length each).

    Lengths follow our reference: ``clamp(context_lens, 0, max_blocks * block_size)`` (and ``<= width``), 0 when
    the request index is outside ``[0, num_reqs)``. Page ids are clamped into ``[0, num_cache_blocks)`` so
    DeepGEMM never reads outside the cache; positions on pages that were out of range must be masked to -inf
    afterwards (they are, by :func:`page_valid` / the copy kernels).
    """
    R = context_lens.shape[0]
    num_reqs, max_blocks = block_table.shape
    dev = context_lens.device
    if req_indices is None:
        req = torch.arange(R, device=dev, dtype=torch.int64)
        ok = req < num_reqs
    else:
        req = req_indices.long()
        ok = (req >= 0) & (req < num_reqs)
    cap = max_blocks * block_size if width is None else min(max_blocks * block_size, width)
    n = torch.where(ok, context_lens.long().clamp(0, cap), torch.zeros_like(req))
    req_c = req.clamp(0, max(num_reqs - 1, 0))
    rows = block_table.index_select(0, req_c).clamp_(0, max(num_cache_blocks - 1, 0))
    new_run = torch.ones(R, dtype=torch.int64, device=dev)
    if R > 1:
        new_run[1:] = (req_c[1:] != req_c[:-1]).long()
    run_ids = torch.cumsum(new_run, 0) - 1
    return DecodeRows(req_c.to(torch.int32), n.to(torch.int32), rows.to(torch.int32).contiguous(),
                      run_ids.to(torch.int32))


def context_lens_2d(n: torch.Tensor) -> torch.Tensor:
    """The dense decode kernels' ``context_lens``: ``int32 [B, next_n]`` = our flattened rows ``[R, 1]``, each
    at least 1. DeepGEMM 2.8.2's SM90 schedule kernel reads one shared-memory word past its buffer when the
    whole batch has no work and ``B % 32 == 0`` (its binary search ends at ``q_idx == B``); an H200 run
    faulted with an illegal address on exactly that. One position per empty row (a real, clamped page) costs
    one split and is masked by our lengths afterwards."""
    return n.to(torch.int32).clamp(min=1).contiguous().view(-1, 1)


def page_valid(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, block_size: int,
               num_cache_blocks: int) -> torch.Tensor:
    """bool like ``pos [R, C]``: the page holding request-local position ``pos`` of row r's request is a real
    page (the reference scores positions on other pages as -inf)."""
    mb = block_table.shape[1]
    bi = (pos.long() // block_size).clamp(0, mb - 1)
    page = block_table[req.long()[:, None].expand_as(bi), bi]
    return (page >= 0) & (page < num_cache_blocks)


# ----------------------------------------------------------------------------------------------------
# Candidate lists -> DeepGEMM sparse block indices
# ----------------------------------------------------------------------------------------------------

class SparseTranslation(NamedTuple):
    indices: torch.Tensor         # int32 [R, num_max] contiguous: DeepGEMM `sparse_kv_block_indices`
    num_blocks: torch.Tensor      # int32 [R]: the prefix length DeepGEMM infers, min(num_max, ceil(n / sbk))
    slot_map: torch.Tensor        # int32 [R, nb]: DeepGEMM prefix slot (units of sbk) of our slot's first block, or -1
    dg_candidates: torch.Tensor   # int32 [R, num_max]: request-local sbk-block id of each DeepGEMM slot that holds
                                  #   one of our candidates' blocks, -1 for filler / tail slots
    sbk: int


def translate_candidates(candidate_blocks: torch.Tensor, cbs: int, n: torch.Tensor,
                         block_offset: Optional[torch.Tensor] = None) -> SparseTranslation:
    """Our candidate lists -> DeepGEMM's sparse block-index contract, without host syncs.

    ``candidate_blocks int32 [R, nb]`` (request-local ids of blocks of ``cbs`` positions), ``n [R]`` the rows'
    usable lengths. A candidate is valid when ``0 <= id`` and ``id * cbs < n`` (the reference's rule);
    duplicates count once. Each valid candidate becomes ``m = cbs / sbk`` consecutive sparse blocks (those
    starting before ``n``).

    DeepGEMM infers each row's prefix length from the row's KV range, ``min(num_max, ceil(n / sbk))`` with
    ``num_max = nb * m``, and wants that prefix unique, strictly increasing and inside the range (all blocks
    when they fit). Our blocks are at most that many; when they are fewer (short lists, dropped duplicates or
    out-of-range ids) the prefix is completed with the smallest in-range blocks we did not list ("fillers",
    scored by DeepGEMM and ignored by us). Entries past the prefix repeat its last block (never read).
    ``block_offset [R]`` (prefill: ``ks // sbk``) makes the ids absolute (``use_unaligned_ks`` convention:
    block b starts at key ``b * sbk + ks % sbk``).
    """
    R, nb = candidate_blocks.shape
    sbk = sparse_block_kv(cbs)
    m = cbs // sbk
    num_max = nb * m
    dev = candidate_blocks.device
    big = torch.iinfo(torch.int64).max
    cb = candidate_blocks.long()
    nl = n.long()
    valid = (cb >= 0) & (cb * cbs < nl[:, None])
    sub = cb[:, :, None] * m + torch.arange(m, device=dev)
    sub_ok = valid[:, :, None] & (sub * sbk < nl[:, None, None])
    srt = torch.sort(torch.where(sub_ok, sub, torch.full_like(sub, big)).reshape(R, num_max), dim=1).values
    first = srt != big
    if num_max > 1:
        first[:, 1:] &= srt[:, 1:] != srt[:, :-1]
    ours = torch.sort(torch.where(first, srt, torch.full_like(srt, big)), dim=1).values
    n_ours = first.long().sum(dim=1)
    in_range = (nl + sbk - 1) // sbk
    n_i = torch.clamp(in_range, max=num_max)
    # Fillers: the smallest in-range ids we did not list. They lie among the first 2 * num_max ids.
    pool_n = 2 * num_max
    pool = torch.arange(pool_n, device=dev)[None, :].expand(R, pool_n)
    member = torch.zeros(R, pool_n + 1, dtype=torch.bool, device=dev)
    member.scatter_(1, ours.clamp(max=pool_n), True)
    free = ~member[:, :pool_n] & (pool < in_range[:, None])
    take = free & (torch.cumsum(free.long(), dim=1) <= (n_i - n_ours)[:, None])
    fill = torch.where(take, pool, torch.full_like(pool, big))
    merged = torch.sort(torch.cat([ours, fill], dim=1), dim=1).values[:, :num_max].contiguous()
    col = torch.arange(num_max, device=dev)[None, :]
    last = merged.gather(1, (n_i - 1).clamp(min=0)[:, None])
    last = torch.where(n_i[:, None] > 0, last, torch.zeros_like(last))
    local = torch.where(col < n_i[:, None], merged, last)
    idx = local if block_offset is None else local + block_offset.long()[:, None]
    # Where each of our slots landed (its first sparse block), and which DeepGEMM slots are ours.
    slot = torch.searchsorted(merged, (cb * m).contiguous()).clamp(max=num_max - 1)
    slot_map = torch.where(valid, slot, torch.full_like(slot, -1))
    at = torch.searchsorted(ours.contiguous(), merged).clamp(max=num_max - 1)
    mine = (ours.gather(1, at) == merged) & (col < n_i[:, None])
    dg_cand = torch.where(mine, merged, torch.full_like(merged, -1))
    return SparseTranslation(idx.to(torch.int32).contiguous(), n_i.to(torch.int32), slot_map.to(torch.int32),
                             dg_cand.to(torch.int32).contiguous(), sbk)


def sparse_prefill_bounds(ks: torch.Tensor, ke: torch.Tensor, num_kv: int, candidate_blocks: torch.Tensor,
                          cbs: int):
    """Prefill: (translation, DeepGEMM ks, DeepGEMM ke, our n) with our clamped bounds, which DeepGEMM reads as
    the rows' KV ranges, and absolute (unaligned-ks) block ids."""
    b = prefill_bounds(ks, ke, num_kv)
    sbk = sparse_block_kv(cbs)
    t = translate_candidates(candidate_blocks, cbs, b.n, block_offset=b.ks.long() // sbk)
    return t, b.ks, b.ke, b.n


# ----------------------------------------------------------------------------------------------------
# DeepGEMM output -> our layouts (torch statement; the backend uses one-pass Triton kernels)
# ----------------------------------------------------------------------------------------------------

def unpack_dense(dg_logits: torch.Tensor, n: torch.Tensor, out: torch.Tensor,
                 page_ok: Optional[torch.Tensor] = None) -> None:
    """``out[r, c] = dg_logits[r, c]`` where ``c < n[r]`` (and ``page_ok``), else -inf; DeepGEMM's columns
    past a row's length are uninitialized and never read into ``out``."""
    L = out.shape[1]
    ok = torch.arange(L, device=out.device)[None, :] < n.long()[:, None]
    if page_ok is not None:
        ok = ok & page_ok
    src = dg_logits[:, :L].float()
    out.copy_(torch.where(ok, src, torch.full_like(src, float("-inf"))).to(out.dtype))


def sparse_positions(candidate_blocks: torch.Tensor, cbs: int) -> torch.Tensor:
    """int64 ``[R, nb * cbs]``: the request-local position of each of our sparse columns (ids < 0 give < 0)."""
    R, nb = candidate_blocks.shape
    o = torch.arange(cbs, device=candidate_blocks.device)
    return (candidate_blocks.long()[:, :, None] * cbs + o).reshape(R, nb * cbs)


def unpack_sparse(dg_logits: torch.Tensor, tr: SparseTranslation, candidate_blocks: torch.Tensor, cbs: int,
                  n: torch.Tensor, out: torch.Tensor, page_ok: Optional[torch.Tensor] = None) -> None:
    """Our sparse layout from DeepGEMM's: our column ``s * cbs + o`` <- DeepGEMM column
    ``slot_map[s] * sbk + o`` where our slot is valid and ``position < n`` (and ``page_ok``), else -inf."""
    R, nb = candidate_blocks.shape
    pos = sparse_positions(candidate_blocks, cbs)
    slot = tr.slot_map.long()[:, :, None].expand(R, nb, cbs)
    ok = ((slot >= 0).reshape(R, nb * cbs) & (pos >= 0) & (pos < n.long()[:, None]))
    if page_ok is not None:
        ok = ok & page_ok
    o = torch.arange(cbs, device=out.device)
    src_col = (slot.clamp(min=0) * tr.sbk + o).reshape(R, nb * cbs).clamp(max=dg_logits.shape[1] - 1)
    src = dg_logits.gather(1, src_col).float()
    out.copy_(torch.where(ok, src, torch.full_like(src, float("-inf"))).to(out.dtype))
