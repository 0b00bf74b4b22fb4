"""Replay stress: one CUDA graph per step, replayed many times with a new batch each time.

Two steps are captured, each once, at fixed capacities:

* decode, two-level: new K of every row written into two layers' caches (``write_k_cache``), queries quantized
  (``quantize_q``), the dense level selects top-k and publishes candidate blocks (``indexer_decode``), the
  consumer level scores only those blocks in the other layer (``sparse_indexer_decode``);
* prefill, two-level: new tokens written, each layer's requests packed back (``gather_k``), the dense level
  (``indexer_prefill``, publishing blocks) and the consumer level (``sparse_indexer_prefill``).

Before every replay the static inputs get a random batch that fits the capacities: number of requests
(zero included), context lengths (mid-page ends included), MTP rows per request, query tokens per request, a
shuffled block table with stale entries, padded rows, new K / q / weights. Every ``check_every`` replays the
step is also run eagerly on copies of the same state and must match the replay bit for bit (outputs and cache
bytes), and ``torch.cuda.memory_allocated()`` must not have moved since capture.

pytest (gpu-marked): ``TSI_STRESS_REPLAYS`` replays per step (default 500). Script mode, for the H200 run:
``python tests/test_replay_stress_gpu.py`` (default 10000 replays per step; prints a PASS/FAIL line per step).
``TSI_STRESS_DEVICE=cpu`` runs the same batch generator and eager comparison without capture (logic check).
"""
from __future__ import annotations

import os
import random
import sys
import time

import pytest
import torch

import torch_sparse_indexer  # noqa: F401
from torch_sparse_indexer import formats, workspace

ops = torch.ops.sparse_indexer


