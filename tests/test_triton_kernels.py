"""Triton kernels (SM90/SM100) against the reference backend on the same quantized inputs.

Every check: ``calc_diff < 1e-5`` with identical ``-inf`` masks (``testing.calc_diff`` asserts them), every
output element written (the output is poisoned with NaN first), and 20 repeated launches bitwise equal.
Cache kernels must be byte-exact. Shapes are drawn fresh each run (seed printed; replay with
``TORCH_SPARSE_INDEXER_SEED``). All tests need a CUDA GPU with triton; they are skipped elsewhere.
"""
from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from torch_sparse_indexer import backends, formats, reference, testing

triton = pytest.importorskip("triton")

# Developer hook: TRITON_INTERPRET=1 TSI_TEST_DEVICE=cpu runs these tests on the CPU through triton's
# interpreter (slow; index arithmetic only: the SM90 asm paths are GPU-only).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("TSI_TEST_DEVICE") == "cpu"
if INTERPRET:
    pytestmark = []
else:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available() or INTERPRET:
    from torch_sparse_indexer.kernels import triton_cache as tc
    from torch_sparse_indexer.kernels import triton_scoring as ts


@pytest.fixture(scope="module", autouse=True)
def _cpu_emulation():
    """Under the interpreter: the Triton kernels as backends for CPU tensors (no top-k library), for this
    module's tests only (other modules in the same process keep the reference backend on the CPU)."""
    if not INTERPRET:
        yield
        return
    with backends.registry_scope():
        testing.register_cpu_emulation()
        yield


DEV = "cpu" if INTERPRET else "cuda"
TOL = 1e-5
REPEATS = 2 if INTERPRET else 20


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()
ops = torch.ops.sparse_indexer


@pytest.fixture(params=["triton", "cuda"])
def paged_backend(request):
    """The paged decode tests run on the Triton kernels and on the CUDA ones (``kernels/cuda_scoring.py``, SM90,
    up to 64 heads), each forced; under the interpreter on CPU tensors the CUDA ones run when the CPU emulation
    build of ``csrc/scoring.cu`` is the loaded scoring library (``test_emulated_kernels.py``)."""
    if request.param == "cuda":
        from torch_sparse_indexer.kernels import cuda_scoring
        if cuda_scoring.emulated():  # TORCH_SPARSE_INDEXER_SCORING_LIB = the CPU emulation build (csrc/emu)
            if DEV != "cpu":
                pytest.skip("the CUDA scoring emulation build takes CPU tensors (TSI_TEST_DEVICE=cpu)")
        elif INTERPRET or not torch.cuda.is_available():
            pytest.skip("the CUDA scoring kernels need the GPU (or their CPU emulation build)")
        elif not cuda_scoring.available():
            pytest.skip(f"CUDA scoring library: {cuda_scoring._LIB.load_error}")
        # its FP8 path too (dispatch sends FP8 to the Triton kernels unless enabled)
        request.getfixturevalue("monkeypatch").setitem(cuda_scoring.CONFIG_OVERRIDES, "fp8", True)
    return request.param


@contextlib.contextmanager
def _paged(backend):
    """Force ``backend``; a call the CUDA kernels decline (e.g. 128 heads, or not SM90) skips the test. Every paged
    op inside must have run on ``backend`` (a backend missing from the registry would silently mean automatic)."""
    with backends.use_backend(backend), backends.record_dispatch() as ran:
        try:
            yield
        except NotImplementedError as e:
            if backend == "cuda":
                pytest.skip(f"cuda backend declines: {e}")
            raise
    paged = [name for op, name in ran if op.startswith("paged")]
    assert paged and all(name == backend for name in paged), f"forced {backend!r}, ran {sorted(set(ran))}"

# (fmt, D, H): every head count the brief names at D = 128 for FP8, a spread elsewhere, kept small so the
# number of distinct compiled variants stays bounded.
CONFIGS = [("fp8", 128, 8), ("fp8", 128, 16), ("fp8", 128, 32), ("fp8", 128, 64), ("fp8", 128, 128),
           ("fp8", 64, 64), ("fp8", 64, 12), ("mxfp4", 128, 8), ("mxfp4", 128, 32), ("mxfp4", 128, 64),
           ("mxfp4", 64, 16), ("mxfp4", 64, 64)]
CFG_IDS = [f"{f}-D{d}-H{h}" for f, d, h in CONFIGS]


def _poisoned(rows, cols, dtype=torch.float32):
    return torch.full((rows, cols), float("nan"), dtype=dtype, device=DEV)


def _mag(op, *args, like):
    """The terms' magnitude of each score of reference ``op(*args)`` (``testing.score_magnitude``), shaped ``like``."""
    return testing.score_magnitude(op, *args, shape=like.shape)


def _check(run, ref_out, dtype=torch.float32, tol=TOL, mag=None):
    """``run(out)`` fills ``out`` (of ``dtype``); compare with the float32 ``ref_out`` (``testing.assert_scores_close``:
    a bf16 ``out`` also within one bf16 ulp everywhere, plus the tensor cores' share of ``mag`` where given) and check
    20 reruns are bitwise equal."""
    out = _poisoned(*ref_out.shape, dtype=dtype)
    run(out)
    _sync()
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} output elements not written"
    testing.assert_scores_close(out, ref_out, tol, mag=mag)
    for _ in range(REPEATS - 1):
        again = _poisoned(*ref_out.shape, dtype=dtype)
        run(again)
        testing.assert_bitwise_equal(again, out)
    return out


def _queries(T, H, D, fmt, gen, wdtype=torch.float32):
    qs = testing.make_queries(T, H, D, fmt, device=DEV, gen=gen)
    return qs.q, qs.q_scale, qs.weights.to(wdtype)


