"""CUDA-graph capture of whole steps (GPU only): the decode step and a mixed prefill step of the two-layer
stack from test_layers.py (metadata build + K write + dense level with candidate publishing + consumer
level) captured once with ``torch.cuda.graph`` and replayed 100 times with new q / k / weights, new lengths
and a different mix of requests each time. Every replay equals an eager run on a twin stack (top-k,
candidates, caches, metadata), sampled replays also equal the per-row reference composition (exact data),
and ``torch.cuda.memory_allocated()`` does not move across replays. The eager step runs clean under
``torch.cuda.set_sync_debug_mode("error")``, and ``torch.compile(mode="reduce-overhead", fullgraph=True)``
records the step without skipping cudagraphs."""
from __future__ import annotations

import random

import pytest
import torch

from torch_sparse_indexer import backends
from torch_sparse_indexer.metadata import IndexerCapacities, IndexerMetadataBuilder

from test_layers import Stack, StackConfig, expected_rows, prepare, random_step

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _caps(cfg):
    full = cfg.caps
    dec = IndexerCapacities(full.max_decode_rows, 0, 0, full.max_reqs, full.max_blocks_per_req, full.block_size)
    return dec, full


class StaticStep:
    """Static input buffers for one capacity, and the step that reads only them (what a graph replays)."""

    def __init__(self, stack: Stack, caps: IndexerCapacities):
        cfg, T, R, MB = stack.cfg, caps.max_tokens, caps.max_reqs, caps.max_blocks_per_req
        i32 = dict(dtype=torch.int32, device=DEV)
        self.stack, self.caps = stack, caps
        self.builder = IndexerMetadataBuilder(caps, device=DEV)
        self.qsl, self.seqs = torch.zeros(R + 1, **i32), torch.zeros(R, **i32)
        self.table, self.nd = torch.full((R, MB), -1, **i32), torch.zeros(1, **i32)
        qd = cfg.D if cfg.fmt == "fp8" else cfg.D // 2
        qdt = torch.float8_e4m3fn if cfg.fmt == "fp8" else torch.uint8
        self.q = [torch.zeros(T, cfg.H, qd, dtype=qdt, device=DEV) for _ in range(2)]
        self.qs = [None if cfg.fmt == "fp8" else torch.zeros(T, cfg.H, **i32) for _ in range(2)]
        self.w = [torch.zeros(T, cfg.H, device=DEV) for _ in range(2)]
        self.k = [torch.zeros(T, cfg.D, device=DEV) for _ in range(2)]

    def load(self, step, qs, ks):
        for dst, src in zip((self.qsl, self.seqs, self.table, self.nd), step.tensors(DEV)):
            dst.copy_(src)
        for i in range(2):
            self.q[i].copy_(qs[i][0])
            if self.qs[i] is not None:
                self.qs[i].copy_(qs[i][1])
            self.w[i].copy_(qs[i][2])
            self.k[i].copy_(ks[i])

    def __call__(self):
        m = self.builder.build(self.qsl, self.seqs, self.table, self.nd)
        self.stack.dense(self.q[0], self.qs[0], self.w[0], self.k[0], m)
        self.stack.sparse(self.q[1], self.qs[1], self.w[1], self.k[1], m)


def _warm(stack, caps_list):
    for layer in (stack.dense, stack.sparse):
        layer.warmup(stack.cfg.H, capacities=caps_list, k_dtype=torch.float32)


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                      # first run on the side stream (lazy per-stream state), then capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _assert_same(a: Stack, b: Stack, T, what):
    pairs = [(a.out[0][:T], b.out[0][:T], "dense top-k"), (a.cand[:T], b.cand[:T], "candidates"),
             (a.out[1][:T], b.out[1][:T], "consumer top-k")]
    pairs += [(x.kv_cache, y.kv_cache, "cache") for x, y in zip(a.caches, b.caches)]
    for x, y, name in pairs:
        if not torch.equal(x, y):
            rows = (x != y).reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: {name} differs from eager in rows {rows[:10]}")


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_captured_steps_replay_like_eager(fmt, seed):
    cfg = StackConfig(fmt=fmt) if fmt == "fp8" else StackConfig(fmt="mxfp4", H=8, D=64, block_size=32, cbs=16,
                                                                nbk=2, topk=12)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    caps_dec, caps_full = _caps(cfg)
    graph_stack, eager_stack = Stack(cfg, DEV), Stack(cfg, DEV)
    _warm(graph_stack, [caps_dec, caps_full])
    _warm(eager_stack, [caps_dec, caps_full])
    statics = {c: StaticStep(graph_stack, c) for c in (caps_dec, caps_full)}
    graphs = {c: _capture(s) for c, s in statics.items()}
    eager_builders = {c: IndexerMetadataBuilder(c, device=DEV) for c in (caps_dec, caps_full)}
    mem = None
    for it in range(100):
        c = caps_dec if rng.random() < 0.5 else caps_full
        step = random_step(rng, gen, cfg, c, mtp=rng.randint(1, 3))
        qs, ks = prepare(step, graph_stack, DEV)
        prepare(step, eager_stack, DEV)
        statics[c].load(step, qs, ks)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        graphs[c].replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before, f"replay {it} allocated"
        mem = before if mem is None else mem
        m = eager_builders[c].build(*step.tensors(DEV))
        eager_stack.step(m, qs, ks)
        _assert_same(graph_stack, eager_stack, c.max_tokens, f"replay {it} ({c})")
        for a, b in zip(statics[c].builder.metadata_tensors(), eager_builders[c].metadata_tensors()):
            assert torch.equal(a, b), f"replay {it}: metadata differs"
        if it % 10 == 0:  # and both equal the per-row reference composition (exact data)
            want, _ = expected_rows(step, graph_stack)
            T = c.max_tokens
            got = [graph_stack.out[0][:T].cpu(), graph_stack.cand[:T].cpu(), graph_stack.out[1][:T].cpu()]
            for g, w, name in zip(got, want, ("dense top-k", "candidates", "consumer top-k")):
                assert torch.equal(g, w), f"replay {it}: {name} differs from the reference composition"
    torch.cuda.synchronize()
    del m, qs, ks, step
    assert torch.cuda.memory_allocated() <= mem + (1 << 20), "memory grew over the replays"


