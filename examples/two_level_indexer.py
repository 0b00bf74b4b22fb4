"""A two-level DeepSeek sparse indexer (V4.1 style) serving a realistic mixed batch.

A synthetic DeepSeek-like stack: layer 0 is the candidate source (dense ``MQAIndexer``, publishes its best
candidate blocks), layers 1..N-1 are consumers (``SparseMQAIndexer``: they score only those blocks). Each
layer has its own random projections (hidden -> q, k, weights; RoPE on the first dims) and its own paged
K cache. A small scheduler serves several requests of different lengths: prefill in chunks under a token
budget (a request's earlier chunks are already in the cache), decode for the requests that are done, then
decode steps with and without MTP.

Every step (metadata build, projections, K writes, both levels) runs as one ``torch.compile(fullgraph=True)``
function per capacity bucket; on a GPU the decode step and each prefill bucket are also captured in a CUDA
graph once and replayed for every step with new data. After each step the example

* runs the same layers eagerly under ``torch_sparse_indexer.use_backend("reference")`` on the same inputs
  and compares every top-k row and candidate list exactly. A row may differ only where the reference
  scores of the two selections are equal within twice the served scorer's measured error on that row
  plus 1e-5 of the row's max (a near-tie: SM90's fp8 MMA keeps about 13 bits of a dot's running sum,
  so FP8 kernel scores differ from the fp32 reference by ~1e-4 of the row's max); anything else fails,
* measures each consumer layer's recall: the fraction of its dense top-k (a shadow dense indexer on the
  same cache) that the two-level top-k kept,

and prints the recalls, step times and peak memory. Exit status 1 if anything disagrees.

    python examples/two_level_indexer.py                           # small, CPU: well under a minute
    python examples/two_level_indexer.py --device cuda --heads 64 --dim 128 --context 131072 \\
        --requests 8 --topk 2048 --candidate-blocks 256 --cbs 64 --block-size 64 --chunk 8192 --check decode

On a CPU the default compile backend is ``aot_eager`` (Dynamo + AOTAutograd, fullgraph): Inductor's C++
compile of the stack's kernels alone takes minutes on a 2-core machine (``--compile-backend inductor``;
tests/test_layers.py compiles the step with Inductor and checks its post-grad graph). Every op still runs
on the reference backend there, so the CPU comparison checks compilation, not kernels.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

import torch_sparse_indexer as tsi
from torch_sparse_indexer import (IndexerCapacities, IndexerKCache, IndexerMetadataBuilder, MQAIndexer,
                                  SparseMQAIndexer, reference)

ops = torch.ops.sparse_indexer


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fmt", default="fp8", choices=["fp8", "mxfp4"])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64, choices=[64, 128])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rope-dim", type=int, default=32, help="RoPE on the first dims of q and k (0: off)")
    ap.add_argument("--layers", type=int, default=4, help="1 candidate source + (layers - 1) consumers")
    ap.add_argument("--context", type=int, default=512, help="longest request (cache blocks per request)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--cbs", type=int, default=16, help="candidate block size")
    ap.add_argument("--candidate-blocks", type=int, default=8, help="blocks the source publishes per row")
    ap.add_argument("--block-size", type=int, default=64, help="cache block size")
    ap.add_argument("--chunk", type=int, default=128, help="prefill token budget per step (largest bucket)")
    ap.add_argument("--buckets", type=int, default=None,
                    help="prefill buckets (halving the budget); default 1 on CPU (compile time), 3 on GPU")
    ap.add_argument("--mtp", type=int, default=2, help="draft tokens per request in MTP decode steps")
    ap.add_argument("--decode-steps", type=int, default=4, help="decode steps (alternating plain / MTP)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend; default inductor on a GPU, aot_eager on a CPU (Inductor's C++ "
                         "compile of the stack's kernels takes minutes on a 2-core machine; tests/test_layers.py "
                         "compiles the step with Inductor)")
    ap.add_argument("--no-graphs", action="store_true", help="GPU: replay compiled steps without CUDA graphs")
    ap.add_argument("--check", default="all", choices=["all", "decode", "none"],
                    help="steps compared with the reference backend (the reference's prefill at 128K contexts "
                         "is slow: use 'decode' there)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------------
# Synthetic model pieces
# ----------------------------------------------------------------------------------------------------

def rope(x, positions, dims):
    """Rotate-half RoPE on the first ``dims`` features of ``x [T, ..., D]`` (float32 math)."""
    if dims == 0:
        return x
    half = dims // 2
    inv = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    ang = positions.float()[:, None] * inv[None]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:dims]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, xf[..., dims:]], dim=-1).to(x.dtype)


class IndexerProjections(nn.Module):
    """hidden -> (q [T, H, D], weights [T, H], k [T, D]) as DeepSeek's indexer makes them (random weights)."""

    def __init__(self, hidden, H, D, rope_dim, dtype, device, gen):
        super().__init__()
        def w(*shape):
            return nn.Parameter((torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(device, dtype),
                                requires_grad=False)
        self.wq, self.wk, self.ww = w(hidden, H * D), w(hidden, D), w(hidden, H)
        self.k_norm = nn.LayerNorm(D, device=device, dtype=dtype)
        self.H, self.D, self.rope_dim = H, D, rope_dim

    def forward(self, x, positions):
        T = x.shape[0]
        q = rope((x @ self.wq).view(T, self.H, self.D), positions, self.rope_dim)
        k = rope(self.k_norm(x @ self.wk), positions, self.rope_dim)
        weights = (x @ self.ww).float() * self.H ** -0.5
        return q, weights, k


class TwoLevelStack(nn.Module):
    """Per layer: projections, an IndexerKCache, an indexer layer and its own top-k buffer (an engine shares
    one buffer between layers; separate ones let the example compare every layer after the step). The
    step's inputs live in static buffers (what a captured graph reads); each layer's quantized q / weights /
    new k are kept in static buffers too, so the reference run can replay the layers on the same inputs."""

    def __init__(self, a, caps: IndexerCapacities, num_cache_blocks, device, dtype, gen):
        super().__init__()
        H, D, T = a.heads, a.dim, caps.max_tokens
        self.fmt, self.H, self.D, self.caps = a.fmt, H, D, caps
        self.register_buffer("embed", torch.randn(4096, a.hidden, generator=gen).to(device, dtype))
        self.proj = nn.ModuleList(IndexerProjections(a.hidden, H, D, a.rope_dim, dtype, device, gen)
                                  for _ in range(a.layers))
        self.caches = nn.ModuleList(IndexerKCache(num_cache_blocks, a.block_size, D, a.fmt, device=device)
                                    for _ in range(a.layers))
        i32 = dict(dtype=torch.int32, device=device)
        self.register_buffer("candidates", torch.full((T, a.candidate_blocks), -1, **i32))
        self.topk_bufs = [torch.full((T, a.topk), -1, **i32) for _ in range(a.layers)]
        layers = [MQAIndexer(self.caches[0], a.topk, D, None, self.topk_bufs[0], self.candidates, a.cbs,
                             capacities=caps)]
        layers += [SparseMQAIndexer(self.caches[i], a.topk, D, None, self.topk_bufs[i], self.candidates, a.cbs,
                                    capacities=caps) for i in range(1, a.layers)]
        self.layers = nn.ModuleList(layers)
        # Static step inputs.
        R, MB = caps.max_reqs, caps.max_blocks_per_req
        self.register_buffer("tokens", torch.zeros(T, dtype=torch.int64, device=device))
        self.register_buffer("positions", torch.zeros(T, **i32))
        self.register_buffer("qsl", torch.zeros(R + 1, **i32))
        self.register_buffer("seq_lens", torch.zeros(R, **i32))
        self.register_buffer("block_table", torch.full((R, MB), -1, **i32))
        self.register_buffer("num_decode_reqs", torch.zeros(1, **i32))
        # Saved per-layer inputs of the indexer layers.
        qd = D if a.fmt == "fp8" else D // 2
        qdt = tsi.formats.FP8_DTYPE if a.fmt == "fp8" else torch.uint8
        self.saved_q = [torch.zeros(T, H, qd, dtype=qdt, device=device) for _ in range(a.layers)]
        self.saved_qs = [None if a.fmt == "fp8" else torch.zeros(T, H, **i32) for _ in range(a.layers)]
        self.saved_w = [torch.zeros(T, H, dtype=torch.float32, device=device) for _ in range(a.layers)]
        self.saved_k = [torch.zeros(T, D, dtype=dtype, device=device) for _ in range(a.layers)]
        for t in self.topk_bufs + self.saved_q + self.saved_w + self.saved_k + [s for s in self.saved_qs if s is not None]:
            torch._dynamo.mark_static_address(t, guard=False)

    def step(self, builder: IndexerMetadataBuilder, T: int):
        """One serving step over the first ``T`` token rows of the static inputs (T = the bucket's rows)."""
        m = builder.build(self.qsl, self.seq_lens, self.block_table, self.num_decode_reqs)
        x = self.embed[self.tokens[:T]]
        pos = self.positions[:T]
        for i, (proj, layer) in enumerate(zip(self.proj, self.layers)):
            q, w, k = proj(x, pos)
            q8, qs, w8 = ops.quantize_q(q, w, self.fmt, self.D ** -0.5)
            self.saved_q[i][:T].copy_(q8)
            self.saved_w[i][:T].copy_(w8)
            self.saved_k[i][:T].copy_(k)
            if qs is not None:
                self.saved_qs[i][:T].copy_(qs)
            layer(q8, qs, w8, k, m)


# ----------------------------------------------------------------------------------------------------
# A small scheduler
# ----------------------------------------------------------------------------------------------------

@dataclass
class Request:
    rid: int
    prompt: int
    tokens: list
    length: int = 0                  # tokens in the cache
    pages: list = field(default_factory=list)

    @property
    def prefilled(self):
        return self.length >= self.prompt


class Engine:
    def __init__(self, a, rng, num_cache_blocks):
        self.a, self.rng = a, rng
        self.free = list(range(num_cache_blocks))
        rng.shuffle(self.free)
        budget = a.context - a.decode_steps * a.mtp - 1
        self.reqs = []
        for r in range(a.requests):
            p = rng.randint(max(16, budget // 16), budget) if r else budget    # one request at the longest
            self.reqs.append(Request(r, p, [rng.randrange(4096) for _ in range(a.context)]))
        rng.shuffle(self.reqs)

    def schedule(self, chunk, next_n):
        """[(request, new tokens)]: decode requests first (next_n tokens each), then prefill chunks."""
        dec = [(r, next_n) for r in self.reqs if r.prefilled]
        pre, left = [], chunk
        for r in self.reqs:
            if not r.prefilled and left > 0:
                q = min(left, r.prompt - r.length)
                pre.append((r, q))
                left -= q
        return dec, pre

    def inputs(self, dec, pre, caps, bs):
        """Engine inputs padded to the capacities (fixed shapes), plus the tokens and positions."""
        R, MB, T = caps.max_reqs, caps.max_blocks_per_req, caps.max_tokens
        qsl, seqs, table, toks, pos = [0], [], [], [], []
        for r, q in dec + pre:
            L = r.length + q
            while len(r.pages) * bs < L:
                r.pages.append(self.free.pop())
            qsl.append(qsl[-1] + q)
            seqs.append(L)
            table.append(r.pages + [-1] * (MB - len(r.pages)))
            toks += r.tokens[r.length:L]
            pos += list(range(r.length, L))
        qsl += [qsl[-1]] * (R + 1 - len(qsl))
        seqs += [0] * (R - len(seqs))
        table += [[-1] * MB] * (R - len(table))
        toks += [0] * (T - len(toks))
        pos += [0] * (T - len(pos))
        return dict(qsl=qsl, seq_lens=seqs, block_table=table, tokens=toks, positions=pos, nd=len(dec))

    @staticmethod
    def advance(dec, pre):
        for r, q in dec + pre:
            r.length += q


# ----------------------------------------------------------------------------------------------------
# Comparison against the reference backend (tie-aware) and recall
# ----------------------------------------------------------------------------------------------------

def _row_scores(fmt, q, qs, w, kv, bt_row, n, served=False):
    """Float32 scores of positions [0, n) of one row: the reference's, or (``served``) the active backend's."""
    logits = torch.empty(1, n, device=q.device)
    fn = torch.ops.sparse_indexer.paged_mqa_logits if served else reference.paged_mqa_logits
    fn(q, qs, kv, w, torch.tensor([n], dtype=torch.int32, device=q.device), bt_row, None, logits)
    return logits[0].double()


def _score_gap(sa, sb):
    """Largest difference between the sorted scores of two selections (inf if their sizes differ)."""
    if sa.numel() != sb.numel():
        return float("inf")
    return float((sa.sort().values - sb.sort().values).abs().max()) if sa.numel() else 0.0


class Checker:
    """Compares a step's outputs with the reference run; mismatched rows pass only as near-ties."""

    def __init__(self, stack, a):
        self.stack, self.a = stack, a
        self.exact_rows = self.tie_rows = self.bad_rows = 0
        self.max_rel_err = 0.0  # served-vs-reference score error on mismatched rows, relative to the row's max
        self.messages = []

    def compare(self, got, want, meta, T):
        """``got`` / ``want``: per layer (top-k [T, k], candidates [T, NB] or None)."""
        row_req, row_len = meta.row_req[:T].tolist(), meta.row_len[:T].tolist()
        bt = meta.block_table
        st, cbs = self.stack, self.a.cbs
        src_diff = set()
        for i, ((gt, gc), (wt, wc)) in enumerate(zip(got, want)):
            rows = (gt != wt).any(dim=1)
            if gc is not None:
                rows |= (gc != wc).any(dim=1)
            bad = rows.nonzero().flatten().tolist()
            self.exact_rows += T - len(bad)
            for t in bad:
                n, b = row_len[t], row_req[t]
                ok, gap, scale, tol = n > 0, float("inf"), 1.0, 0.0
                if ok:
                    qs = None if st.saved_qs[i] is None else st.saved_qs[i][t:t + 1]
                    args = (st.fmt, st.saved_q[i][t:t + 1], qs, st.saved_w[i][t:t + 1], st.caches[i].kv_cache,
                            bt[b:b + 1], n)
                    s = _row_scores(*args)
                    fin = torch.isfinite(s)
                    scale = float(s[fin].abs().max()) if fin.any() else 1.0
                    # The tolerance is the served scorer's own measured error on this row (SM90's fp8 MMA keeps
                    # about 13 bits of a dot's running sum, so FP8 scores are not fp32-exact; see NOTES.md)
                    # plus 1e-5 relative for summation order: a flip inside it is a near-tie, not a bug.
                    err = float((_row_scores(*args, served=True)[fin] - s[fin]).abs().max()) if fin.any() else 0.0
                    tol = 2 * err + 1e-5 * scale + 1e-30
                    self.max_rel_err = max(self.max_rel_err, err / scale)
                    gap = 0.0
                    if i == 0 or t not in src_diff:
                        sel = lambda x: x[x >= 0].long()  # noqa: E731
                        gap = _score_gap(s[sel(gt[t])], s[sel(wt[t])])
                        if gc is not None and gap <= tol:
                            nb = (n + cbs - 1) // cbs
                            blk = torch.full((nb * cbs,), float("-inf"), dtype=torch.float64, device=s.device)
                            blk[:n] = s
                            blk = blk.view(nb, cbs).amax(dim=1)
                            gap = max(gap, _score_gap(blk[sel(gc[t])], blk[sel(wc[t])]))
                        ok = gap <= tol
                    # else: the rows saw different candidate lists (a source near-tie): not comparable.
                if i == 0:
                    src_diff.add(t)
                if ok:
                    self.tie_rows += 1
                else:
                    self.bad_rows += 1
                    if len(self.messages) < 5:
                        diff = sorted(set(gt[t].tolist()) ^ set(wt[t].tolist()))[:12]
                        self.messages.append(f"layer {i} row {t}: selections differ at {diff}; score gap "
                                             f"{gap / scale:.2e} of the row's max, tolerance {tol / scale:.2e}")


def recall(two_level, dense):
    """Mean over rows of |two-level top-k ∩ dense top-k| / |dense top-k| (rows with a dense selection)."""
    hits, rows = 0.0, 0
    for a, b in zip(two_level.tolist(), dense.tolist()):
        d = {x for x in b if x >= 0}
        if d:
            hits += len(d & {x for x in a if x >= 0}) / len(d)
            rows += 1
    return hits, rows


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.set_grad_enabled(False)                    # inference: nothing may start tracking gradients
    backend = a.compile_backend or ("inductor" if cuda else "aot_eager")
    if not cuda and (os.cpu_count() or 1) <= 4:
        torch._inductor.config.compile_threads = 1   # a worker pool costs more than it saves on a small CPU
    rng, gen = random.Random(a.seed), torch.Generator().manual_seed(a.seed)
    dtype = torch.bfloat16 if cuda else torch.float32
    nb = a.buckets or (3 if cuda else 1)
    buckets = sorted({max(8, a.chunk >> i) for i in range(nb)})
    R, bs = a.requests, a.block_size
    MB = (a.context + bs - 1) // bs
    Rd = R * max(1, a.mtp)
    packed = R * a.context
    caps_for = {b: IndexerCapacities(Rd, b, packed, R, MB, bs) for b in buckets}
    full = caps_for[buckets[-1]]
    caps_dec = IndexerCapacities(Rd, 0, 0, R, MB, bs)
    num_cache_blocks = R * MB + 4
    t_start = time.perf_counter()

    stack = TwoLevelStack(a, full, num_cache_blocks, dev, dtype, gen)
    ref = TwoLevelStack(a, full, num_cache_blocks, dev, dtype, torch.Generator().manual_seed(a.seed))
    shadows = [MQAIndexer(stack.caches[i], a.topk, a.dim, None,
                          torch.full((full.max_tokens, a.topk), -1, dtype=torch.int32, device=dev), capacities=full)
               for i in range(1, a.layers)]
    all_caps = [caps_dec] + [caps_for[b] for b in buckets]
    builders = {c: IndexerMetadataBuilder(c, device=dev) for c in all_caps}
    ref_builders = {c: IndexerMetadataBuilder(c, device=dev) for c in all_caps}
    if cuda:  # compile every kernel the steps can launch before anything is captured
        for layer in list(stack.layers) + shadows:
            layer.warmup(a.heads, capacities=all_caps, k_dtype=dtype)

    # One compiled function (and, on a GPU, one CUDA graph) per capacity bucket.
    runners = {}
    for c in all_caps:
        fn = (lambda c=c: stack.step(builders[c], c.max_tokens))
        if not a.no_compile:
            fn = torch.compile(fn, fullgraph=True, backend=backend)
        runners[c] = fn
    compile_s = 0.0
    if not a.no_compile or cuda:
        t0 = time.perf_counter()
        for c in all_caps:     # an empty step (no rows, no K written) compiles and warms each bucket
            _load(stack, _empty_inputs(c), dev)
            runners[c]()
        if cuda:
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
    graphs = {}
    if cuda and not a.no_graphs:
        pool = torch.cuda.graph_pool_handle()
        for c in all_caps:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                runners[c]()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                runners[c]()
            graphs[c] = g
        torch.cuda.synchronize()

    engine = Engine(a, rng, num_cache_blocks)
    checker = Checker(stack, a)
    times = {}
    rec = [[0.0, 0] for _ in range(a.layers - 1)]
    rec_decode = [[0.0, 0] for _ in range(a.layers - 1)]
    step_no, dec_steps, peak = 0, 0, 0
    while True:
        prefill_left = not all(r.prefilled for r in engine.reqs)
        if not prefill_left and dec_steps >= a.decode_steps:
            break
        next_n = 1 if prefill_left or dec_steps % 2 == 0 else a.mtp
        dec, pre = engine.schedule(a.chunk if prefill_left else 0, next_n)
        npre = sum(q for _, q in pre)
        c = caps_dec if not pre else caps_for[min(b for b in buckets if b >= npre)]
        kind = ("mixed" if dec else "prefill") if pre else ("decode-mtp" if next_n > 1 else "decode")
        inp = engine.inputs(dec, pre, c, bs)
        _load(stack, inp, dev)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if c in graphs:
            graphs[c].replay()
        else:
            runners[c]()
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated())
        times.setdefault(kind, []).append(time.perf_counter() - t0)
        T = c.max_tokens
        meta = builders[c].metadata()
        got = [(stack.topk_bufs[i][:T].clone(), stack.candidates[:T].clone() if i == 0 else None)
               for i in range(a.layers)]
        # Reference: the same layers' inputs through the reference backend, eagerly. It keeps its own caches,
        # so it sees every step's new K even when the comparison is skipped.
        with tsi.use_backend("reference"):
            _load(ref, inp, dev)
            m = ref_builders[c].build(ref.qsl, ref.seq_lens, ref.block_table, ref.num_decode_reqs)
            for i, layer in enumerate(ref.layers):
                qs = None if stack.saved_qs[i] is None else stack.saved_qs[i][:T]
                if a.check == "all" or not pre:
                    layer(stack.saved_q[i][:T], qs, stack.saved_w[i][:T], stack.saved_k[i][:T], m)
                else:  # only keep the reference caches in step
                    layer.k_cache.write(stack.saved_k[i][:T], m.slot_mapping[:T])
        want = [(ref.topk_bufs[i][:T], ref.candidates[:T] if i == 0 else None) for i in range(a.layers)]
        if a.check == "all" or (a.check == "decode" and not pre):
            checker.compare(got, want, meta, T)
        # Recall of each consumer against a dense indexer on its own cache.
        served = meta.row_len[:T] > 0
        is_dec = torch.zeros(T, dtype=torch.bool, device=dev)
        is_dec[: min(T, c.max_decode_rows)] = meta.decode_context_lens[: min(T, c.max_decode_rows)] > 0
        for j, sh in enumerate(shadows):
            i = j + 1
            qs = None if stack.saved_qs[i] is None else stack.saved_qs[i][:T]
            sh(stack.saved_q[i][:T], qs, stack.saved_w[i][:T], None, meta)
            two, dense = got[i][0], sh.topk_indices_buffer[:T]
            h, n = recall(two[served], dense[served])
            rec[j][0] += h
            rec[j][1] += n
            h, n = recall(two[served & is_dec], dense[served & is_dec])
            rec_decode[j][0] += h
            rec_decode[j][1] += n
        if int(meta.num_dropped_rows) != 0:
            checker.bad_rows += 1
            checker.messages.append(f"step {step_no}: {int(meta.num_dropped_rows)} rows dropped (capacity)")
        engine.advance(dec, pre)
        step_no += 1
        if not pre:
            dec_steps += 1

    total_s = time.perf_counter() - t_start
    print(f"two-level indexer: {a.layers} layers (1 source + {a.layers - 1} consumers), {a.fmt}, H={a.heads} "
          f"D={a.dim}, topk={a.topk}, {a.candidate_blocks} candidate blocks x {a.cbs}, cache block {bs}, "
          f"device {dev}{' (' + torch.cuda.get_device_name(dev) + ')' if cuda else ''}, torch {torch.__version__}")
    print(f"requests: {sorted(r.prompt for r in engine.reqs)} prompt tokens, chunk {a.chunk}, buckets {buckets}, "
          f"{a.decode_steps} decode steps (MTP {a.mtp} on every other)")
    mode = (f"compiled (fullgraph, backend={backend})" + (" + CUDA graphs" if graphs else "")
            if not a.no_compile else "eager")
    print(f"steps run {mode}; compile/warm-up {compile_s:.1f} s")
    print("step times (ms):")
    for kind, ts in times.items():
        ts = sorted(ts)
        print(f"  {kind:<11} x{len(ts):<3} median {1e3 * ts[len(ts) // 2]:9.3f}   min {1e3 * ts[0]:9.3f}")
    print("recall of the two-level top-k against the dense top-k (same layer, same cache):")
    for j in range(a.layers - 1):
        h, n = rec[j]
        hd, nd = rec_decode[j]
        print(f"  layer {j + 1}: {h / max(n, 1):.4f} over {n} rows  (decode rows: {hd / max(nd, 1):.4f} over {nd})")
    print("static memory of the served stack (MiB): " + ", ".join(
        f"{k} {v / 2**20:.1f}" for k, v in _buffer_bytes(stack, builders.values()).items()))
    if cuda:
        print(f"peak GPU memory allocated during step replays: {peak / 2**20:.1f} MiB (every tensor of the run "
              f"counted: the reference and shadow stacks' buffers too)")
    print(f"peak host RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; total {total_s:.1f} s")
    print(f"vs reference backend: {checker.exact_rows} rows exact, {checker.tie_rows} near-tie rows, "
          f"{checker.bad_rows} disagreements"
          + (f" (largest served-vs-reference score error on those rows: {checker.max_rel_err:.1e} of the row's max)"
             if checker.tie_rows + checker.bad_rows else ""))
    for msg in checker.messages:
        print("  " + msg)
    print("FAILED" if checker.bad_rows else "OK")
    return 1 if checker.bad_rows else 0


def _buffer_bytes(stack, builders):
    """Bytes of the stack's static buffers by kind (each storage counted once)."""
    seen, out = set(), {}

    def add(kind, t):
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
    for c in stack.caches:
        add("K caches", c.kv_cache)
    for layer in stack.layers:
        add("workspaces", layer.workspace)
        add("packed K", layer.packed_k)
        add("packed K", layer.packed_k_scale)
        add("top-k + candidates", layer.topk_indices_buffer)
        add("top-k + candidates", layer.candidate_blocks)
        add("decode scratch", layer.decode_topk)
        add("decode scratch", layer.decode_candidates)
    for b in builders:
        for t in b.buffers():
            add("metadata", t)
    return out


def _empty_inputs(c):
    R, MB, T = c.max_reqs, c.max_blocks_per_req, c.max_tokens
    return dict(qsl=[0] * (R + 1), seq_lens=[0] * R, block_table=[[-1] * MB] * R, tokens=[0] * T,
                positions=[0] * T, nd=0)


def _load(stack, inp, dev):
    """Copy one step's engine inputs into the stack's static buffers (host -> device, before the replay)."""
    T = len(inp["tokens"])
    stack.tokens[:T].copy_(torch.tensor(inp["tokens"], dtype=torch.int64))
    stack.positions[:T].copy_(torch.tensor(inp["positions"], dtype=torch.int32))
    stack.qsl.copy_(torch.tensor(inp["qsl"], dtype=torch.int32))
    stack.seq_lens.copy_(torch.tensor(inp["seq_lens"], dtype=torch.int32))
    stack.block_table.copy_(torch.tensor(inp["block_table"], dtype=torch.int32))
    stack.num_decode_reqs.fill_(inp["nd"])


if __name__ == "__main__":
    sys.exit(main())