def _paged_case(rng, gen, fmt, D, H, mtp=False, bs=None):
    bs = bs or rng.choice(formats.CACHE_BLOCK_SIZES)
    nreq = rng.randint(1, 5)
    # lengths: 0, 1, exact page multiples, non-multiples of anything
    seq = [rng.choice([0, 1, bs, bs + 1, rng.randint(1, 3 * bs + 7), rng.randint(1, 700)]) for _ in range(nreq)]
    case = testing.make_paged_cache(seq, bs, D, fmt, device=DEV, gen=gen, max_blocks=max(1, max(
        (n + bs - 1) // bs for n in seq)) + rng.randint(0, 2))
    bt = case.block_table.clone()
    if rng.random() < 0.5 and bt.numel() > 1:
        bt.view(-1)[rng.randrange(bt.numel())] = -1  # a hole: those positions score -inf
    if rng.random() < 0.5:
        bt.view(-1)[rng.randrange(bt.numel())] = 10 ** 6  # a page id past the cache: -inf
    lens, reqs = [], []
    for r, n in enumerate(seq):
        m = rng.randint(1, 3) if mtp and n >= 3 else 1
        for t in range(m):
            lens.append(n - m + 1 + t)
            reqs.append(r)
    lens.append(rng.randint(0, 50))
    reqs.append(nreq + 3)  # request index out of range: a row of length 0
    lens.append(-5)
    reqs.append(0)  # negative length: clamped to 0
    R = len(lens)
    return case.kv_cache, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), \
        torch.tensor(reqs, dtype=torch.int32, device=DEV), R, bs, seq


def _sparse_prefill_ref(rng, gen, q, qs, k, ksc, w, ks, ke, max_blocks):
    """Random candidate lists (1 to ``max_blocks`` blocks of a random size, neighbours sharing 80%) for the prefill
    rows ``ks/ke`` over ``k``, and the reference ``sparse_mqa_logits`` on them: ``(cand, cbs, ref)``."""
    N = k.shape[0]
    cbs = rng.choice(formats.CANDIDATE_BLOCK_SIZES)
    nbk = rng.randint(1, max_blocks)
    ns = (ke.clamp(max=N) - ks.clamp(0, N)).clamp(min=0).tolist()
    cand = _candidates(rng, gen, ns, nbk, cbs, neighbour_share=0.8)
    ref = torch.empty(ks.shape[0], nbk * cbs, device=DEV)
    reference.sparse_mqa_logits(q, qs, k, ksc, w, ks, ke, cand, cbs, ref)
    return cand, cbs, ref


def _paged_sparse_ref(rng, gen, q, qs, kv, w, lens, bt, reqs, bs, seq, max_blocks=12):
    """Random candidate lists (1 to ``max_blocks`` blocks of a size dividing ``bs``) for the decode rows of a
    ``_paged_case``, and the reference ``paged_sparse_mqa_logits`` on them: ``(cand, cbs, ref)``."""
    cbs = rng.choice([c for c in formats.CANDIDATE_BLOCK_SIZES if bs % c == 0])
    nbk = rng.randint(1, max_blocks)
    ns = [int(n) if 0 <= int(r) < len(seq) else 0 for n, r in zip(lens.tolist(), reqs.tolist())]
    cand = _candidates(rng, gen, ns, nbk, cbs)
    ref = torch.empty(lens.shape[0], nbk * cbs, device=DEV)
    reference.paged_sparse_mqa_logits(q, qs, kv, w, lens, bt, reqs, cand, cbs, ref)
    return cand, cbs, ref


def _candidates(rng, gen, ns, num_blocks, cbs, neighbour_share=None):
    cand = testing.random_candidates([max(0, n) for n in ns], num_blocks, cbs, gen=gen).to(DEV)
    c = cand.cpu()
    for r in range(c.shape[0]):
        if rng.random() < 0.3:
            c[r, -1] = -1  # padding even where more blocks exist
        if rng.random() < 0.2:
            valid = int((c[r] >= 0).sum())
            if valid < c.shape[1]:
                c[r, valid] = (max(ns[r], 0) + cbs - 1) // cbs + rng.randint(0, 3)  # id past the row: -inf
    if neighbour_share is not None:
        # copy each even row's list onto the next row, then replace a fraction of it (sorted, unique)
        for r in range(0, c.shape[0] - 1, 2 if rng.random() < 0.5 else 1):
            n1 = max(ns[r + 1], 0)
            nb1 = (n1 + cbs - 1) // cbs
            ids = [int(x) for x in c[r] if 0 <= x < nb1]
            pool = [b for b in range(nb1) if b not in ids]
            rng.shuffle(pool)
            for i in range(len(ids)):
                if pool and rng.random() > neighbour_share:
                    ids[i] = pool.pop()
            ids = sorted(set(ids))[: c.shape[1]]
            c[r + 1] = -1
            c[r + 1, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return c.to(DEV)


# ----------------------------------------------------------------------------------------------------
# Decode scoring
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,D,H", CONFIGS, ids=CFG_IDS)
def test_paged_mqa_logits(fmt, D, H, seed, gen, paged_backend):
    rng = random.Random(seed)
    kv, bt, lens, reqs, R, bs, seq = _paged_case(rng, gen, fmt, D, H, mtp=True)
    q, qs, w = _queries(R, H, D, fmt, gen)
    L = max(1, max(seq) + rng.randint(0, 40))
    ref = torch.empty(R, L, device=DEV)
    reference.paged_mqa_logits(q, qs, kv, w, lens, bt, reqs, ref)
    with _paged(paged_backend):
        _check(lambda out: ops.paged_mqa_logits(q, qs, kv, w, lens, bt, reqs, out), ref,
               mag=_mag("paged_mqa_logits", q, qs, kv, w, lens, bt, reqs, like=ref))


# (tokens per tile, warps, stages, loop iterations per program, register cap, CTAs per SM[, tiles per iteration]):
# tiles smaller than a page, a whole page, two tiles per iteration, and few-iteration programs (several programs
# per row), so the page offset and the row tail both vary.
TMA_CONFIGS = [(64, 4, 3, 32, None, None), (128, 4, 2, 3, None, None), (64, 4, 3, 2, None, None, 2)]


@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=["t64", "t128-3tiles", "t64x2-2iters"])
@pytest.mark.parametrize("D,H", [(128, 64), (128, 8), (64, 32)], ids=["D128-H64", "D128-H8", "D64-H32"])
def test_paged_mqa_logits_tma(cfg, D, H, seed, gen, monkeypatch):
    """The FP8 dense decode with its K tiles fetched by TMA (``_dense_decode_tma_kernel``, switched on by
    ``CONFIG_OVERRIDES["dense_tma"]``) against the reference, on every cache block size: pages of fewer than 64
    tokens keep the row kernel, the others take the TMA kernel (checked through ``_dense_tma_config``)."""
    rng = random.Random(seed)
    monkeypatch.setitem(ts.CONFIG_OVERRIDES, "dense_tma", cfg)
    for bs in formats.CACHE_BLOCK_SIZES:
        kv, bt, lens, reqs, R, _, seq = _paged_case(rng, gen, "fp8", D, H, mtp=True, bs=bs)
        q, qs, w = _queries(R, H, D, "fp8", gen)
        L = max(1, max(seq) + rng.randint(0, 40))
        ref = torch.empty(R, L, device=DEV)
        reference.paged_mqa_logits(q, qs, kv, w, lens, bt, reqs, ref)
        assert (ts._dense_tma_config(bs) is not None) == (bs >= 64)
        with _paged("triton"):
            _check(lambda out: ops.paged_mqa_logits(q, qs, kv, w, lens, bt, reqs, out), ref,
                   mag=_mag("paged_mqa_logits", q, qs, kv, w, lens, bt, reqs, like=ref))


@pytest.mark.parametrize("fmt,D,H", CONFIGS, ids=CFG_IDS)
def test_paged_sparse_mqa_logits(fmt, D, H, seed, gen, paged_backend):
    rng = random.Random(seed)
    kv, bt, lens, reqs, R, bs, seq = _paged_case(rng, gen, fmt, D, H, mtp=True)
    q, qs, w = _queries(R, H, D, fmt, gen)
    cand, cbs, ref = _paged_sparse_ref(rng, gen, q, qs, kv, w, lens, bt, reqs, bs, seq)
    with _paged(paged_backend):
        _check(lambda out: ops.paged_sparse_mqa_logits(q, qs, kv, w, lens, bt, reqs, cand, cbs, out), ref,
               mag=_mag("paged_sparse_mqa_logits", q, qs, kv, w, lens, bt, reqs, cand, cbs, like=ref))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_paged_sparse_row_tiles(fmt, seed, gen, monkeypatch):
    """Programs of any tile count (the launcher sizes them to fill whole waves) write the same scores, bitwise."""
    rng = random.Random(seed)
    bs, cbs, H, D = 64, rng.choice([8, 16]), 16, 128
    seq = [rng.randint(600, 1500) for _ in range(2)]
    case = testing.make_paged_cache(seq, bs, D, fmt, device=DEV, gen=gen)
    lens = torch.tensor(seq + [seq[0] - 3], dtype=torch.int32, device=DEV)
    reqs = torch.tensor([0, 1, 0], dtype=torch.int32, device=DEV)
    nbk = 40
    cand = _candidates(rng, gen, lens.tolist(), nbk, cbs)
    q, qs, w = _queries(3, H, D, fmt, gen)
    ref = torch.empty(3, nbk * cbs, device=DEV)
    reference.paged_sparse_mqa_logits(q, qs, case.kv_cache, w, lens, case.block_table, reqs, cand, cbs, ref)
    first = None
    for nt in (1, 3, 7, None):
        if nt is None:
            monkeypatch.delitem(ts.CONFIG_OVERRIDES, "row_tiles", raising=False)
        else:
            monkeypatch.setitem(ts.CONFIG_OVERRIDES, "row_tiles", nt)
        with backends.use_backend("triton"):
            out = _check(lambda o: ops.paged_sparse_mqa_logits(q, qs, case.kv_cache, w, lens, case.block_table, reqs,
                                                               cand, cbs, o), ref,
                         mag=_mag("paged_sparse_mqa_logits", q, qs, case.kv_cache, w, lens, case.block_table, reqs,
                                  cand, cbs, like=ref))
        if first is None:
            first = out
        else:
            testing.assert_bitwise_equal(out, first)


@pytest.mark.parametrize("rows,width,block_n,tiles,slots", [(128, 16384, 128, 32, 396), (128, 16384, 64, 64, 264),
                                                           (7, 3000, 64, 16, 12), (4096, 16384, 128, 32, 660)])
def test_row_tiles_fills_waves(rows, width, block_n, tiles, slots):
    """The chosen tile count never costs more (waves x (tiles + fixed cost)) than the largest, and stays in range."""
    t = ts._row_tiles(rows, width, block_n, tiles, slots)
    assert 1 <= t <= tiles
    tr = -(-width // block_n)

    def cost(n):
        return -(-(rows * -(-tr // n)) // slots) * (n + 1.5)
    assert cost(t) <= cost(tiles)
    assert all(cost(t) <= cost(n) for n in range(min(tiles, 4), tiles + 1))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("layout", ["strided", "misaligned"])
def test_paged_sparse_logits_views(fmt, layout, seed, gen, paged_backend):
    """Logits that are a view into a wider buffer (row stride > width; rows 16-byte or only 4-byte aligned): the
    same scores as the reference, and no element of the buffer outside the view is touched."""
    rng = random.Random(seed)
    D, H = 128, rng.choice([8, 64])
    kv, bt, lens, reqs, R, bs, seq = _paged_case(rng, gen, fmt, D, H)
    cbs = rng.choice([c for c in formats.CANDIDATE_BLOCK_SIZES if bs % c == 0])
    q, qs, w = _queries(R, H, D, fmt, gen)
    nbk = rng.randint(1, 40)
    ns = [int(n) if 0 <= int(r) < len(seq) else 0 for n, r in zip(lens.tolist(), reqs.tolist())]
    cand = _candidates(rng, gen, ns, nbk, cbs)
    L = nbk * cbs
    ref = torch.empty(R, L, device=DEV)
    reference.paged_sparse_mqa_logits(q, qs, kv, w, lens, bt, reqs, cand, cbs, ref)
    lo = 4 if layout == "strided" else 1  # 16-byte vs 4-byte offset; row strides L + 8 vs L + 3
    outs = []
    for _ in range(REPEATS if not INTERPRET else 1):
        buf = torch.full((R, L + lo + (4 if layout == "strided" else 2)), float("nan"), device=DEV)
        out = buf[:, lo:lo + L]
        with _paged(paged_backend):
            ops.paged_sparse_mqa_logits(q, qs, kv, w, lens, bt, reqs, cand, cbs, out)
        _sync()
        assert torch.isnan(buf[:, :lo]).all() and torch.isnan(buf[:, lo + L:]).all(), "wrote outside the view"
        assert not torch.isnan(out).any()
        assert testing.calc_diff(out, ref) < TOL
        outs.append(out.clone())
    for o in outs[1:]:
        testing.assert_bitwise_equal(o, outs[0])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_paged_no_req_indices_bf16(fmt, seed, gen, paged_backend):
    """req_indices None (row r = request r), bf16 weights and bf16 logits."""
    rng = random.Random(seed)
    D, H, bs = 128, 64, 64
    seq = [rng.randint(0, 300) for _ in range(rng.randint(1, 6))]
    case = testing.make_paged_cache(seq, bs, D, fmt, device=DEV, gen=gen)
    R = len(seq)
    lens = torch.tensor(seq, dtype=torch.int32, device=DEV)
    q, qs, w = _queries(R, H, D, fmt, gen, wdtype=torch.bfloat16)
    L = max(seq + [1])
    ref = torch.empty(R, L, device=DEV)
    reference.paged_mqa_logits(q, qs, case.kv_cache, w, lens, case.block_table, None, ref)
    with _paged(paged_backend):
        _check(lambda out: ops.paged_mqa_logits(q, qs, case.kv_cache, w, lens, case.block_table, None, out),
               ref, dtype=torch.bfloat16, mag=_mag("paged_mqa_logits", q, qs, case.kv_cache, w, lens,
                                                   case.block_table, None, like=ref))
    cand = _candidates(rng, gen, seq, 5, 16)
    ref = torch.empty(R, 5 * 16, device=DEV)
    reference.paged_sparse_mqa_logits(q, qs, case.kv_cache, w, lens, case.block_table, None, cand, 16, ref)
    with _paged(paged_backend):
        _check(lambda out: ops.paged_sparse_mqa_logits(q, qs, case.kv_cache, w, lens, case.block_table, None,
                                                       cand, 16, out), ref,
               mag=_mag("paged_sparse_mqa_logits", q, qs, case.kv_cache, w, lens, case.block_table, None, cand, 16,
                        like=ref))


# ----------------------------------------------------------------------------------------------------
# Prefill scoring
# ----------------------------------------------------------------------------------------------------

def _prefill_rows(rng):
    """Requests packed back to back, causal rows, plus edge rows (ks == ke, ks > ke, ke > N, ks < 0)."""
    ks, ke, start = [], [], 0
    for _ in range(rng.randint(1, 4)):
        n = rng.choice([1, 7, 64, 129, rng.randint(1, 600)])
        rows = rng.randint(1, 6)
        for i in range(rows):
            ks.append(start)
            ke.append(start + n - rows + 1 + i if n >= rows else start + n)
        start += n
    N = start + rng.randint(0, 20)
    ks += [5, 30, N - 3, -4]
    ke += [5, 10, N + 100, 17]
    return torch.tensor(ks, dtype=torch.int32, device=DEV), torch.tensor(ke, dtype=torch.int32, device=DEV), N


@pytest.mark.parametrize("fmt,D,H", CONFIGS, ids=CFG_IDS)
def test_mqa_logits(fmt, D, H, seed, gen):
    rng = random.Random(seed)
    ks, ke, N = _prefill_rows(rng)
    T = ks.shape[0]
    k, ksc = testing.make_packed_k(N, D, fmt, device=DEV, gen=gen)
    q, qs, w = _queries(T, H, D, fmt, gen)
    n = (ke.clamp(max=N) - ks.clamp(0, N)).clamp(min=0)
    L = int(n.max()) + rng.randint(0, 33)
    ref = torch.empty(T, L, device=DEV)
    reference.mqa_logits(q, qs, k, ksc, w, ks, ke, ref)
    with backends.use_backend("triton"):
        _check(lambda out: ops.mqa_logits(q, qs, k, ksc, w, ks, ke, out), ref,
               mag=_mag("mqa_logits", q, qs, k, ksc, w, ks, ke, like=ref))


@pytest.mark.parametrize("D", [64, 128])
def test_mxfp4_group_scales_far_apart(D, gen):
    """MXFP4 group scales far apart within one token and within one query head (2^-3 .. 2^+12 and 2^-40,
    and a 2^20 outlier group): every 32-element group keeps its own scale through the product, so small
    groups meeting large ones on the other side still count (a scheme that re-bases a token's groups on a
    shared exponent range, as once tried for SM90, flushes them and fails here)."""
    T, N, H = 6, 300, 16
    x = torch.randn(N, D, generator=gen)
    spread = torch.tensor([2.0 ** -3, 2.0 ** 12, 2.0 ** -40, 1.0])[: D // 32]
    x[: N // 2] = (x[: N // 2].view(N // 2, D // 32, 32) * spread[None, :, None]).view(N // 2, D)
    x[N // 2:: 3, :32] *= 2.0 ** 20
    k, ksc = formats.quantize_rows(x.to(DEV), "mxfp4")
    q = torch.randn(T, H, D, generator=gen)
    q[:, ::2] = (q[:, ::2].view(T, H // 2, D // 32, 32) * spread.flip(0)[None, None, :, None]).view(T, H // 2, D)
    w = torch.randn(T, H, generator=gen) * H ** -0.5
    qv, qs, wf = formats.quantize_q(q.to(DEV), w.to(DEV), "mxfp4")
    ks = torch.zeros(T, dtype=torch.int32, device=DEV)
    ke = torch.full((T,), N, dtype=torch.int32, device=DEV)
    ref = torch.empty(T, N, device=DEV)
    reference.mqa_logits(qv, qs, k, ksc, wf, ks, ke, ref)
    with backends.use_backend("triton"):
        _check(lambda out: ops.mqa_logits(qv, qs, k, ksc, wf, ks, ke, out), ref,
               mag=_mag("mqa_logits", qv, qs, k, ksc, wf, ks, ke, like=ref))


def _pinned_groups(x, exps):
    """Scale each 32-element group of ``x [..., D]`` so its amax is exactly ``6 * 2^exps[g]`` (MXFP4 scale 2^e)."""
    g = x.unflatten(-1, (-1, 32)).clone()
    g = g / g.abs().amax(-1, keepdim=True) * 5.0
    g[..., 0] = 6.0
    return (g * torch.tensor([2.0 ** e for e in exps])[:, None]).flatten(-2)


def _check_mxfp4_decode_rows(case, qv, qs, wf, lens, reqs, dense, nbk, rng, gen, backend):
    """Dense or sparse (``nbk`` candidate blocks of 8) paged decode on ``case`` against the reference: the whole
    output (with reruns), then row by row (rows' magnitudes may differ by orders, a whole-tensor calc_diff hides
    some)."""
    R = qv.shape[0]
    if dense:
        ref = torch.empty(R, max(case.seq_lens), device=DEV)
        reference.paged_mqa_logits(qv, qs, case.kv_cache, wf, lens, case.block_table, reqs, ref)
        run = lambda out: ops.paged_mqa_logits(qv, qs, case.kv_cache, wf, lens, case.block_table, reqs, out)  # noqa: E731
        mag = _mag("paged_mqa_logits", qv, qs, case.kv_cache, wf, lens, case.block_table, reqs, like=ref)
    else:
        cbs = 8
        cand = _candidates(rng, gen, lens.tolist(), nbk, cbs)
        ref = torch.empty(R, nbk * cbs, device=DEV)
        reference.paged_sparse_mqa_logits(qv, qs, case.kv_cache, wf, lens, case.block_table, reqs, cand, cbs, ref)
        run = lambda out: ops.paged_sparse_mqa_logits(qv, qs, case.kv_cache, wf, lens, case.block_table, reqs,  # noqa: E731
                                                      cand, cbs, out)
        mag = _mag("paged_sparse_mqa_logits", qv, qs, case.kv_cache, wf, lens, case.block_table, reqs, cand, cbs,
                   like=ref)
    with _paged(backend):
        _check(run, ref, mag=mag)
        out = _poisoned(*ref.shape)
        run(out)
    for r in range(R):
        diff = testing.calc_diff(out[r], ref[r])
        assert diff < TOL, f"row {r}: calc_diff {diff}"


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_mxfp4_query_scales_fold_or_not(D, dense, seed, gen, paged_backend):
    """Decode rows whose query group scales fold into the operands (groups within 14 binades of the head's
    largest, dead all-zero groups ignored) next to rows that need per-group multiplies (a head spanning 15 or 52
    binades), in one call. K's group 1 is large where the queries' is small, so folding a 15-binade head (its
    half-step codes round off there) fails this test."""
    rng = random.Random(seed)
    G = D // 32
    H, bs = 16, 64
    seq = [300, 129, 64]

    def rows(n):
        # K's group 1 is 2^11 larger (the most that still folds) and its other groups hold one element each, so a
        # tiny query group 1 carries most of a score (a misfold of it shows)
        x = _pinned_groups(torch.randn(n, D, generator=gen), [0, 11, 0, 0][:G]).unflatten(-1, (G, 32))
        x[:, [g for g in range(G) if g != 1], 1:] = 0
        return x.flatten(-2)

    case = testing.make_paged_cache(seq, bs, D, "mxfp4", device=DEV, gen=gen, rows=rows)
    R = 9
    reqs = torch.tensor([r % 3 for r in range(R)], dtype=torch.int32, device=DEV)
    lens = torch.tensor([seq[r % 3] for r in range(R)], dtype=torch.int32, device=DEV)
    spans = {0: [0, -14, -3, -9][:G],  # exactly 14 binades: folds
             1: [0, -15, 0, 0][:G],  # 15: per-group multiplies
             2: [-3, 12, -40, 0][:G]}  # 52
    q = torch.randn(R, H, D, generator=gen)
    for r in range(R):
        kind = r % 4
        if kind in spans:
            q[r] = _pinned_groups(q[r], spans[kind])
            if kind < 2:  # K's lone elements meet zeros: the scores come from group 1, at 14 / 15 binades down
                for g in range(G):
                    if g != 1:
                        q[r, :, 32 * g + 1] = q[r, :, 32 * g]
                        q[r, :, 32 * g] = 0
        else:  # a dead (all-zero) group, its scale 2^-14 the floor's, next to groups of 2^8: folds
            q[r] *= 2.0 ** 8
            q[r, :, 32:64] = 0
    w = torch.randn(R, H, generator=gen) * H ** -0.5
    qv, qs, wf = formats.quantize_q(q.to(DEV), w.to(DEV), "mxfp4")
    _check_mxfp4_decode_rows(case, qv, qs, wf, lens, reqs, dense, 24, rng, gen, paged_backend)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_mxfp4_weights_past_the_folded_range(dense, seed, gen, paged_backend):
    """MXFP4 decode with extreme magnitudes on the fold path: each head's largest query group scale goes into its
    weight (Triton and CUDA kernels), so weights of 1e29 on queries of 2^20 (scores about 1e36, finite) meet folded
    weights near the top of the fp32 range; ordinary rows in the same call; row by row against the reference.
    (A build that multiplied those weights by a further 2^26 -- a relu as a saturating multiply, measured no
    faster -- overflowed them to inf and failed here, H200 run 66.)"""
    rng = random.Random(seed)
    D, H, bs = 128, 16, 64
    seq = [300, 129, 64]
    case = testing.make_paged_cache(seq, bs, D, "mxfp4", device=DEV, gen=gen)
    R = 6
    reqs = torch.tensor([r % 3 for r in range(R)], dtype=torch.int32, device=DEV)
    lens = torch.tensor([seq[r % 3] for r in range(R)], dtype=torch.int32, device=DEV)
    q = torch.randn(R, H, D, generator=gen)
    w = torch.randn(R, H, generator=gen) * H ** -0.5
    q[::2] *= 2.0 ** 20
    w[::2, 3] = 1e29
    qv, qs, wf = formats.quantize_q(q.to(DEV), w.to(DEV), "mxfp4")
    _check_mxfp4_decode_rows(case, qv, qs, wf, lens, reqs, dense, 24, rng, gen, paged_backend)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("odd", ["span12", "zero_group"])
def test_mxfp4_key_scales_fold_or_rescore(D, dense, odd, seed, gen, paged_backend):
    """MXFP4 decode (SM90 path): a program scores its tiles with each token's K group scales folded into the e4m3
    operand, exact while a token's groups span at most 11 binades, and scores its columns again the per-group way
    when some token spans more. Three pages hold tokens spanning 12 binades, or with an all-zero group (scale
    2^-16) next to groups of 2^0 (rescored), the others tokens spanning exactly 11 (the folded path); every page
    is in use, so some programs are rescored and others not. The queries' group sizes mirror the
    11- and 12-binade keys', so each group's products are of one size and a misencoded small K group shows (a
    fold allowed at 12 binades is off by 1e-4); checked row by row against the reference."""
    rng = random.Random(seed)
    G = D // 32
    H, bs = 16, 16
    seq = [70, 45, 33, 50]
    span11 = [0, -11, -5, -2][:G]
    span12 = [0, -12, -3, -7][:G]

    def rows(n):
        x = _pinned_groups(torch.randn(n, D, generator=gen), span11)  # every score of one size
        if odd == "span12":
            x[:3 * bs] = _pinned_groups(x[:3 * bs], span12)
        else:
            x[:3 * bs, 32:64] = 0
        return x

    case = testing.make_paged_cache(seq, bs, D, "mxfp4", device=DEV, gen=gen, spare_blocks=0, rows=rows)
    R = 8
    reqs = torch.tensor([r % 4 for r in range(R)], dtype=torch.int32, device=DEV)
    lens = torch.tensor([seq[r % 4] for r in range(R)], dtype=torch.int32, device=DEV)
    q = torch.randn(R, H, D, generator=gen)
    for r in range(R):
        q[r] = _pinned_groups(q[r], [-e for e in (span11 if r < 4 else span12)])
    w = torch.randn(R, H, generator=gen) * H ** -0.5
    qv, qs, wf = formats.quantize_q(q.to(DEV), w.to(DEV), "mxfp4")
    _check_mxfp4_decode_rows(case, qv, qs, wf, lens, reqs, dense, 10, rng, gen, paged_backend)


@pytest.mark.parametrize("fmt,D,H", CONFIGS, ids=CFG_IDS)
@pytest.mark.parametrize("pair", [True, False], ids=["pair", "rows"])
def test_sparse_mqa_logits(fmt, D, H, pair, seed, gen):
    rng = random.Random(seed)
    ks, ke, N = _prefill_rows(rng)
    T = ks.shape[0]
    k, ksc = testing.make_packed_k(N, D, fmt, device=DEV, gen=gen)
    q, qs, w = _queries(T, H, D, fmt, gen)
    cand, cbs, ref = _sparse_prefill_ref(rng, gen, q, qs, k, ksc, w, ks, ke, 20)
    if H > 64 and pair:
        pytest.skip("pairs are used up to 64 (padded) heads")
    _check(lambda out: ts._launch_prefill_sparse(q, qs, k, ksc, w, ks, ke, cand, cbs, out, pair), ref,
           mag=_mag("sparse_mqa_logits", q, qs, k, ksc, w, ks, ke, cand, cbs, like=ref))


def test_sparse_prefill_out_of_contract_lists(seed, gen):
    """Unsorted / duplicated candidate lists are out of contract, but every slot is still written with
    the score of the block it names (the pair kernel's cover rule), exactly as the reference does."""
    rng = random.Random(seed)
    D, H, fmt, cbs = 128, 64, "fp8", 8
    N = 500
    T = 6
    ks = torch.zeros(T, dtype=torch.int32, device=DEV)
    ke = torch.full((T,), N, dtype=torch.int32, device=DEV)
    k, ksc = testing.make_packed_k(N, D, fmt, device=DEV, gen=gen)
    q, qs, w = _queries(T, H, D, fmt, gen)
    nb = (N + cbs - 1) // cbs
    cand = torch.tensor([[rng.randrange(-1, nb) for _ in range(16)] for _ in range(T)], dtype=torch.int32)
    cand[1, :8] = cand[0, :8]
    cand[3] = cand[2].flip(0)
    cand = cand.to(DEV)
    ref = torch.empty(T, 16 * cbs, device=DEV)
    reference.sparse_mqa_logits(q, qs, k, ksc, w, ks, ke, cand, cbs, ref)
    _check(lambda out: ts._launch_prefill_sparse(q, qs, k, ksc, w, ks, ke, cand, cbs, out, True), ref,
           mag=_mag("sparse_mqa_logits", q, qs, k, ksc, w, ks, ke, cand, cbs, like=ref))


@pytest.mark.parametrize("D", [64, 128])
def test_dot_scaled_path(D, seed, gen, monkeypatch):
    """The SM100 MXFP4 code path (``tl.dot_scaled``) of every scoring kernel (decode dense and sparse, prefill
    dense, sparse rows and pairs), on a GPU before SM100 (where triton emulates the scaled MMA) or under the
    interpreter (CI): checks its index and scale-byte arithmetic, which no SM100 machine has run."""
    monkeypatch.setattr(ts, "_FORCE_DOT_SCALED", True)
    rng = random.Random(seed)
    H, fmt = 32, "mxfp4"
    kv, bt, lens, reqs, R, bs, seq = _paged_case(rng, gen, fmt, D, H)
    q, qs, w = _queries(R, H, D, fmt, gen)
    L = max(seq) + 3
    ref = torch.empty(R, L, device=DEV)
    reference.paged_mqa_logits(q, qs, kv, w, lens, bt, reqs, ref)
    _check(lambda out: ts.paged_mqa_logits(q, qs, kv, w, lens, bt, reqs, out), ref,
           mag=_mag("paged_mqa_logits", q, qs, kv, w, lens, bt, reqs, like=ref))
    ks, ke, N = _prefill_rows(rng)
    T = ks.shape[0]
    k, ksc = testing.make_packed_k(N, D, fmt, device=DEV, gen=gen)
    q, qs, w = _queries(T, H, D, fmt, gen)
    L = int((ke.clamp(max=N) - ks.clamp(0, N)).clamp(min=0).max()) + 1
    ref = torch.empty(T, L, device=DEV)
    reference.mqa_logits(q, qs, k, ksc, w, ks, ke, ref)
    _check(lambda out: ts.mqa_logits(q, qs, k, ksc, w, ks, ke, out), ref,
           mag=_mag("mqa_logits", q, qs, k, ksc, w, ks, ke, like=ref))
    cand, cbs, ref = _sparse_prefill_ref(rng, gen, q, qs, k, ksc, w, ks, ke, 12)
    for pair in (True, False):
        _check(lambda out: ts._launch_prefill_sparse(q, qs, k, ksc, w, ks, ke, cand, cbs, out, pair), ref,
               mag=_mag("sparse_mqa_logits", q, qs, k, ksc, w, ks, ke, cand, cbs, like=ref))
    kv, bt, lens, reqs, R, bs, seq = _paged_case(rng, gen, fmt, D, H)
    q, qs, w = _queries(R, H, D, fmt, gen)
    cand, cbs, ref = _paged_sparse_ref(rng, gen, q, qs, kv, w, lens, bt, reqs, bs, seq)
    _check(lambda out: ts.paged_sparse_mqa_logits(q, qs, kv, w, lens, bt, reqs, cand, cbs, out), ref,
           mag=_mag("paged_sparse_mqa_logits", q, qs, kv, w, lens, bt, reqs, cand, cbs, like=ref))


# ----------------------------------------------------------------------------------------------------
# Cache kernels: byte-exact
# ----------------------------------------------------------------------------------------------------

def test_write_k_cache_mxfp4_rounding_ties():
    """Every e2m1 rounding boundary (0.25, 0.75, ..., 5: ties to even) and its fp32 neighbours, in groups
    whose scale is exactly 2^e (amax 6 * 2^e), so the kernel's bit-level encoder sees the boundary values
    themselves; plus +-6 and zeros of both signs. Bytes equal to the reference's compare-based encoder."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    vals = torch.cat([bounds, torch.nextafter(bounds, torch.full_like(bounds, 10.0)),
                      torch.nextafter(bounds, torch.zeros_like(bounds)), torch.tensor([0.0, -0.0, 6.0])])
    vals = torch.cat([vals, -vals])  # 50 values: two 32-groups per row after padding with zeros
    row = torch.zeros(64)
    row[: vals.numel()] = vals
    row[31] = row[63] = 6.0  # each group's amax: scale 2^0
    x = torch.stack([row * 2.0 ** e for e in (-20, -3, 0, 4)])
    slot = torch.arange(x.shape[0])
    want = torch.zeros(1, 16, formats.bytes_per_token("mxfp4", 64), dtype=torch.uint8)
    reference.write_k_cache(x, slot, want, "mxfp4", True)
    got = torch.zeros_like(want).to(DEV)
    with backends.use_backend("triton"):
        ops.write_k_cache(x.to(DEV), slot.to(DEV), got, "mxfp4", True)
    assert torch.equal(got.cpu(), want), f"{int((got.cpu() != want).sum())} bytes differ"


@pytest.mark.parametrize("D", [64, 128])
def test_mxfp4_bf16_pair_encoder_every_value(D, gen):
    """The bf16-pair MXFP4 encoder (write_k_cache and quantize_q on bf16 input) on every finite bf16 magnitude
    from 0 to 6, both signs, in groups scaled by 2^s (s = -14 .. 119; s = 119 is the largest scale it takes) with
    each group's amax pinned to 6 * 2^s; plus rows it hands to the fp32 encoder (amax above 6 * 2^119, +-inf)
    placed among ordinary rows, and random rows. Bytes equal to the reference's compare-based encoder."""
    mags = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    mags = mags[mags <= 6.0]
    vals = torch.cat([mags, -mags])
    groups = -(-vals.numel() // 31)
    groups = -(-groups // (D // 32)) * (D // 32)
    v = torch.zeros(groups * 31)
    v[: vals.numel()] = vals
    v = torch.cat([v.view(groups, 31), torch.full((groups, 1), 6.0)], 1)
    rows = [(v * 2.0 ** s).view(-1, D) for s in (-14, -3, 0, 7, 100, 119)]
    odd = torch.randn(40, D, generator=gen)
    odd[3, 5] = 2.0 ** 124  # amax over 6 * 2^119: the fp32 encoder
    odd[17, D - 1] = float("inf")
    odd[29, 0] = float("-inf")
    rows += [odd, torch.randn(100, D, generator=gen) * 3]
    x = torch.cat(rows).to(torch.bfloat16)
    T = x.shape[0]
    bs = 64
    nb = -(-T // bs)
    slot = torch.randperm(nb * bs, generator=gen)[:T]
    want = torch.zeros(nb, bs, formats.bytes_per_token("mxfp4", D), dtype=torch.uint8)
    reference.write_k_cache(x, slot, want, "mxfp4", True)
    got = torch.zeros_like(want).to(DEV)
    with backends.use_backend("triton"):
        ops.write_k_cache(x.to(DEV), slot.to(DEV), got, "mxfp4", True)
    assert torch.equal(got.cpu(), want), f"{int((got.cpu() != want).sum())} bytes differ"
    q = x[: T // 4 * 4].view(-1, 4, D)
    qv, qs, _ = tc.quantize_q(q.to(DEV), torch.ones(q.shape[:2], device=DEV), "mxfp4", 1.0)
    rv, rs = formats.quantize_mxfp4_rows(q)
    assert torch.equal(qv.cpu(), rv) and torch.equal(qs.cpu(), rs)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kdtype", [torch.bfloat16, torch.float32, torch.float16])
def test_write_k_cache(fmt, D, kdtype, seed, gen):
    rng = random.Random(seed)
    bs = rng.choice(formats.CACHE_BLOCK_SIZES)
    nb = rng.randint(1, 6)
    T = rng.randint(1, nb * bs)
    x = torch.randn(T, D, generator=gen) * torch.rand(T, 1, generator=gen).mul(8)
    x[0] = 0  # amax floor
    if T > 2:
        x[1, :32] = 1e-6  # a group below the floor
    k = x.to(kdtype).to(DEV)
    slot = torch.randperm(nb * bs, generator=gen)[:T]
    slot[torch.rand(T, generator=gen) < 0.2] = -1
    if T > 3:
        slot[3] = nb * bs + 5  # past the cache: skipped
    sd = rng.choice([torch.int64, torch.int32])
    slot = slot.to(sd).to(DEV)
    for pow2 in ([True, False] if fmt == "fp8" else [True]):
        base = torch.randint(0, 256, (nb, bs, formats.bytes_per_token(fmt, D)), generator=gen,
                             dtype=torch.uint8).to(DEV)
        # Expected bytes from the reference on the CPU: on CUDA, PyTorch divides by a Python scalar as a
        # multiply by its reciprocal (amax * (1/448)), which is not the recipe's division.
        want = base.cpu()
        reference.write_k_cache(k.cpu(), slot.cpu(), want, fmt, pow2)
        want = want.to(DEV)
        got = base.clone()
        with backends.use_backend("triton"):
            ops.write_k_cache(k, slot, got, fmt, pow2)
        assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("gcfg", [None, (64, None)], ids=["default", "batch-sized-chunk"])
def test_gather_k(fmt, D, gcfg, seed, gen, monkeypatch):
    if gcfg is not None:  # the launch variant the benchmark compares (rows per program, request chunk)
        monkeypatch.setitem(tc.CONFIG_OVERRIDES, "gather", gcfg)
    rng = random.Random(seed)
    bs = rng.choice(formats.CACHE_BLOCK_SIZES)
    seq = [rng.randint(0, 3 * bs) for _ in range(rng.randint(1, 5))]
    case = testing.make_paged_cache(seq, bs, D, fmt, device=DEV, gen=gen)
    bt = case.block_table.clone()
    if rng.random() < 0.5 and bt.numel() > 1:
        bt.view(-1)[rng.randrange(bt.numel())] = -1
    cu = torch.tensor([0] + list(torch.tensor(seq).cumsum(0).tolist()), dtype=torch.int32)
    if rng.random() < 0.3 and len(seq) > 1:
        cu[1] = cu[2] + 3  # decreasing offsets (out of contract): cummax rule
    cu = cu.to(DEV)
    N = int(cu.max()) + rng.randint(0, 10)
    vb = formats.value_bytes(fmt, D)
    base_v = torch.randint(0, 256, (N, vb), generator=gen, dtype=torch.uint8).to(DEV)
    base_s = torch.randint(-1000, 1000, (N,), generator=gen, dtype=torch.int32).to(DEV)
    sdt = torch.float32 if fmt == "fp8" else torch.int32

    def fresh():
        v = base_v.clone()
        return (v.view(formats.FP8_DTYPE) if fmt == "fp8" else v), base_s.clone().view(sdt)
    kw, sw = fresh()
    reference.gather_k(case.kv_cache, bt, cu, kw, sw, fmt)
    kg, sg = fresh()
    with backends.use_backend("triton"):
        ops.gather_k(case.kv_cache, bt, cu, kg, sg, fmt)
    assert torch.equal(kg.view(torch.uint8), kw.view(torch.uint8))
    assert torch.equal(sg.view(torch.int32), sw.view(torch.int32))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("D", [64, 128])
def test_quantize_q(fmt, D, seed, gen):
    rng = random.Random(seed)
    T, H = rng.randint(1, 40), rng.choice([4, 8, 12, 64])
    q = (torch.randn(T, H, D, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    w = torch.randn(T, H, generator=gen).to(DEV)
    ws = rng.random() + 0.01
    want = [None if t is None else t.to(DEV) for t in formats.quantize_q(q.cpu(), w.cpu(), fmt, ws)]
    with backends.use_backend("triton"):
        got = ops.quantize_q(q, w, fmt, ws)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        assert torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2])


# ----------------------------------------------------------------------------------------------------
# Graph capture after warmup: no compilation, replays follow new data
# ----------------------------------------------------------------------------------------------------

def _compiled_count(fns=None):
    n = 0
    for fn in fns or (ts._rows_kernel, ts._dense_decode_tma_kernel, ts._prefill_dense_kernel,
                      ts._prefill_pair_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            n += len(cache[0])
    return n


@pytest.mark.parametrize("fmt,tma", [("fp8", False), ("fp8", True), ("mxfp4", False)],
                         ids=["fp8", "fp8-tma", "mxfp4"])
def test_warmup_then_capture(fmt, tma, seed, gen, paged_backend, monkeypatch):
    if INTERPRET:
        pytest.skip("CUDA graphs need the GPU")
    if tma:  # the TMA dense decode: its descriptor goes into the graph by value
        if paged_backend != "triton":
            pytest.skip("the TMA dense decode is a Triton kernel")
        monkeypatch.setitem(ts.CONFIG_OVERRIDES, "dense_tma", TMA_CONFIGS[0])
    D, H, bs, cbs = 128, 64, 64, 8
    ts.warmup(DEV, H, D, fmt, block_size=bs, cbs=cbs, candidate_slots=16)
    before = _compiled_count()
    if tma:
        assert _compiled_count([ts._dense_decode_tma_kernel]) > 0, "warmup did not compile the TMA kernel"
    R, nbk, maxb = 4, 16, 8
    kv = formats.allocate_k_cache(40, bs, D, fmt, DEV)
    bt = torch.zeros(R, maxb, dtype=torch.int32, device=DEV)
    lens = torch.zeros(R, dtype=torch.int32, device=DEV)
    cand = torch.full((R, nbk), -1, dtype=torch.int32, device=DEV)
    q0, qs0, w0 = _queries(R, H, D, fmt, gen)
    q, w = q0.clone(), w0.clone()
    qs = qs0.clone() if qs0 is not None else None
    out_d = torch.empty(R, maxb * bs, device=DEV)
    out_s = torch.empty(R, nbk * cbs, device=DEV)
    g = torch.cuda.CUDAGraph()
    with _paged(paged_backend):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ops.paged_mqa_logits(q, qs, kv, w, lens, bt, None, out_d)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            ops.paged_mqa_logits(q, qs, kv, w, lens, bt, None, out_d)
            ops.paged_sparse_mqa_logits(q, qs, kv, w, lens, bt, None, cand, cbs, out_s)
    for _ in range(2):
        seq = [int(x) for x in torch.randint(0, maxb * bs, (R,), generator=gen)]
        case = testing.make_paged_cache(seq, bs, D, fmt, device=DEV, gen=gen, max_blocks=maxb,
                                        spare_blocks=40 - sum((n + bs - 1) // bs for n in seq))
        kv.copy_(case.kv_cache)
        bt.copy_(case.block_table)
        lens.copy_(torch.tensor(seq, dtype=torch.int32))
        cand.copy_(testing.random_candidates(seq, nbk, cbs, gen=gen))
        qn, qsn, wn = _queries(R, H, D, fmt, gen)
        q.copy_(qn)
        w.copy_(wn)
        if qs is not None:
            qs.copy_(qsn)
        g.replay()
        torch.cuda.synchronize()
        ref_d = torch.empty_like(out_d)
        reference.paged_mqa_logits(q, qs, kv, w, lens, bt, None, ref_d)
        ref_s = torch.empty_like(out_s)
        reference.paged_sparse_mqa_logits(q, qs, kv, w, lens, bt, None, cand, cbs, ref_s)
        assert testing.calc_diff(out_d, ref_d) < TOL
        assert testing.calc_diff(out_s, ref_s) < TOL
    assert _compiled_count() == before, "a kernel compiled after warmup"


# ----------------------------------------------------------------------------------------------------
# Against DeepGEMM 2.8.2's dense SM90 kernels (FP8, H 32/64, page 64), when it is importable
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H", [32, 64])
def test_against_deepgemm(H, seed, gen):
    dg = pytest.importorskip("deep_gemm")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("DeepGEMM's FP8 (fp32-scale) path is the SM90 one")
    rng = random.Random(seed)
    D, bs = 128, 64
    # prefill, one request, causal rows
    S, T = rng.randint(300, 2000), rng.randint(2, 64)
    k, ksc = testing.make_packed_k(S, D, "fp8", device=DEV, gen=gen, pow2_scale=False)
    q, _, w = _queries(T, H, D, "fp8", gen)
    ks = torch.zeros(T, dtype=torch.int32, device=DEV)
    ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32, device=DEV)
    mine = torch.empty(T, S, device=DEV)
    ts.mqa_logits(q, None, k, ksc, w, ks, ke, mine)
    theirs = dg.fp8_fp4_mqa_logits((q, None), (k, ksc), w, ks, ke, S)
    valid = torch.arange(S, device=DEV)[None, :] < (ke - ks)[:, None]
    assert testing.calc_diff(mine.masked_fill(~valid, 0), theirs.float().masked_fill(~valid, 0)) < TOL
    # decode
    B = rng.randint(1, 16)
    seq = [rng.randint(1, 3000) for _ in range(B)]
    case = testing.make_paged_cache(seq, bs, D, "fp8", device=DEV, gen=gen)
    lens = torch.tensor(seq, dtype=torch.int32, device=DEV)
    q, _, w = _queries(B, H, D, "fp8", gen)
    L = triton.cdiv(max(seq), bs) * bs
    mine = torch.empty(B, L, device=DEV)
    ts.paged_mqa_logits(q, None, case.kv_cache, w, lens, case.block_table, None, mine)
    meta = dg.get_paged_mqa_logits_metadata(lens.view(B, 1), bs, torch.cuda.get_device_properties(0).multi_processor_count)
    theirs = dg.fp8_fp4_paged_mqa_logits((q.view(B, 1, H, D), None), case.kv_cache.view(-1, bs, 1, D + 4), w,
                                         lens.view(B, 1), case.block_table, meta, L)
    valid = torch.arange(L, device=DEV)[None, :] < lens[:, None]
    assert testing.calc_diff(mine.masked_fill(~valid, 0), theirs.float().masked_fill(~valid, 0)) < TOL