def test_eager_step_does_not_sync():
    cfg = StackConfig()
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    stack = Stack(cfg, DEV)
    caps_dec, caps_full = _caps(cfg)
    _warm(stack, [caps_dec, caps_full])
    for c in (caps_full, caps_dec, caps_full):
        step = random_step(rng, gen, cfg, c)
        qs, ks = prepare(step, stack, DEV)
        builder = IndexerMetadataBuilder(c, device=DEV)
        inputs = step.tensors(DEV)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            m = builder.build(*inputs)
            stack.step(m, qs, ks)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def test_builder_keeps_no_memory():
    cfg = StackConfig()
    builder = IndexerMetadataBuilder(cfg.caps, device=DEV)
    step = random_step(random.Random(2), torch.Generator().manual_seed(2), cfg, cfg.caps)
    inputs = step.tensors(DEV)
    builder.build(*inputs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        builder.build(*inputs)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_reduce_overhead_compile_records_cudagraphs(seed):
    from torch._dynamo.utils import counters

    cfg = StackConfig()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    caps_dec, caps_full = _caps(cfg)
    comp_stack, eager_stack = Stack(cfg, DEV), Stack(cfg, DEV)
    _warm(comp_stack, [caps_full])
    static = StaticStep(comp_stack, caps_full)
    eager_builder = IndexerMetadataBuilder(caps_full, device=DEV)
    torch._dynamo.reset()
    counters.clear()
    patch = {"triton.cudagraph_or_error": True} if hasattr(torch._inductor.config.triton, "cudagraph_or_error") else {}
    with torch._inductor.config.patch(patch):
        fn = torch.compile(static.__call__, mode="reduce-overhead", fullgraph=True)
        for it in range(6):
            step = random_step(rng, gen, cfg, caps_full, mtp=1 + it % 3)
            qs, ks = prepare(step, comp_stack, DEV)
            prepare(step, eager_stack, DEV)
            static.load(step, qs, ks)
            with backends.record_dispatch() as comp_rec:
                fn()
            torch.cuda.synchronize()
            with backends.record_dispatch() as eager_rec:
                eager_stack.step(eager_builder.build(*step.tensors(DEV)), qs, ks)
            # On a mismatch, say which backends ran (replays after the warm-up run record nothing).
            why = f" (compiled ran {sorted(set(comp_rec))}, eager ran {sorted(set(eager_rec))})"
            for a, b in zip(static.builder.metadata_tensors(), eager_builder.metadata_tensors()):
                assert torch.equal(a, b), f"reduce-overhead step {it}: metadata differs" + why
            _assert_same(comp_stack, eager_stack, caps_full.max_tokens, f"reduce-overhead step {it}" + why)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_compiled_builder_matches_eager(seed):
    """The metadata builder alone, compiled with Inductor on the GPU, equals the eager builder on random
    engine inputs, field by field (narrows down a compiled step that differs from eager)."""
    from torch_sparse_indexer.metadata import _TENSOR_FIELDS

    cfg = StackConfig()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    eb, cb = IndexerMetadataBuilder(cfg.caps, device=DEV), IndexerMetadataBuilder(cfg.caps, device=DEV)
    torch._dynamo.reset()
    fn = torch.compile(cb.build, fullgraph=True, dynamic=False)
    for it in range(8):
        inputs = random_step(rng, gen, cfg, cfg.caps, mtp=1 + it % 3).tensors(DEV)
        eb.build(*inputs)
        fn(*inputs)
        torch.cuda.synchronize()
        fields = [n for n in _TENSOR_FIELDS if getattr(eb, n) is not None]
        bad = [(n, getattr(eb, n).tolist(), getattr(cb, n).tolist()) for n in fields
               if not torch.equal(getattr(eb, n), getattr(cb, n))]
        assert not bad, f"step {it}: compiled builder differs from eager: {bad[:3]}"
