"""Determinism (SPEC section 4: "same inputs give bitwise-identical outputs every run").

* across runs: the same call repeated gives bitwise-identical top-k indices and candidate blocks;
* across batch compositions: a row's selection does not depend on which other rows share the batch (the row
  alone, inside the full batch, in a shuffled batch, next to copies of other rows, with a workspace small
  enough to split the batch into chunks);
* across execution modes: eager, ``torch.compile(fullgraph=True)`` and (GPU) CUDA-graph replay give the same
  bits for a whole two-level decode step and prefill step.

Inputs are Gaussian (near-ties everywhere, so any change of summation order would show) with exact duplicate
keys (true ties, so the tie-break is exercised). CPU runs in CI; the CUDA variants are gpu-marked and use
whatever backends dispatch picks.
"""
from __future__ import annotations

import pytest
import torch

from torch_sparse_indexer import formats, workspace
from torch_sparse_indexer.testing import assert_bitwise_equal

import cases

ops = torch.ops.sparse_indexer

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
CONFIGS = [("fp8", 64, 128, 64, 16), ("mxfp4", 16, 64, 16, 8)]  # fmt, H, D, cache block size, cbs
CFG_IDS = [f"{c[0]}-H{c[1]}-D{c[2]}" for c in CONFIGS]
TOPK, NBK = 24, 4


