"""Random test inputs for the oracle, compile and opcheck tests (tiny shapes, ragged on purpose).

Two kinds of data:

* ``exact=False``: Gaussian values (generic rounding; scores are compared with an error bound);
* ``exact=True``: small integers / e2m1 grid values with fixed power-of-two scales, chosen so every
  float32 product and partial sum of the score is exact. Reference float32 and oracle float64 scores are
  then bit-equal whatever the summation order, so selections can be compared exactly, and ties (keys
  duplicated on purpose) are real ties.

Quantized values come from :mod:`torch_sparse_indexer.formats` (pinned byte-exact in test_formats.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from torch_sparse_indexer import formats, testing

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _randint(lo, hi, shape, gen):
    return torch.randint(lo, hi + 1, shape, generator=gen).float()


def raw_rows(shape, fmt, gen, exact):
    """Float rows ``[..., D]`` to quantize. Exact fp8 rows: integers in [-2, 2] with |max| = 2 (scale 2^-7
    for every row); exact mxfp4 rows: e2m1 grid values with a +-6 in every 32-group (scale 1)."""
    if not exact:
        return torch.randn(shape, generator=gen)
    if fmt == "fp8":
        x = _randint(-2, 2, shape, gen)
        x[..., 0] = torch.randint(0, 2, shape[:-1], generator=gen).float().mul(4).sub(2)
        return x
    idx = torch.randint(0, 8, shape, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen).float().mul(2).sub(1)
    x = E2M1_GRID[idx] * sign
    x[..., ::32] = 6.0 * sign[..., ::32]
    return x


def weights(T, H, gen, exact, dtype=torch.float32):
    if exact:
        return _randint(-2, 2, (T, H), gen).to(dtype)
    return (torch.randn(T, H, generator=gen) * H ** -0.5).to(dtype)


@dataclass
class Q:
    q: torch.Tensor
    q_scale: Optional[torch.Tensor]
    weights: torch.Tensor

    def to(self, device):
        return Q(self.q.to(device), None if self.q_scale is None else self.q_scale.to(device),
                 self.weights.to(device))


def queries(T, H, D, fmt, gen, exact=False, wdtype=torch.float32, int8=False) -> Q:
    qv, qs, wf = formats.quantize_q(raw_rows((T, H, D), fmt, gen, exact), weights(T, H, gen, exact), fmt)
    if fmt == "mxfp4" and int8:
        qv = qv.view(torch.int8)
    return Q(qv, qs, wf.to(wdtype))


def with_duplicates(x, gen, frac=0.3):
    """Copy some rows of ``x [N, D]`` over others so exact ties appear between positions."""
    N = x.shape[0]
    if N < 2:
        return x
    x = x.clone()
    m = max(1, int(N * frac))
    dst = torch.randperm(N, generator=gen)[:m]
    src = torch.randint(0, N, (m,), generator=gen)
    x[dst] = x[src]
    return x


def packed_k(N, D, fmt, gen, exact=False, pow2=True):
    x = with_duplicates(raw_rows((N, D), fmt, gen, exact), gen)
    return formats.quantize_rows(x, fmt, pow2)


def prefill_rows(seq_lens, gen, extra_rows=()):
    """Ragged prefill rows over requests packed back to back: each request gets a few causal rows
    (lengths growing up to its end), plus ``extra_rows`` of explicit ``(ks, ke)``. Returns int32 ks, ke."""
    ks, ke, start = [], [], 0
    for n in seq_lens:
        rows = sorted(set([n, max(n - 1, 0)] + torch.randint(0, n + 1, (2,), generator=gen).tolist()))
        for r in rows:
            ks.append(start)
            ke.append(start + r)
        start += n
    for a, b in extra_rows:
        ks.append(a)
        ke.append(b)
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


@dataclass
class Paged:
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: list


def paged_cache(seq_lens, bs, D, fmt, gen, exact=False, max_blocks=None, spare=2, stale=True):
    """Requests' K in a shuffled paged cache (``testing.make_paged_cache``) from this module's row
    generator (exact or random data, duplicated rows); stale table entries by default."""
    pc = testing.make_paged_cache(seq_lens, bs, D, fmt, gen=gen, max_blocks=max_blocks, spare_blocks=spare,
                                  stale=stale, rows=lambda n: with_duplicates(raw_rows((n, D), fmt, gen, exact), gen))
    return Paged(pc.kv_cache, pc.block_table, list(seq_lens))


def decode_rows(seq_lens, gen, mtp=3):
    """Decode rows with MTP: request r contributes ``mtp`` rows (lengths n - mtp + 1 .. n, growing) when it
    has that many tokens, else one row of length n. Returns (context_lens, req_indices) int32."""
    lens, reqs = [], []
    for r, n in enumerate(seq_lens):
        m = mtp if (r % 2 == 0 and n >= mtp) else 1
        for t in range(m):
            lens.append(n - m + 1 + t)
            reqs.append(r)
    return torch.tensor(lens, dtype=torch.int32), torch.tensor(reqs, dtype=torch.int32)


def candidates(ns, num_blocks, cbs, gen, junk=False):
    """int32 ``[R, num_blocks]``: per row up to ``num_blocks`` distinct ascending block ids in
    ``[0, ceil(n / cbs))``, then -1. With ``junk`` some rows also carry ids past the row's blocks (allowed:
    they score -inf)."""
    out = torch.full((len(ns), num_blocks), -1, dtype=torch.int32)
    for r, n in enumerate(ns):
        nbk = (max(n, 0) + cbs - 1) // cbs
        hi = nbk + (2 if junk and r % 3 == 0 else 0)
        m = min(num_blocks, hi)
        if m == 0:
            continue
        if r % 4 == 1:
            m = max(1, m - 1)  # leave -1 padding even when more blocks exist
        ids = torch.randperm(hi, generator=gen)[:m].sort().values
        out[r, :m] = ids.to(torch.int32)
    return out


def special_logits(R, L, gen, dtype=torch.float32):
    """Rows for the selection ops: small integers (many ties), an all-equal row, Gaussian rows, rows with
    NaN, -inf and +inf sprinkled in."""
    x = _randint(-3, 3, (R, L), gen)
    for r in range(R):
        kind = r % 6
        if kind == 1:
            x[r] = 1.5
        elif kind == 2:
            x[r] = torch.randn(L, generator=gen)
        elif kind == 3:
            x[r][torch.rand(L, generator=gen) < 0.3] = float("nan")
        elif kind == 4:
            x[r][torch.rand(L, generator=gen) < 0.3] = float("-inf")
        elif kind == 5:
            m = torch.rand(L, generator=gen)
            x[r][m < 0.25] = float("nan")
            x[r][(m >= 0.25) & (m < 0.5)] = float("-inf")
            x[r][(m >= 0.5) & (m < 0.55)] = float("inf")
    return x.to(dtype)


def lengths_for(R, L, k, gen):
    """Row lengths covering 0, 1, k - 1, k, k + 1, the full width, past the width and negative."""
    pool = [0, 1, max(k - 1, 0), k, k + 1, L, L + 5, -3]
    out = [pool[r] if r < len(pool) else int(torch.randint(0, L + 1, (1,), generator=gen)) for r in range(R)]
    return torch.tensor(out, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------
# One valid argument set per op (bad-input, opcheck and compile tests start from these)
# ----------------------------------------------------------------------------------------------------

def arg_names(op):
    return [a.name for a in getattr(torch.ops.sparse_indexer, op).default._schema.arguments]


def mutated_args(op):
    return [a.name for a in getattr(torch.ops.sparse_indexer, op).default._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write]


def call(op, a):
    """Call ``torch.ops.sparse_indexer.<op>`` with the argument dict ``a``."""
    return getattr(torch.ops.sparse_indexer, op)(*[a[n] for n in arg_names(op)])


def op_args(op, fmt="fp8", T=3, H=8, D=64, N=10, BS=16, CBS=8, TOPK=4, L=32, seed=0):
    """A valid argument dict for ``op``: ``T`` <= 5 rows, ``N`` packed keys, a 4-page cache of block size
    ``BS``, two candidate blocks of ``CBS`` per row, dense width ``L``."""
    from torch_sparse_indexer import workspace
    g = torch.Generator().manual_seed(seed)
    i32 = dict(dtype=torch.int32)
    Qs = queries(T, H, D, fmt, g)
    k, k_scale = packed_k(N, D, fmt, g)
    common_q = dict(q=Qs.q, q_scale=Qs.q_scale, weights=Qs.weights)
    prefill = dict(common_q, k=k, k_scale=k_scale, ks=torch.tensor([0, 0, 2, 1, N], **i32)[:T].clamp(max=N),
                   ke=torch.tensor([4, 10, 6, 9, N], **i32)[:T].clamp(max=N))
    cache = formats.allocate_k_cache(4, BS, D, fmt)
    cache.copy_(torch.randint(0, 120, cache.shape, generator=g, dtype=torch.uint8))  # finite fp8 / fp4 bytes
    decode = dict(common_q, kv_cache=cache, context_lens=torch.tensor([5, 20, 3, 0, 17], **i32)[:T],
                  block_table=torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0], [0, 2]], **i32)[:max(T, 1)].clone(),
                  req_indices=None)
    cb = torch.tensor([[0, -1], [0, 1], [0, -1], [1, -1], [-1, -1]], **i32)[:T].clone()
    idx = torch.zeros(T, TOPK, **i32)
    dws = torch.zeros(workspace.dense_workspace_bytes(max(T, 1), L), dtype=torch.uint8)
    sws = torch.zeros(workspace.sparse_workspace_bytes(max(T, 1), 2, CBS), dtype=torch.uint8)
    kdt = formats.FP8_DTYPE if fmt == "fp8" else torch.uint8
    lens = torch.tensor([3, L, 0, 1, L // 2], **i32)[:T]
    col = torch.arange(L)
    cp_positions = torch.where(col < lens[:, None], 2 * col + 1, -1).to(torch.int32)

    def cp_entries(width, stride):
        """int32 [2, T, width]: rank w's ids ``w + stride * j`` (stride 1: ranks share ids), the last one -1
        on odd rows."""
        e = torch.arange(2)[:, None, None] + stride * torch.arange(width)[None, None, :]
        e = e.expand(2, T, width).clone()
        e[:, 1::2, -1] = -1
        return e.to(torch.int32)
    table = {
        "write_k_cache": lambda: dict(k=torch.randn(5, D, generator=g),
                                      slot_mapping=torch.tensor([0, 3, -1, 17, 4 * BS - 1]),
                                      kv_cache=cache, fmt=fmt, pow2_scale=True),
        "gather_k": lambda: dict(kv_cache=cache, block_table=decode["block_table"][:3],
                                 cu_seq_lens=torch.tensor([0, 5, 20, 23], **i32),
                                 k=torch.zeros(24, D if fmt == "fp8" else D // 2, dtype=kdt),
                                 k_scale=torch.zeros(24, dtype=torch.float32 if fmt == "fp8" else torch.int32),
                                 fmt=fmt),
        "quantize_q": lambda: dict(q=torch.randn(T, H, D, generator=g), weights=torch.randn(T, H, generator=g),
                                   fmt=fmt, weight_scale=0.5),
        "mqa_logits": lambda: dict(prefill, logits=torch.zeros(T, L)),
        "paged_mqa_logits": lambda: dict(decode, logits=torch.zeros(T, L)),
        "sparse_mqa_logits": lambda: dict(prefill, candidate_blocks=cb, cbs=CBS, logits=torch.zeros(T, 2 * CBS)),
        "paged_sparse_mqa_logits": lambda: dict(decode, candidate_blocks=cb, cbs=CBS,
                                                logits=torch.zeros(T, 2 * CBS)),
        "topk": lambda: dict(logits=torch.randn(T, L, generator=g), lengths=lens, k=TOPK, indices=idx),
        "sparse_topk": lambda: dict(logits=torch.randn(T, 2 * CBS, generator=g), candidate_blocks=cb, cbs=CBS,
                                    lengths=lens, k=TOPK, indices=idx),
        "block_topk": lambda: dict(logits=torch.randn(T, L, generator=g), lengths=lens, cbs=CBS,
                                   candidate_blocks=torch.zeros(T, 2, **i32)),
        "indexer_prefill": lambda: dict(prefill, max_context=L, topk=TOPK, cbs=CBS, workspace=dws,
                                        topk_indices=idx, candidate_blocks=torch.zeros(T, 2, **i32)),
        "indexer_decode": lambda: dict(decode, max_context=L, topk=TOPK, cbs=CBS, workspace=dws, topk_indices=idx,
                                       candidate_blocks=torch.zeros(T, 2, **i32)),
        "sparse_indexer_prefill": lambda: dict(prefill, candidate_blocks=cb, cbs=CBS, topk=TOPK, workspace=sws,
                                               topk_indices=idx),
        "sparse_indexer_decode": lambda: dict(decode, candidate_blocks=cb, cbs=CBS, topk=TOPK, workspace=sws,
                                              topk_indices=idx),
        # context parallelism: rank 1 of 2 (interleave 1) holds the odd positions; merges get 2 ranks' entries
        "cp_local_topk": lambda: dict(logits=special_logits(T, L, g), positions=cp_positions, k=TOPK,
                                      scores=torch.zeros(T, TOPK), out_positions=torch.zeros(T, TOPK, **i32)),
        "cp_topk_merge": lambda: dict(scores=special_logits(2 * T, TOPK, g).view(2, T, TOPK),
                                      positions=cp_entries(TOPK, 2), k=TOPK, indices=idx),
        "cp_local_block_topk": lambda: dict(logits=special_logits(T, L, g), positions=cp_positions, cbs=CBS,
                                            scores=torch.zeros(T, 2), blocks=torch.zeros(T, 2, **i32)),
        "cp_block_merge": lambda: dict(scores=special_logits(2 * T, 3, g).view(2, T, 3), blocks=cp_entries(3, 1),
                                       candidate_blocks=torch.zeros(T, 2, **i32)),
    }
    a = table[op]()
    return {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in a.items()}
