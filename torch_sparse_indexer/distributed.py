"""Context parallelism (vLLM's decode context parallelism, DCP): every request's K cache is sharded over
the ranks of a ``torch.distributed`` group; each rank scores only the positions it owns and the ranks'
candidates are merged into exactly what one GPU holding the whole cache would output.

**Ownership** (:class:`CPShard`, vLLM's ``cp_kv_cache_interleave_size``): request-local position ``p`` lives
on rank ``(p // I) % W`` at rank-local position ``lp = (p // (I * W)) * I + p % I``. A rank's cache, block
table and lengths are all in rank-local positions; vLLM's shared DCP block table (one page per rank for
each "virtual" block of ``block_size * W`` positions) is such a table when ``block_size % I == 0``. The
local-to-global map is strictly increasing, so "lower position wins" means the same locally and globally.

**Exactness.** Order entries by (score with NaN below -inf, descending; then global position): a strict
total order. Restricted to rank r, the global top-k is a prefix of rank r's own order of length <= k, so
it lies inside rank r's local top-k; the union of the local top-k's holds the global top-k and the merge
picks it with the same order. Candidate blocks: a rank's *partial* block score is the max over the
positions it owns (a block is split over ranks when ``I < cbs``). A block of the global top-m, taken on
the rank holding its max, is beaten there only by blocks whose partial -- hence global -- score beats it,
so it is in that rank's local top-m with its true score; the merge takes each block's max over ranks and
selects the top-m. A row shorter than k (or than m blocks) keeps all its entries, as on one GPU.

**One collective per step.** Each rank writes fixed-size candidates -- top-k scores and positions and,
when publishing, top-m partial block scores and ids -- into one int32 payload of ``R * (2k + 2m) * 4``
bytes; one ``all_gather_into_tensor`` fills a preallocated ``[W, payload]`` buffer (:class:`CPBuffers`)
and the merge ops read views of it (a gloo build without that collective falls back to ``all_gather``
into row views of the same buffer). The step has fixed sizes and no host sync or host read of a device
value, so it is meant to be captured in a CUDA graph with NCCL (the composition's temporaries then come
from the graph's pool); that has not been run yet (no multi-GPU machine so far). Under ``torch.compile``
Dynamo rewrites the ``torch.distributed`` call into its functional collective: the whole step traces
with ``fullgraph=True`` (``tests/test_distributed.py``, gloo, ``aot_eager``).

**Consumers.** A rank's share of candidate block ``b`` is the contiguous local interval
``[local_length(b * cbs), local_length((b + 1) * cbs))``; it is scored by the single-GPU sparse ops over
aligned local blocks (:func:`sparse_plan`): ``M * cbs / W`` columns per row when ``I * W`` divides
``cbs``, up to ``M * cbs`` when ``I >= cbs`` (whole blocks live on one rank, which may own them all).

The merge and local-selection ops are ``torch.ops.sparse_indexer.cp_*`` (any positions; reference semantics
and only backend in :mod:`torch_sparse_indexer.reference`). The step functions below run the single-GPU scoring
ops unchanged on each rank's shard and select with the single-GPU ``topk`` / ``sparse_topk`` / ``block_topk``
ops (CUDA kernels on a GPU) wherever their columns make that exact -- increasing positions, a valid prefix or
ascending local blocks, global blocks aligned with local ones -- and with the ``cp_*`` ops elsewhere
(``SELECT_BY_CP_OPS`` forces the latter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import formats, reference, ops as _ops_module  # noqa: F401  (registers the ops)

_ops = torch.ops.sparse_indexer
_BIG = torch.iinfo(torch.int64).max
# torch >= 2.13 names it all_gather_single (the old name warns); Dynamo maps both to functional collectives.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------------------------------
# Sharding description and position maps
# ----------------------------------------------------------------------------------------------------

def _clip(x, lo, hi):
    if isinstance(x, torch.Tensor):
        return x.clamp(lo, hi)
    return min(max(x, lo), hi)


@dataclass(frozen=True)
class CPShard:
    """Rank ``rank`` of ``world_size``; position p is owned by rank ``(p // interleave) % world_size``.

    The position maps take Python ints or integer tensors (elementwise, on device, no sync)."""
    rank: int
    world_size: int
    interleave: int = 1

    def __post_init__(self):
        for name in ("rank", "world_size", "interleave"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected in [0, {self.world_size}), got {self.rank}")
        if self.interleave < 1:
            raise ValueError(f"interleave: expected >= 1, got {self.interleave}")

    @property
    def period(self) -> int:
        """Positions per ownership cycle, ``interleave * world_size``."""
        return self.interleave * self.world_size

    def owner(self, p):
        return (p // self.interleave) % self.world_size

    def owns(self, p):
        return self.owner(p) == self.rank

    def to_local(self, p):
        """Rank-local position of an owned global position ``p``."""
        return (p // self.period) * self.interleave + p % self.interleave

    def to_global(self, lp):
        """Global position of this rank's local position ``lp``."""
        i = self.interleave
        return (lp // i) * self.period + self.rank * i + lp % i

    def local_length(self, n, rank: Optional[int] = None):
        """How many of the positions ``[0, n)`` rank ``rank`` (default: this one) owns (n >= 0)."""
        r = self.rank if rank is None else rank
        full = n // self.period
        return full * self.interleave + _clip(n - full * self.period - r * self.interleave, 0, self.interleave)

    def local_capacity(self, n: int) -> int:
        """The most local positions any rank holds for a row of ``n`` positions (rank 0 holds the most)."""
        return int(self.local_length(n, 0))


def check_group(shard: CPShard, group=None) -> None:
    """Raise unless ``group`` (default: the world) has ``shard.world_size`` ranks and this process is
    ``shard.rank`` in it. A world size of 1 needs no initialized process group."""
    if not dist.is_available() or not dist.is_initialized():
        if shard.world_size != 1:
            raise ValueError(f"shard: world_size {shard.world_size} needs an initialized torch.distributed "
                             "process group, got none")
        return
    W, r = dist.get_world_size(group), dist.get_rank(group)
    if (W, r) != (shard.world_size, shard.rank):
        raise ValueError(f"shard: expected rank {r} of world size {W} (the process group), got rank "
                         f"{shard.rank} of {shard.world_size}")


def local_lengths(lengths: torch.Tensor, shard: CPShard, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 ``[R]``: positions of ``[0, lengths)`` this rank owns (negative lengths count as 0)."""
    n = shard.local_length(lengths.clamp(min=0).long())
    if out is None:
        return n.to(torch.int32)
    out.copy_(n)
    return out


def local_cu_seq_lens(cu_seq_lens: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """Offsets int32 ``[num_reqs + 1]`` of the requests' owned keys packed back to back on this rank (what
    ``gather_k`` takes to pack this rank's cache), from the global offsets."""
    seq = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    out = torch.zeros_like(cu_seq_lens)
    out[1:] = torch.cumsum(shard.local_length(seq.clamp(min=0)), 0).to(cu_seq_lens.dtype)
    return out


def local_prefill_bounds(ks: torch.Tensor, ke: torch.Tensor, row_requests: torch.Tensor,
                         local_cu: torch.Tensor, shard: CPShard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(ks, ke)`` int32 ``[T]`` for prefill rows whose keys start at their request's first
    position (``ks`` = the request's global offset): the row's owned keys are
    ``[local_cu[req], local_cu[req] + local_length(ke - ks))`` of the rank's packed K."""
    start = local_cu.long()[row_requests.long()]
    n = shard.local_length((ke.long() - ks.long()).clamp(min=0))
    return start.to(torch.int32), (start + n).to(torch.int32)


def cp_slot_mapping(positions: torch.Tensor, req_indices: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, shard: CPShard, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 ``[T]`` slots of this rank's cache for tokens at request-local ``positions`` of requests
    ``req_indices`` (``block_table``: this rank's, in local positions); -1 (``write_k_cache`` skips it)
    for tokens another rank owns, negative positions, and positions past the table or on a page < 0."""
    p = positions.long()
    req = req_indices.long()
    num_reqs, mb = block_table.shape
    lp = shard.to_local(p.clamp(min=0))
    blk = lp // block_size
    page = block_table[req.clamp(0, num_reqs - 1), blk.clamp(0, mb - 1)].long()
    ok = (p >= 0) & shard.owns(p.clamp(min=0)) & (blk < mb) & (page >= 0) & (req >= 0) & (req < num_reqs)
    slot = torch.where(ok, page * block_size + lp % block_size, torch.full_like(p, -1))
    if out is None:
        return slot
    out.copy_(slot)
    return out


# ----------------------------------------------------------------------------------------------------
# How a rank scores its shard of candidate blocks
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SparsePlan:
    """A rank's share of a candidate block ``b`` is a contiguous interval of its local positions,
    ``[local_length(b * cbs), local_length((b + 1) * cbs))``. It is scored through the single-GPU sparse
    ops as up to ``per_candidate`` aligned local blocks of ``block`` positions; when ``exact`` the
    intervals are unions of such blocks, otherwise the covering blocks' extra positions are masked out."""
    block: int
    per_candidate: int
    exact: bool


def sparse_plan(shard: CPShard, cbs: int) -> SparsePlan:
    """The plan for candidate block size ``cbs`` (the same for every rank of the group)."""
    if cbs not in formats.CANDIDATE_BLOCK_SIZES:
        raise ValueError(f"cbs: expected one of {formats.CANDIDATE_BLOCK_SIZES}, got {cbs}")
    P = shard.period
    span = math.lcm(cbs, P)  # the interval pattern repeats every ``span`` positions ...
    shift = span // P * shard.interleave  # ... shifted by this many local positions
    ivals = [(shard.local_length(b * cbs, r), shard.local_length((b + 1) * cbs, r))
             for r in range(shard.world_size) for b in range(span // cbs)]
    for g in sorted(formats.CANDIDATE_BLOCK_SIZES, reverse=True):
        if g <= cbs and shift % g == 0 and all(a % g == 0 and c % g == 0 for a, c in ivals):
            return SparsePlan(g, max(1, max((c - a) // g for a, c in ivals)), True)
    g = min(formats.CANDIDATE_BLOCK_SIZES)
    # Later repetitions may start at any phase modulo g: bound the covering blocks over every phase.
    return SparsePlan(g, max((c - a + 2 * g - 2) // g for a, c in ivals if c > a), False)


def _local_candidates(candidate_blocks, cbs, n_local, shard, plan, out):
    """This rank's local sparse blocks (size ``plan.block``) covering its share of each candidate block:
    int32 ``[R, M * per_candidate]`` ascending, unique, then -1 (the candidate-list contract). Ids < 0 and
    blocks whose share starts at or past the row's local length (they could only score -inf) are dropped,
    which also keeps far out-of-range ids from overflowing int32."""
    R, M = candidate_blocks.shape
    g, per = plan.block, plan.per_candidate
    c = candidate_blocks.long()
    c0 = c.clamp(min=0)
    a = shard.local_length(c0 * cbs)
    e = shard.local_length((c0 + 1) * cbs)
    valid = (c >= 0) & (a < n_local.long()[:, None])
    first = a // g
    cnt = torch.where(e > a, (e + g - 1) // g - first, torch.zeros_like(a))
    j = torch.arange(per, device=c.device)
    lb = first[:, :, None] + j
    ok = valid[:, :, None] & (j < cnt[:, :, None])
    lb = torch.where(ok, lb, torch.full_like(lb, _BIG)).view(R, M * per)
    lb = torch.sort(lb, dim=1).values
    if not plan.exact and lb.shape[1] > 1:  # neighbouring candidates may share a covering block
        dup = torch.zeros_like(lb, dtype=torch.bool)
        dup[:, 1:] = lb[:, 1:] == lb[:, :-1]
        lb = torch.sort(torch.where(dup, torch.full_like(lb, _BIG), lb), dim=1).values
    out.copy_(torch.where(lb == _BIG, torch.full_like(lb, -1), lb))


def _sparse_positions(local_cands, candidate_blocks, cbs, n_local, shard, plan, out):
    """Global position of each local sparse column (-1: not selectable: no block, past the row, or --
    inexact plans -- outside every candidate block)."""
    R, C = out.shape
    g = plan.block
    col = torch.arange(C, device=out.device)
    lb = local_cands.long()[:, col // g]
    lp = lb * g + col % g
    valid = (lb >= 0) & (lp < n_local.long()[:, None])
    gp = shard.to_global(lp.clamp(min=0))
    if not plan.exact:
        cand = candidate_blocks.long()
        cs = torch.sort(torch.where(cand >= 0, cand, torch.full_like(cand, _BIG)), dim=1).values
        gb = gp // cbs
        at = torch.searchsorted(cs, gb).clamp(max=cs.shape[1] - 1)
        valid = valid & (cs.gather(1, at) == gb)
    out.copy_(torch.where(valid, gp, torch.full_like(gp, -1)))


def _dense_positions(n_local, gpos, out):
    """Column c of a rank's dense local logits is global position ``gpos[c]`` when ``c < n_local``."""
    C = out.shape[1]
    col = torch.arange(C, device=out.device)
    torch.where(col[None, :] < n_local[:, None], gpos[None, :], torch.full_like(gpos, -1)[None, :], out=out)


# ----------------------------------------------------------------------------------------------------
# Buffers, the collective, the merge
# ----------------------------------------------------------------------------------------------------

@dataclass
class CPBuffers:
    """Everything one CP step writes, allocated once from static capacities (stable addresses for CUDA
    graphs). Build with :func:`dense_buffers` or :func:`sparse_buffers`.

    ``logits float32 [max_rows, width]`` / ``positions int32 [max_rows, width]``: the rank's local scores and
    their global positions; ``send int32 [max_rows * (2 topk + 2 num_blocks)]`` and ``recv int32 [W, ...]``:
    the payload and the gathered payloads; ``scores float32 [max_rows * (topk + num_blocks)]``: the local
    candidates' scores before they are copied (as bits) into the payload; ``local_cands``: the consumer's
    local sparse blocks."""
    shard: CPShard
    max_rows: int
    topk: int
    num_blocks: int
    width: int
    cbs: int
    max_context: Optional[int]
    plan: Optional[SparsePlan]
    logits: torch.Tensor
    positions: torch.Tensor
    lens: torch.Tensor
    gpos: Optional[torch.Tensor]
    local_cands: Optional[torch.Tensor]
    scores: torch.Tensor
    send: torch.Tensor
    recv: torch.Tensor


def _alloc(shard, max_rows, topk, num_blocks, width, cbs, max_context, plan, cand_cols, device, group, check):
    _ops_module._static_int("max_rows", max_rows, lo=1)
    _ops_module._static_int("topk", topk, lo=1, hi=formats.MAX_TOPK)
    _ops_module._static_int("num_candidate_blocks", num_blocks, lo=0)
    if check:
        check_group(shard, group)
    i32 = dict(dtype=torch.int32, device=device)
    per_row = 2 * topk + 2 * num_blocks
    gpos = None
    if plan is None:
        gpos = shard.to_global(torch.arange(width, device=device, dtype=torch.int64)).to(torch.int32)
    cands = None if plan is None else torch.full((max_rows, cand_cols), -1, **i32)
    return CPBuffers(
        shard, max_rows, topk, num_blocks, width, cbs, max_context, plan,
        logits=torch.zeros(max_rows, width, dtype=torch.float32, device=device),
        positions=torch.full((max_rows, width), -1, **i32),
        lens=torch.zeros(max_rows, **i32), gpos=gpos, local_cands=cands,
        scores=torch.zeros(max_rows * (topk + num_blocks), dtype=torch.float32, device=device),
        send=torch.zeros(max_rows * per_row, **i32),
        recv=torch.zeros(shard.world_size * max_rows * per_row, **i32))


def dense_buffers(shard: CPShard, max_rows: int, max_context: int, topk: int, num_candidate_blocks: int = 0,
                  cbs: int = 16, device="cpu", group=None, check: bool = True) -> CPBuffers:
    """Buffers for :func:`cp_indexer_prefill` / :func:`cp_indexer_decode` (the candidate source when
    ``num_candidate_blocks`` > 0). ``max_context``: the global row capacity; the rank's logits hold
    ``shard.local_capacity(max_context)`` columns. ``check``: verify ``shard`` against ``group``."""
    _ops_module._static_int("max_context", max_context, lo=1)
    _ops_module._static_int("cbs", cbs, formats.CANDIDATE_BLOCK_SIZES)
    return _alloc(shard, max_rows, topk, num_candidate_blocks, shard.local_capacity(max_context), cbs,
                  max_context, None, 0, device, group, check)


def sparse_buffers(shard: CPShard, max_rows: int, num_candidate_blocks: int, cbs: int, topk: int, device="cpu",
                   group=None, check: bool = True) -> CPBuffers:
    """Buffers for :func:`cp_sparse_indexer_prefill` / :func:`cp_sparse_indexer_decode` (consumers of
    ``num_candidate_blocks`` blocks of ``cbs``); the rank scores ``width = M * per_candidate * block``
    columns (``sparse_plan``), e.g. ``M * cbs / W`` when ``interleave * W`` divides ``cbs``."""
    _ops_module._static_int("num_candidate_blocks", num_candidate_blocks, lo=1)
    plan = sparse_plan(shard, cbs)
    width = num_candidate_blocks * plan.per_candidate * plan.block
    return _alloc(shard, max_rows, topk, 0, width, cbs, None, plan, num_candidate_blocks * plan.per_candidate,
                  device, group, check)


# Backends found without all_gather_into_tensor (older gloo): they gather into views of the same buffer.
_LIST_GATHER_BACKENDS: set = set()


def all_gather_into(recv: torch.Tensor, send: torch.Tensor, group=None) -> None:
    """The step's one collective: every rank's ``send [X]`` into ``recv [W, X]`` (contiguous; row = rank)."""
    if recv.shape[0] == 1 and (torch.compiler.is_compiling() or not dist.is_initialized()):
        recv[0].copy_(send)
        return
    flat = recv.view(-1)  # the concatenated form: gloo does not take the stacked [W, X] one
    if torch.compiler.is_compiling():
        _ALL_GATHER(flat, send, group=group)
        return
    backend = str(dist.get_backend(group))
    if backend not in _LIST_GATHER_BACKENDS:
        try:
            _ALL_GATHER(flat, send, group=group)
            return
        except RuntimeError:
            if backend != "gloo":
                raise
            _LIST_GATHER_BACKENDS.add(backend)  # rejected before any communication: same on every rank
    dist.all_gather(list(recv.unbind(0)), send, group=group)


def _payload(buf: CPBuffers, R: int, m: int):
    """Views for ``R`` rows publishing ``m`` blocks. Payload of a rank (int32, each section ``[R, w]``
    row-major): top-k score bits, top-k positions, block score bits, block ids. Returns (send, recv
    ``[W, X]``, local score scratch ``[R, k + m]`` (float32), local id sections, gathered sections)."""
    k, W = buf.topk, buf.shard.world_size
    X = R * (2 * k + 2 * m)
    send = buf.send[:X]
    recv = buf.recv[: W * X].view(W, X)
    scores = buf.scores[: R * (k + m)]
    widths = (k, k, m, m)
    floats = (True, False, True, False)
    ids, gathered, off = [], [], 0
    for w, f in zip(widths, floats):
        g = recv[:, off: off + R * w]
        if f:
            g = g.view(torch.float32)
        else:
            ids.append(send[off: off + R * w].view(R, w))
        gathered.append(g.view(W, R, w))
        off += R * w
    return send, recv, scores, ids, gathered


# Local selection and merge. The cp_* ops take any positions, and their only backend is the reference, which
# sorts whole rows (a 128 x 128K decode step took 23.5 ms on one H200 rank against 0.77 ms for indexer_decode,
# NOTES.md). A step knows more about its columns: the valid ones are a prefix (dense) or the valid columns of
# ascending local blocks (sparse, exact plans), and their global positions increase with the column
# (to_global is strictly increasing). "Lower position wins" is then the single-GPU selection ops' own "lower
# column wins", so topk / sparse_topk / block_topk -- the CUDA kernels on a GPU -- pick exactly the entries the
# cp ops would; the merges sort the W * k gathered entries by position (or block id) and select with topk the
# same way. Shapes outside that (inexact sparse plans, global blocks that are not aligned local blocks, more
# than MAX_TOPK blocks) keep the cp ops. SELECT_BY_CP_OPS = True uses the cp ops everywhere (comparisons).
SELECT_BY_CP_OPS = False
_NEG_INF = float("-inf")


def _local_block_map(shard: CPShard, cbs: int):
    """(local block size, local block ids -> global block ids) when each global block of ``cbs`` positions
    is one aligned local block of every rank (maybe empty), else None."""
    I, W = shard.interleave, shard.world_size
    if cbs % (I * W) == 0 and cbs // W in formats.CANDIDATE_BLOCK_SIZES:
        return cbs // W, lambda j: j  # local block j holds this rank's share of global block j
    if I % cbs == 0:
        return cbs, lambda j: shard.to_global(j * cbs) // cbs  # whole blocks inside one ownership run
    return None


def _entries(logits, cols, pos, scores, out_pos):
    """``scores / out_pos [R, k]`` of the selected columns ``cols`` (int64, < 0: none) at positions ``pos``."""
    ok = cols >= 0
    vals = logits.gather(1, cols.clamp(min=0))
    scores.copy_(torch.where(ok, vals, torch.full_like(vals, _NEG_INF)))
    out_pos.copy_(torch.where(ok, pos, torch.full_like(pos, -1)))


def _local_topk_dense(logits, n, gpos, k, scores, out_pos):
    """cp_local_topk for dense local logits: columns ``[0, n)`` valid, column c at global position
    ``gpos[c]`` (increasing)."""
    cols = torch.empty_like(out_pos)
    _ops.topk(logits, n, k, cols)
    c = cols.long()
    _entries(logits, c, gpos.long()[c.clamp(min=0)], scores, out_pos)


def _local_topk_sparse(logits, local_cands, g, n, shard, k, scores, out_pos):
    """cp_local_topk for sparse local logits of an exact plan: blocks ``local_cands`` (ascending, then -1) of
    ``g`` columns, positions past ``n`` not selectable."""
    lpos = torch.empty_like(out_pos)
    _ops.sparse_topk(logits, local_cands, g, n, k, lpos)
    lp = lpos.long()
    ok = lp >= 0
    lp0 = lp.clamp(min=0)
    # The column of a selected local position: its block's index in the ascending id list, by search.
    ids = torch.where(local_cands >= 0, local_cands.long(), torch.full_like(local_cands, _BIG, dtype=torch.long))
    col = torch.searchsorted(ids, lp0 // g) * g + lp0 % g
    col = torch.where(ok, col.clamp(max=logits.shape[1] - 1), torch.full_like(col, -1))
    _entries(logits, col, shard.to_global(lp0), scores, out_pos)


def _local_block_topk(logits, n, lbs, to_global_block, scores, blocks):
    """cp_local_block_topk when global blocks are aligned local blocks of ``lbs`` columns (``_local_block_map``):
    block_topk on the local logits, then each chosen block's best valid score."""
    R, m = blocks.shape
    lb = torch.empty_like(blocks)
    _ops.block_topk(logits, n, lbs, lb)
    j = lb.long()
    ok = j >= 0
    col = j.clamp(min=0)[:, :, None] * lbs + torch.arange(lbs, device=j.device)
    inside = col < n.long()[:, None, None]
    v = logits.gather(1, col.clamp(max=logits.shape[1] - 1).view(R, m * lbs)).view(R, m, lbs)
    # the first column of the block's best key (NaN below -inf), as cp_local_block_topk takes it
    key = torch.where(inside, reference.rank_key(v), torch.full_like(v, _NEG_INF, dtype=torch.float64))
    best = v.gather(2, key.argmax(dim=2, keepdim=True)).squeeze(2)
    scores.copy_(torch.where(ok, best, torch.full_like(best, _NEG_INF)))
    gid = to_global_block(j.clamp(min=0))
    blocks.copy_(torch.where(ok, gid, torch.full_like(gid, -1)))


def _flat(x):
    """``[W, R, C]`` -> ``[R, W * C]`` (as the reference's merges see it)."""
    W, R, C = x.shape
    return x.permute(1, 0, 2).reshape(R, W * C)


def _merge_topk(scores, positions, k, indices):
    """cp_topk_merge of local top-k's (each rank's positions ascending, then -1; distinct across ranks)."""
    W = scores.shape[0]
    s, p = _flat(scores), _flat(positions).long()
    if W > 1:  # every entry in position order (a rank's section already is)
        order = torch.argsort(torch.where(p >= 0, p, torch.full_like(p, _BIG)), dim=1)
        s, p = s.gather(1, order), p.gather(1, order)
    cols = torch.empty_like(indices)
    _ops.topk(s.contiguous(), (p >= 0).sum(1, dtype=torch.int32), k, cols)
    c = cols.long()
    indices.copy_(torch.where(c >= 0, p.gather(1, c.clamp(min=0)), torch.full_like(c, -1)))


def _merge_blocks(scores, blocks, candidate_blocks):
    """cp_block_merge of local block top-m's (each rank's ids ascending, then -1)."""
    W = scores.shape[0]
    s, b = _flat(scores), _flat(blocks).long()
    b = torch.where(b >= 0, b, torch.full_like(b, _BIG))
    if W > 1:
        # A block from several ranks counts once, with its best score: entries by id, the best first (two
        # stable sorts), then the first of each id in id order.
        by_key = torch.argsort(reference.rank_key(s), dim=1, descending=True, stable=True)
        ids = b.gather(1, by_key)
        by_id = torch.argsort(ids, dim=1, stable=True)
        order, ids = by_key.gather(1, by_id), ids.gather(1, by_id)
        first = ids != _BIG
        first[:, 1:] &= ids[:, 1:] != ids[:, :-1]
        keep = torch.argsort(torch.where(first, ids, torch.full_like(ids, _BIG)), dim=1, stable=True)
        s, b = s.gather(1, order.gather(1, keep)), torch.where(first, ids, torch.full_like(ids, _BIG)).gather(1, keep)
    cols = torch.empty_like(candidate_blocks)
    _ops.topk(s.contiguous(), (b != _BIG).sum(1, dtype=torch.int32), candidate_blocks.shape[1], cols)
    c = cols.long()
    candidate_blocks.copy_(torch.where(c >= 0, b.gather(1, c.clamp(min=0)), torch.full_like(c, -1)))


def _select_and_merge(buf, logits, n, positions_fn, topk, cbs, topk_indices, candidate_blocks, group,
                      local_cands=None):
    """Local top-k (and top-m partial blocks when publishing ``candidate_blocks``), the one collective, the
    merges. ``positions_fn()`` fills and returns the columns' global positions (-1: not selectable) for the
    cp ops; the composed selection does not need them."""
    R = logits.shape[0]
    m = 0 if candidate_blocks is None else candidate_blocks.shape[1]
    k = topk
    shard, plan = buf.shard, buf.plan
    send, recv, scores, (tp, bi), (gts, gtp, gbs, gbi) = _payload(buf, R, m)
    ls, bs_ = scores[: R * k].view(R, k), scores[R * k:].view(R, m)
    compose = not SELECT_BY_CP_OPS
    pos = None
    # The ops write float scores into a float32 buffer, copied as bits into the int32 payload: under
    # torch.compile a custom op's write through a dtype-reinterpreting view of an input is lost.
    if compose and plan is None:
        _local_topk_dense(logits, n, buf.gpos, k, ls, tp)
    elif compose and plan.exact:
        _local_topk_sparse(logits, local_cands, plan.block, n, shard, k, ls, tp)
    else:
        pos = positions_fn()
        _ops.cp_local_topk(logits, pos, topk, ls, tp)
    send[: R * k].copy_(scores[: R * k].view(torch.int32))
    bmap = _local_block_map(shard, cbs) if m and compose and m <= formats.MAX_TOPK else None
    if m:
        if bmap is not None:
            _local_block_topk(logits, n, bmap[0], bmap[1], bs_, bi)
        else:
            _ops.cp_local_block_topk(logits, positions_fn() if pos is None else pos, cbs, bs_, bi)
        send[2 * R * k: 2 * R * k + R * m].copy_(scores[R * k:].view(torch.int32))
    all_gather_into(recv, send, group)
    if compose:
        _merge_topk(gts, gtp, topk, topk_indices)
    else:
        _ops.cp_topk_merge(gts, gtp, topk, topk_indices)
    if m:
        if compose and m <= formats.MAX_TOPK:
            _merge_blocks(gbs, gbi, candidate_blocks)
        else:
            _ops.cp_block_merge(gbs, gbi, candidate_blocks)


def _check_step(buf, R, topk, candidate_blocks, cbs, dense, max_context=None):
    if not isinstance(buf, CPBuffers):
        raise TypeError(f"buffers: expected CPBuffers, got {type(buf).__name__}")
    if (buf.plan is None) != dense:
        raise ValueError(f"buffers: expected {'dense_buffers' if dense else 'sparse_buffers'}, got the other kind")
    if R > buf.max_rows:
        raise ValueError(f"q: expected at most {buf.max_rows} rows (buffers.max_rows), got {R}")
    if topk != buf.topk:
        raise ValueError(f"topk: expected {buf.topk} (buffers.topk), got {topk}")
    if cbs != buf.cbs:
        raise ValueError(f"cbs: expected {buf.cbs} (buffers.cbs), got {cbs}")
    if dense:
        if max_context != buf.max_context:
            raise ValueError(f"max_context: expected {buf.max_context} (buffers.max_context), got {max_context}")
        if candidate_blocks is not None and candidate_blocks.shape[1] > buf.num_blocks:
            raise ValueError(f"candidate_blocks: expected at most {buf.num_blocks} columns "
                             f"(buffers.num_blocks), got {candidate_blocks.shape[1]}")
    elif candidate_blocks.shape[1] * buf.plan.per_candidate != buf.local_cands.shape[1]:
        raise ValueError(f"candidate_blocks: expected {buf.local_cands.shape[1] // buf.plan.per_candidate} "
                         f"columns (sparse_buffers' num_candidate_blocks), got {candidate_blocks.shape[1]}")


# ----------------------------------------------------------------------------------------------------
# Row lengths on this rank (the single-GPU end-to-end ops' clamping, on owned positions)
# ----------------------------------------------------------------------------------------------------

def _prefill_local_n(ks, ke, n_keys, cap, out):
    ksc = ks.long().clamp(0, n_keys)
    n = torch.maximum(ke.long().clamp(max=n_keys), ksc) - ksc
    out.copy_(n.clamp(max=cap))


def _decode_local_n(context_lens, req_indices, block_table, bs, max_context, shard, out):
    num_reqs, mb = block_table.shape
    n = context_lens.long().clamp(min=0)
    if max_context is not None:
        n = n.clamp(max=max_context)
    n = shard.local_length(n).clamp(max=mb * bs)
    if req_indices is not None:
        ri = req_indices.long()
        n = torch.where((ri >= 0) & (ri < num_reqs), n, torch.zeros_like(n))
    out.copy_(n)


# ----------------------------------------------------------------------------------------------------
# The indexer under context parallelism (every rank calls these with its own shard)
# ----------------------------------------------------------------------------------------------------

def cp_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, max_context: int, topk: int, cbs: int,
                       buffers: CPBuffers, topk_indices: torch.Tensor,
                       candidate_blocks: Optional[torch.Tensor] = None, group=None) -> None:
    """Dense level, prefill, on this rank's shard. ``k/k_scale``: the rank's packed keys (``gather_k``
    with :func:`local_cu_seq_lens`); ``ks/ke`` int32 ``[T]``: each row's keys in them
    (:func:`local_prefill_bounds`). Writes the global ``topk_indices [T, topk]`` and, if given, the merged
    ``candidate_blocks [T, m]`` -- identical on every rank and to ``indexer_prefill`` on one GPU."""
    T = q.shape[0]
    _check_step(buffers, T, topk, candidate_blocks, cbs, True, max_context)
    n = buffers.lens[:T]
    cap = buffers.shard.local_length(max_context)
    _prefill_local_n(ks, ke, k.shape[0], cap, n)
    logits = buffers.logits[:T]
    _ops.mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, logits)

    def positions():
        pos = buffers.positions[:T]
        _dense_positions(n, buffers.gpos, pos)
        return pos
    _select_and_merge(buffers, logits, n, positions, topk, cbs, topk_indices, candidate_blocks, group)


def cp_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices, max_context: int,
                      topk: int, cbs: int, buffers: CPBuffers, topk_indices: torch.Tensor,
                      candidate_blocks: Optional[torch.Tensor] = None, group=None) -> None:
    """Dense level, decode, on this rank's shard: ``kv_cache`` / ``block_table`` are the rank's (local
    positions), ``context_lens`` the rows' global lengths. Outputs as :func:`cp_indexer_prefill`."""
    R = q.shape[0]
    _check_step(buffers, R, topk, candidate_blocks, cbs, True, max_context)
    n = buffers.lens[:R]
    bs = formats.as_3d_cache(kv_cache).shape[1]
    _decode_local_n(context_lens, req_indices, block_table, bs, max_context, buffers.shard, n)
    logits = buffers.logits[:R]
    _ops.paged_mqa_logits(q, q_scale, kv_cache, weights, n, block_table, req_indices, logits)

    def positions():
        pos = buffers.positions[:R]
        _dense_positions(n, buffers.gpos, pos)
        return pos
    _select_and_merge(buffers, logits, n, positions, topk, cbs, topk_indices, candidate_blocks, group)


def cp_sparse_indexer_prefill(q, q_scale, k, k_scale, weights, ks, ke, candidate_blocks, cbs: int, topk: int,
                              buffers: CPBuffers, topk_indices: torch.Tensor, group=None) -> None:
    """Consumer level, prefill: ``candidate_blocks [T, M]`` (global ids, the merged list every rank holds);
    each rank scores its share of each block, the local top-k's are merged into ``topk_indices`` --
    identical to ``sparse_indexer_prefill`` on one GPU."""
    T = q.shape[0]
    _check_step(buffers, T, topk, candidate_blocks, cbs, False)
    shard, plan = buffers.shard, buffers.plan
    n = buffers.lens[:T]
    _prefill_local_n(ks, ke, k.shape[0], 2 ** 31 - 1, n)
    lc = buffers.local_cands[:T]
    _local_candidates(candidate_blocks, cbs, n, shard, plan, lc)
    logits = buffers.logits[:T]
    _ops.sparse_mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, lc, plan.block, logits)

    def positions():
        pos = buffers.positions[:T]
        _sparse_positions(lc, candidate_blocks, cbs, n, shard, plan, pos)
        return pos
    _select_and_merge(buffers, logits, n, positions, topk, cbs, topk_indices, None, group, local_cands=lc)


def cp_sparse_indexer_decode(q, q_scale, kv_cache, weights, context_lens, block_table, req_indices,
                             candidate_blocks, cbs: int, topk: int, buffers: CPBuffers,
                             topk_indices: torch.Tensor, group=None) -> None:
    """Consumer level, decode, on this rank's shard (cache and table local, ``context_lens`` global);
    identical to ``sparse_indexer_decode`` on one GPU."""
    R = q.shape[0]
    _check_step(buffers, R, topk, candidate_blocks, cbs, False)
    shard, plan = buffers.shard, buffers.plan
    n = buffers.lens[:R]
    bs = formats.as_3d_cache(kv_cache).shape[1]
    _decode_local_n(context_lens, req_indices, block_table, bs, None, shard, n)
    lc = buffers.local_cands[:R]
    _local_candidates(candidate_blocks, cbs, n, shard, plan, lc)
    logits = buffers.logits[:R]
    _ops.paged_sparse_mqa_logits(q, q_scale, kv_cache, weights, n, block_table, req_indices, lc, plan.block,
                                 logits)

    def positions():
        pos = buffers.positions[:R]
        _sparse_positions(lc, candidate_blocks, cbs, n, shard, plan, pos)
        return pos
    _select_and_merge(buffers, logits, n, positions, topk, cbs, topk_indices, None, group, local_cands=lc)