def _skip(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _decode(cfg, device, seed=0):
    fmt, H, D, bs, cbs = cfg
    g = torch.Generator().manual_seed(seed)
    seq = [150, 1, 77, 0, 129, 64]
    pc = cases.paged_cache(seq, bs, D, fmt, g, max_blocks=(max(seq) + bs - 1) // bs + 1)
    lens, req = cases.decode_rows(seq, g, mtp=3)
    Q = cases.queries(len(lens), H, D, fmt, g)
    dv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(q=dv(Q.q), q_scale=dv(Q.q_scale), kv_cache=dv(pc.kv_cache), weights=dv(Q.weights),
                context_lens=dv(lens), block_table=dv(pc.block_table), req_indices=dv(req),
                max_context=max(seq) + 3, cbs=cbs)


def _prefill(cfg, device, seed=0):
    fmt, H, D, bs, cbs = cfg
    g = torch.Generator().manual_seed(seed)
    seq = [130, 1, 0, 90]
    ks, ke = cases.prefill_rows(seq, g, extra_rows=[(0, 0), (5, 3)])
    k, kscale = cases.packed_k(sum(seq), D, fmt, g)
    Q = cases.queries(len(ks), H, D, fmt, g)
    dv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(q=dv(Q.q), q_scale=dv(Q.q_scale), k=dv(k), k_scale=dv(kscale), weights=dv(Q.weights),
                ks=dv(ks), ke=dv(ke), max_context=int((ke - ks).max()) + 3, cbs=cbs)


def _rows(a, idx, decode):
    """The argument dict restricted to rows ``idx`` (a list), in that order."""
    ii = torch.tensor(idx, dtype=torch.long, device=a["q"].device)
    b = dict(a)
    names = ("q", "q_scale", "weights", "context_lens", "req_indices") if decode else ("q", "q_scale", "weights",
                                                                                       "ks", "ke")
    for n in names:
        if b.get(n) is not None:
            b[n] = b[n].index_select(0, ii).contiguous()
    return b


def _ws(rows, width, device, small=False):
    n = workspace.min_workspace_bytes(width) if small else workspace.workspace_bytes(max(rows, 1), width)
    return torch.full((n,), 0x5A, dtype=torch.uint8, device=device)


def decode_logits(a):
    R = a["q"].shape[0]
    out = torch.full((R, a["max_context"]), 3.0, device=a["q"].device)
    ops.paged_mqa_logits(a["q"], a["q_scale"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"],
                         a["req_indices"], out)
    return out


def prefill_logits(a):
    T = a["q"].shape[0]
    out = torch.full((T, a["max_context"]), 3.0, device=a["q"].device)
    ops.mqa_logits(a["q"], a["q_scale"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"], out)
    return out


def _two_level(a, base, dense_op, sparse_op, small_ws):
    """Dense level (top-k + published candidate blocks), then the consumer level on those blocks."""
    N = a["q"].shape[0]
    dev = a["q"].device
    idx = torch.full((N, TOPK), -7, dtype=torch.int32, device=dev)
    cb = torch.full((N, NBK), -7, dtype=torch.int32, device=dev)
    dense_op(*base, a["max_context"], TOPK, a["cbs"], _ws(N, a["max_context"], dev, small_ws), idx, cb)
    sidx = torch.full((N, TOPK), -7, dtype=torch.int32, device=dev)
    sparse_op(*base, cb, a["cbs"], TOPK, _ws(N, NBK * a["cbs"], dev, small_ws), sidx)
    return idx, cb, sidx


def decode_step(a, small_ws=False):
    base = (a["q"], a["q_scale"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"], a["req_indices"])
    return _two_level(a, base, ops.indexer_decode, ops.sparse_indexer_decode, small_ws)


decode_step.logits = decode_logits


def prefill_step(a, small_ws=False):
    base = (a["q"], a["q_scale"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"])
    return _two_level(a, base, ops.indexer_prefill, ops.sparse_indexer_prefill, small_ws)


prefill_step.logits = prefill_logits


STEPS = [pytest.param(_decode, decode_step, True, id="decode"),
         pytest.param(_prefill, prefill_step, False, id="prefill")]


def _same(xs, ys, what, names=("topk indices", "candidate blocks", "consumer indices")):
    for x, y, name in zip(xs, ys, names):
        try:
            assert_bitwise_equal(x.cpu(), y.cpu())
        except AssertionError as e:
            raise AssertionError(f"{what}: {name}: {e}") from None


# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build, step, decode", STEPS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
def test_repeated_runs_bitwise(device, cfg, build, step, decode):
    _skip(device)
    a = build(cfg, device)
    first = step(a)
    assert (first[0] >= 0).any() and (first[2] >= 0).any()  # a real selection, not all padding
    for _ in range(4):
        _same(first, step(a), "repeat")
    _same(first, step(build(cfg, device)), "rebuilt inputs")  # fresh tensors, same values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build, step, decode", STEPS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
def test_row_independent_of_batch(device, cfg, build, step, decode):
    """Each row's selection -- and its dense scores, bit for bit, the quantity behind it -- is the same alone, in
    the full batch, shuffled, next to duplicated rows, and with a one-row workspace (the end-to-end op then
    runs its rows chunk by chunk)."""
    _skip(device)
    a = build(cfg, device)
    R = a["q"].shape[0]
    full = step(a)
    full_logits = step.logits(a)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(R, generator=g).tolist()
    mixed = [perm[0]] * 2 + perm[R // 2:] + [perm[1]]  # repeats and a subset, in another order
    layouts = {"shuffled": perm, "mixed": mixed, "reversed": list(range(R))[::-1]}
    for name, idx in layouts.items():
        b = _rows(a, idx, decode)
        out, lg = step(b), step.logits(b)
        for j, r in enumerate(idx):
            _same([o[j] for o in out], [f[r] for f in full], f"row {r} in the {name} batch (slot {j})")
            _same([lg[j]], [full_logits[r]], f"row {r} in the {name} batch (slot {j})", ("scores",))
    for r in range(R):
        b = _rows(a, [r], decode)
        out = step(b)
        _same([o[0] for o in out], [f[r] for f in full], f"row {r} alone")
        _same([step.logits(b)[0]], [full_logits[r]], f"row {r} alone", ("scores",))
    _same(step(a, small_ws=True), full, "one-row workspace")


def _compiled(step, a, decode):
    """``step`` through ``torch.compile(fullgraph=True)`` with the tensors as graph inputs."""
    names = [n for n, v in a.items() if isinstance(v, torch.Tensor)]
    statics = {n: v for n, v in a.items() if not isinstance(v, torch.Tensor)}

    def fn(*ts):
        return step(dict(zip(names, ts), **statics))
    cf = torch.compile(fn, fullgraph=True, dynamic=False)
    return lambda b: cf(*[b[n] for n in names])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build, step, decode", STEPS)
def test_eager_compiled_captured(device, build, step, decode):
    _skip(device)
    cfg = CONFIGS[0] if device == "cuda" else CONFIGS[1]
    a = build(cfg, device)
    eager = step(a)
    torch._dynamo.reset()
    comp = _compiled(step, a, decode)
    _same(eager, comp(a), "compiled vs eager")
    _same(eager, comp(build(cfg, device)), "compiled, fresh inputs")
    if device != "cuda":
        return
    # CUDA graph: capture the whole step (warmed up first, so nothing compiles during capture), replay.
    static = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in a.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(static)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        _same(eager, outs, "captured vs eager")
    # New values in the static inputs: the replay follows them exactly like eager does.
    b = build(cfg, device, seed=5)
    for n, v in b.items():
        if isinstance(v, torch.Tensor) and static[n].shape == v.shape:
            static[n].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    fresh = {n: (static[n].clone() if isinstance(static[n], torch.Tensor) else static[n]) for n in static}
    _same(step(fresh), outs, "captured vs eager on new inputs")


@pytest.mark.parametrize("device", DEVICES)
def test_selection_ops_bitwise(device):
    """The selection ops on ties, NaN, +-inf, signed zeros: repeated calls, row subsets and padded rows give
    the same bits."""
    _skip(device)
    g = torch.Generator().manual_seed(3)
    R, L = 24, 3000
    x = cases.special_logits(R, L, g)
    x[::5] = torch.where(torch.rand(L, generator=g) < 0.5, 0.0, -0.0)
    lengths = torch.randint(-2, L + 3, (R,), generator=g, dtype=torch.int32)
    x, lengths = x.to(device), lengths.to(device)
    k = 512
    outs = []
    for _ in range(3):
        o = torch.full((R, k), -9, dtype=torch.int32, device=device)
        ops.topk(x, lengths, k, o)
        outs.append(o.cpu())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for r in (0, 5, R - 1):
        o = torch.full((1, k), -9, dtype=torch.int32, device=device)
        ops.topk(x[r:r + 1], lengths[r:r + 1], k, o)
        assert torch.equal(o.cpu()[0], outs[0][r]), r
    blocks = []
    for _ in range(2):
        cb = torch.full((R, 40), -9, dtype=torch.int32, device=device)
        ops.block_topk(x, lengths, 16, cb)
        blocks.append(cb.cpu())
    assert torch.equal(blocks[0], blocks[1])
    cand = cases.candidates(lengths.clamp(0, L).tolist(), 30, 16, g).to(device)
    sx = x[:, : 30 * 16].contiguous()
    res = []
    for _ in range(2):
        o = torch.full((R, k), -9, dtype=torch.int32, device=device)
        ops.sparse_topk(sx, cand, 16, lengths, k, o)
        res.append(o.cpu())
    assert torch.equal(res[0], res[1])