class Step:
    """Static buffers of one step, a batch generator that refills them, and the step itself."""

    def __init__(self, device, fmt, H=64, D=128, bs=64, cbs=16, topk=256, nbk=16, seed=0):
        self.dev, self.fmt, self.H, self.D, self.bs, self.cbs = device, fmt, H, D, bs, cbs
        self.topk, self.nbk = topk, nbk
        self.rng = random.Random(seed)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.wscale = H ** -0.5

    def _cache(self, nb):
        """A cache whose every slot holds quantized random K (older tokens of later batches read them)."""
        c = torch.empty(nb, self.bs, formats.bytes_per_token(self.fmt, self.D), dtype=torch.uint8, device=self.dev)
        k = torch.randn(nb * self.bs, self.D, generator=self.gen, device=self.dev).to(torch.bfloat16)
        ops.write_k_cache(k, torch.arange(nb * self.bs, device=self.dev), c, self.fmt, True)
        return c

    def _i32(self, *shape):
        return torch.zeros(*shape, dtype=torch.int32, device=self.dev)

    def _table(self, nreq, needs):
        """A block table with each request's pages drawn from a shuffled pool; entries past a request's pages
        are -1 or stale ids. Rows of absent requests are -1."""
        MB, NB = self.max_blocks, self.num_pages
        pool = list(range(NB))
        self.rng.shuffle(pool)
        bt = torch.full((self.nreq_cap, MB), -1, dtype=torch.int32)
        it = iter(pool)
        for r in range(nreq):
            for b in range(MB):
                if b < needs[r]:
                    bt[r, b] = next(it)
                elif self.rng.random() < 0.3:
                    bt[r, b] = self.rng.choice([self.rng.randrange(NB), NB + 1])
        return bt

    def _slot(self, bt, r, p):
        return int(bt[r, p // self.bs]) * self.bs + p % self.bs

    def mutable(self):
        """Tensors the step writes (compared after each checked replay)."""
        raise NotImplementedError

    def snapshot(self):
        return [t.clone() for t in self.mutable()]

    def restore(self, snap):
        for t, s in zip(self.mutable(), snap):
            t.copy_(s)


class DecodeStep(Step):
    def __init__(self, device, fmt, rows=48, nreq=16, max_blocks=24, **kw):
        super().__init__(device, fmt, **kw)
        self.rows, self.nreq_cap, self.max_blocks = rows, nreq, max_blocks
        self.num_pages = nreq * max_blocks
        self.max_context = max_blocks * self.bs
        d = device
        self.cache_a, self.cache_b = self._cache(self.num_pages), self._cache(self.num_pages)
        self.k_a = torch.zeros(rows, self.D, dtype=torch.bfloat16, device=d)
        self.k_b = torch.zeros_like(self.k_a)
        self.slot = torch.full((rows,), -1, dtype=torch.int64, device=d)
        self.q_a = torch.zeros(rows, self.H, self.D, dtype=torch.bfloat16, device=d)
        self.q_b = torch.zeros_like(self.q_a)
        self.w = torch.zeros(rows, self.H, device=d)
        self.lens, self.req = self._i32(rows), self._i32(rows)
        self.bt = self._i32(self.nreq_cap, self.max_blocks)
        self.idx = self._i32(rows, self.topk)
        self.cand = self._i32(rows, self.nbk)
        self.sidx = self._i32(rows, self.topk)
        self.ws_d = torch.zeros(workspace.dense_workspace_bytes(rows, self.max_context), dtype=torch.uint8, device=d)
        self.ws_s = torch.zeros(workspace.sparse_workspace_bytes(rows, self.nbk, self.cbs), dtype=torch.uint8,
                                device=d)

    def mutable(self):
        return [self.cache_a, self.cache_b, self.idx, self.cand, self.sidx]

    def outputs(self):
        return [self.idx, self.cand, self.sidx]

    def refill(self):
        rng, bs = self.rng, self.bs
        nreq = rng.choice([0, 1, self.nreq_cap] + [rng.randint(1, self.nreq_cap)] * 5)
        lens, reqs, slots = [], [], []
        ctx = []
        for r in range(nreq):
            n = rng.choice([1, bs - 1, bs, bs + 1, rng.randint(1, self.max_context), self.max_context])
            ctx.append(n)
        needs = [(n + bs - 1) // bs for n in ctx]
        bt = self._table(nreq, needs)
        for r, n in enumerate(ctx):
            m = min(rng.choice([1, 1, 2, 3]), n, self.rows - len(lens))
            for t in range(m):
                L = n - m + 1 + t
                lens.append(L), reqs.append(r), slots.append(self._slot(bt, r, L - 1))
        while len(lens) < self.rows:  # padded rows: nothing valid, nothing written
            lens.append(0), reqs.append(rng.choice([-1, 0, self.nreq_cap + 3])), slots.append(-1)
        self.bt.copy_(bt)
        self.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        self.req.copy_(torch.tensor(reqs, dtype=torch.int32))
        self.slot.copy_(torch.tensor(slots, dtype=torch.int64))
        for t in (self.k_a, self.k_b, self.q_a, self.q_b, self.w):
            t.normal_(generator=self.gen)
        return sum(1 for x in lens if x > 0)

    def run(self):
        f, cbs = self.fmt, self.cbs
        ops.write_k_cache(self.k_a, self.slot, self.cache_a, f, True)
        ops.write_k_cache(self.k_b, self.slot, self.cache_b, f, True)
        qa, qsa, wa = ops.quantize_q(self.q_a, self.w, f, self.wscale)
        ops.indexer_decode(qa, qsa, self.cache_a, wa, self.lens, self.bt, self.req, self.max_context, self.topk, cbs,
                           self.ws_d, self.idx, self.cand)
        qb, qsb, wb = ops.quantize_q(self.q_b, self.w, f, self.wscale)
        ops.sparse_indexer_decode(qb, qsb, self.cache_b, wb, self.lens, self.bt, self.req, self.cand, cbs, self.topk,
                                  self.ws_s, self.sidx)


class PrefillStep(Step):
    def __init__(self, device, fmt, tokens=192, keys=3072, nreq=6, max_blocks=16, **kw):
        super().__init__(device, fmt, **kw)
        self.tokens, self.keys, self.nreq_cap, self.max_blocks = tokens, keys, nreq, max_blocks
        self.num_pages = nreq * max_blocks
        self.max_context = max_blocks * self.bs
        d = device
        self.cache_a, self.cache_b = self._cache(self.num_pages), self._cache(self.num_pages)
        vb = formats.value_bytes(self.fmt, self.D)
        kdt = formats.FP8_DTYPE if fmt == "fp8" else torch.uint8
        sdt = torch.float32 if fmt == "fp8" else torch.int32
        self.kp_a = torch.zeros(keys, vb, dtype=torch.uint8, device=d).view(kdt)
        self.ks_a = torch.zeros(keys, dtype=sdt, device=d)
        self.kp_b, self.ks_b = torch.zeros_like(self.kp_a), torch.zeros_like(self.ks_a)
        self.k_a = torch.zeros(tokens, self.D, dtype=torch.bfloat16, device=d)
        self.k_b = torch.zeros_like(self.k_a)
        self.slot = torch.full((tokens,), -1, dtype=torch.int64, device=d)
        self.q_a = torch.zeros(tokens, self.H, self.D, dtype=torch.bfloat16, device=d)
        self.q_b = torch.zeros_like(self.q_a)
        self.w = torch.zeros(tokens, self.H, device=d)
        self.bt = self._i32(nreq, max_blocks)
        self.cu = self._i32(nreq + 1)
        self.ks, self.ke = self._i32(tokens), self._i32(tokens)
        self.idx = self._i32(tokens, self.topk)
        self.cand = self._i32(tokens, self.nbk)
        self.sidx = self._i32(tokens, self.topk)
        self.ws_d = torch.zeros(workspace.dense_workspace_bytes(tokens, self.max_context), dtype=torch.uint8,
                                device=d)
        self.ws_s = torch.zeros(workspace.sparse_workspace_bytes(tokens, self.nbk, self.cbs), dtype=torch.uint8,
                                device=d)

    def mutable(self):
        return [self.cache_a, self.cache_b, self.kp_a, self.ks_a, self.kp_b, self.ks_b, self.idx, self.cand, self.sidx]

    def outputs(self):
        return [self.idx, self.cand, self.sidx]

    def refill(self):
        rng, bs = self.rng, self.bs
        nreq = rng.choice([0, 1, self.nreq_cap] + [rng.randint(1, self.nreq_cap)] * 5)
        ctx, qlen = [], []
        keys_left, tok_left = self.keys, self.tokens
        for r in range(nreq):
            n = min(rng.choice([1, bs - 1, bs + 1, rng.randint(1, self.max_context), self.max_context]), keys_left)
            if n <= 0 or tok_left <= 0:
                break
            q = min(rng.choice([1, n, rng.randint(1, n)]), n, tok_left)
            ctx.append(n), qlen.append(q)
            keys_left -= n
            tok_left -= q
        nreq = len(ctx)
        needs = [(n + bs - 1) // bs for n in ctx]
        bt = self._table(nreq, needs)
        cu = [0]
        for n in ctx:
            cu.append(cu[-1] + n)
        cu += [cu[-1]] * (self.nreq_cap + 1 - len(cu))
        ks, ke, slots = [], [], []
        for r, (n, q) in enumerate(zip(ctx, qlen)):
            for j in range(q):
                p = n - q + j
                ks.append(cu[r]), ke.append(cu[r] + p + 1), slots.append(self._slot(bt, r, p))
        pad = self.tokens - len(ks)
        ks += [0] * pad
        ke += [0] * pad
        slots += [-1] * pad
        self.bt.copy_(bt)
        self.cu.copy_(torch.tensor(cu, dtype=torch.int32))
        self.ks.copy_(torch.tensor(ks, dtype=torch.int32))
        self.ke.copy_(torch.tensor(ke, dtype=torch.int32))
        self.slot.copy_(torch.tensor(slots, dtype=torch.int64))
        for t in (self.k_a, self.k_b, self.q_a, self.q_b, self.w):
            t.normal_(generator=self.gen)
        return self.tokens - pad

    def run(self):
        f, cbs = self.fmt, self.cbs
        ops.write_k_cache(self.k_a, self.slot, self.cache_a, f, True)
        ops.write_k_cache(self.k_b, self.slot, self.cache_b, f, True)
        ops.gather_k(self.cache_a, self.bt, self.cu, self.kp_a, self.ks_a, f)
        ops.gather_k(self.cache_b, self.bt, self.cu, self.kp_b, self.ks_b, f)
        qa, qsa, wa = ops.quantize_q(self.q_a, self.w, f, self.wscale)
        ops.indexer_prefill(qa, qsa, self.kp_a, self.ks_a, wa, self.ks, self.ke, self.max_context, self.topk, cbs,
                            self.ws_d, self.idx, self.cand)
        qb, qsb, wb = ops.quantize_q(self.q_b, self.w, f, self.wscale)
        ops.sparse_indexer_prefill(qb, qsb, self.kp_b, self.ks_b, wb, self.ks, self.ke, self.cand, cbs, self.topk,
                                   self.ws_s, self.sidx)


def _bits(t):
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _compare_with_eager(step: Step, snap, i: int):
    """Runs the step eagerly from ``snap`` (the state before replay ``i``), requires every mutable tensor to
    equal the replay's bit for bit, and leaves the replayed state in place."""
    if torch.device(step.dev).type == "cuda":
        torch.cuda.synchronize()
    replayed = [t.clone() for t in step.mutable()]
    step.restore(snap)
    step.run()  # eager, same state, same inputs
    for j, (a, b) in enumerate(zip(replayed, step.mutable())):
        if not torch.equal(_bits(a), _bits(b)):
            n = int((_bits(a) != _bits(b)).sum())
            raise AssertionError(f"replay {i}: mutable tensor {j} differs from eager ({n} bytes)")
    for t, r in zip(step.mutable(), replayed):  # continue from the replayed state
        t.copy_(r)


def stress(step: Step, replays: int, check_every: int = 100, log=None):
    """Capture ``step.run`` once (CUDA) and replay it ``replays`` times with fresh batches; every
    ``check_every`` replays compare with an eager run on the same state. Returns a summary dict."""
    cuda = step.dev != "cpu" and torch.device(step.dev).type == "cuda"
    step.refill()
    graph = None
    if cuda:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile / load every kernel before capture
                step.run()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.run()
        torch.cuda.synchronize()
        mem0 = torch.cuda.memory_allocated()
    checks, rows_total, t0 = 0, 0, time.time()
    for i in range(1, replays + 1):
        rows_total += step.refill()
        if log is not None and i % 2500 == 0:
            log(f"  {i} replays, {time.time() - t0:.1f} s", flush=True)
        check = i % check_every == 0 or i == replays
        if check:
            snap = step.snapshot()
        if graph is not None:
            graph.replay()
        else:
            step.run()
        if check:
            _compare_with_eager(step, snap, i)
            del snap  # the eager run's temporaries died with the helper's frame
            checks += 1
            if cuda:
                torch.cuda.synchronize()
                mem = torch.cuda.memory_allocated()
                assert mem == mem0, f"replay {i}: memory_allocated {mem} != {mem0} after capture"
    if cuda:
        torch.cuda.synchronize()
    return dict(replays=replays, checks=checks, rows=rows_total, seconds=time.time() - t0)


STEPS = {"decode": DecodeStep, "prefill": PrefillStep}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_replay_stress(kind, fmt):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    n = int(os.environ.get("TSI_STRESS_REPLAYS", "500"))
    res = stress(STEPS[kind]("cuda", fmt), n)
    assert res["checks"] >= max(1, n // 100)
    print(f"{kind} {fmt}: {res}")


def main():
    dev = os.environ.get("TSI_STRESS_DEVICE", "cuda")
    n = int(os.environ.get("TSI_STRESS_REPLAYS", "10000" if dev == "cuda" else "30"))
    every = int(os.environ.get("TSI_STRESS_CHECK_EVERY", "100" if dev == "cuda" else "10"))
    fmts = os.environ.get("TSI_STRESS_FMTS", "fp8,mxfp4").split(",")
    if dev == "cuda" and not torch.cuda.is_available():
        print("replay stress: SKIP (no CUDA device)")
        return 2
    failed = 0
    for kind in ("decode", "prefill"):
        for fmt in fmts:
            kw = {} if dev == "cuda" else dict(H=8, D=64, bs=16, topk=16, nbk=4)
            extra = {} if dev == "cuda" else (dict(rows=12, nreq=4, max_blocks=6) if kind == "decode" else
                                              dict(tokens=24, keys=200, nreq=3, max_blocks=6))
            try:
                res = stress(STEPS[kind](dev, fmt, **kw, **extra), n, every, log=print)
                print(f"replay stress {kind} {fmt}: PASS ({res['replays']} replays, {res['checks']} eager checks, "
                      f"{res['rows']} live rows, {res['seconds']:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"replay stress {kind} {fmt}: FAIL: {type(e).__name__}: {e}", flush=True)
    print("replay stress:", "PASS" if not failed else f"FAIL ({failed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
