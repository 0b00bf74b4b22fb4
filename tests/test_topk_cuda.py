"""CUDA top-k kernels (``csrc/topk.cu``) against ``reference.py`` run on the same tensors: exact equality.

Covers every path the kernels choose per row (shared-memory rows, streamed rows with a buffered threshold
bin, streamed rows whose threshold bin overflows the buffer and is rescanned, rows split over a cluster of
CTAs, each cluster-width case also forced onto the one-CTA path; streamed rows with and without the sampled
threshold; dense rows on the wide-CTA kernels; shared-memory rows on the three-CTA kernel), ties, NaN / -inf rows,
out-of-range lengths, padded and misaligned rows, bitwise repeatability and CUDA-graph replay. The shapes
aim at each path through the thresholds the library exports (``cuda_topk.tuning()``).

Developer hook: ``TSI_TOPK_EMU=/path/to/emulator.so`` runs the same tests on the CPU against a CPU
emulation build of the kernels (``csrc/emu/build_emu.sh``; logic only, with smaller tuning constants so
small shapes reach every path). GPU-only tests (graphs, dispatch) are skipped there.
"""
from __future__ import annotations

import os

import pytest
import torch

from torch_sparse_indexer import backends, reference, testing
from torch_sparse_indexer.kernels import cuda_topk as ct

EMU = os.environ.get("TSI_TOPK_EMU")
if EMU:
    ct.load(EMU)
    DEV = "cpu"
    pytestmark = []
else:
    DEV = "cuda"
    pytestmark = [pytest.mark.gpu,
                  pytest.mark.skipif(not (torch.cuda.is_available() and ct.available()),
                                     reason="needs a CUDA GPU and the built top-k library")]

_T = ct.tuning() or {"smem_keys": 24576, "cand_cap": 8192, "cluster_max": 8}
SMEM_KEYS, CAND_CAP, CLUSTER_MAX = _T["smem_keys"], _T["cand_cap"], _T["cluster_max"]
MAXK = ct.max_k() or 4096
gpu_only = pytest.mark.skipif(bool(EMU), reason="needs a real GPU")

# Widths: shared-memory rows, just past the shared-memory limit, long streamed rows; odd sizes on purpose.
# topk rows of SMEM_KEYS < W <= CLUSTER_MAX * SMEM_KEYS go to the cluster kernel unless cluster mode is off
# (the `cluster` parameter runs them through the one-CTA streamed path too).
W_SMALL, W_SMEM = 1000, SMEM_KEYS - 1
W_STREAM = max(CLUSTER_MAX * SMEM_KEYS + 5, 131072 + 5 if not EMU else 20003)
W_CLUSTER = 3 * SMEM_KEYS + 7  # four slices, the last one partial
W_BITMAP = 32 * MAXK  # the longest rows whose sampled pass buffers in any order (bitmap output)
WIDTHS = [W_SMALL, 4097, W_SMEM, SMEM_KEYS + 3, W_STREAM]
KS = sorted({min(k, MAXK) for k in (1, 7, 512, 1024, 2048, 4096)})


@pytest.fixture(params=["always", "off"], ids=["cluster", "one_cta"])
def cluster(request):
    """Runs a topk test with every cluster-width row on the cluster kernel, then with none."""
    prev = ct.set_cluster_mode(request.param)
    yield request.param
    ct.set_cluster_mode(prev)


@pytest.fixture(params=[True, False], ids=["sampled", "two_pass"])
def sampled(request):
    """Runs a test with streamed rows trying the sampled threshold first (the default), then with the
    two-pass path only. Both must give the reference's exact output."""
    prev = ct.set_sampled(request.param)
    yield request.param
    ct.set_sampled(prev)


@pytest.fixture(autouse=True)
def _split_off(request):
    """Split mode off, so that each test reaches the path it aims at (on a GPU, "auto" would take every small
    batch of streamed rows), except in the tests that ask for it (the ``split`` fixture, test_topk_split_mode)."""
    if "split" in request.fixturenames or request.node.name.startswith("test_topk_split_mode"):
        yield
        return
    prev = ct.set_split_mode("off")
    yield
    ct.set_split_mode(prev)


@pytest.fixture(params=["2", "4", "8"], ids=lambda m: f"split{m}")
def split(request):
    """Every dense topk launch of streamed-width rows on the split kernel, with 2, 4 and 8 CTAs per row."""
    prev = ct.set_split_mode(request.param)
    yield int(request.param)
    ct.set_split_mode(prev)


@pytest.fixture
def cluster_always():
    prev = ct.set_cluster_mode("always")
    yield
    ct.set_cluster_mode(prev)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _lengths(W, k, gen, extra_rows=3):
    """Edge lengths (0, 1, k - 1, k, k + 1, full, out of range on both sides) plus random ones."""
    base = [W, 0, 1, k - 1, k, k + 1, -3, W + 100, W - 1]
    base += torch.randint(0, W + 1, (extra_rows,), generator=gen).tolist()
    return torch.tensor(base, dtype=torch.int32).clamp(min=-3)


def _run_topk(x, lens, k):
    a = torch.full((x.shape[0], k), -7, dtype=torch.int32, device=x.device)
    b = torch.full((x.shape[0], k), -9, dtype=torch.int32, device=x.device)
    ct.topk(x, lens, k, a)
    reference.topk(x, lens, k, b)
    _sync()
    return a, b


def _assert_same(a, b, what):
    if not torch.equal(a, b):
        bad = (a != b).any(1).nonzero().flatten().tolist()
        r = bad[0]
        col = int((a[r] != b[r]).nonzero()[0])
        raise AssertionError(f"{what}: rows {bad[:8]} differ; row {r} from column {col}: "
                             f"got {a[r, col:col + 8].tolist()} expected {b[r, col:col + 8].tolist()}")


def _pattern(name, R, W, gen):
    """Score rows with the structures that break selection kernels."""
    if name == "randn":
        return torch.randn(R, W, generator=gen)
    if name == "all_equal":
        return torch.ones(R, W)
    if name == "signed_zeros":  # -0.0 and +0.0 must tie
        return torch.where(torch.rand(R, W, generator=gen) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
    if name == "few_values":  # massive ties around any threshold
        return torch.randint(0, 5, (R, W), generator=gen).float()
    if name == "threshold_ties":  # a few clear winners, then a flood of equal values at the threshold
        x = torch.full((R, W), 0.5)
        x[:, ::97] = 2.0 + torch.rand(R, (W + 96) // 97, generator=gen)
        return x
    if name == "one_bin":  # ReLU-weighted-sum-like rows: every value in [1, 1.245), one coarse bin
        return 1 + 0.245 * torch.rand(R, W, generator=gen)
    if name == "neg_inf":
        return torch.full((R, W), float("-inf"))
    if name == "nan":
        return torch.full((R, W), float("nan"))
    if name == "specials":  # NaN below -inf below finite; +inf on top
        x = torch.randn(R, W, generator=gen)
        u = torch.rand(R, W, generator=gen)
        x[u < 0.3] = float("nan")
        x[(u >= 0.3) & (u < 0.6)] = float("-inf")
        x[u > 0.999] = float("inf")
        return x
    if name == "nan_neginf":  # only NaN and -inf: -inf must win
        u = torch.rand(R, W, generator=gen)
        return torch.where(u < 0.7, torch.tensor(float("nan")), torch.tensor(float("-inf")))
    if name == "denormals":
        return torch.randn(R, W, generator=gen) * 1e-42
    if name == "ascending":  # every new element beats the previous ones
        return torch.arange(W, dtype=torch.float32).expand(R, W).contiguous()
    if name == "log_uniform":  # magnitudes over 2^-60 .. 2^60: a few elements per 11-bit bin, so more than k
        # of the sampled pass's candidates lie above the sample threshold's bin (its top-level fallback)
        mag = torch.exp2(torch.rand(R, W, generator=gen) * 120 - 60)
        return torch.where(torch.rand(R, W, generator=gen) < 0.5, -mag, mag)
    raise ValueError(name)


PATTERNS = ["randn", "all_equal", "signed_zeros", "few_values", "threshold_ties", "one_bin", "neg_inf", "nan",
            "specials", "nan_neginf", "denormals", "ascending", "log_uniform"]


# ----------------------------------------------------------------------------------------------------
# topk
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("k", KS)
def test_topk_random(dtype, W, k, gen, cluster):
    lens = _lengths(W, k, gen).to(DEV)
    x = torch.randn(lens.shape[0], W, generator=gen).to(dtype).to(DEV)
    a, b = _run_topk(x, lens, k)
    _assert_same(a, b, f"topk {dtype} W={W} k={k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("W", [W_SMEM, W_CLUSTER, W_BITMAP, W_BITMAP + 1, W_STREAM])
def test_topk_patterns(dtype, pattern, W, gen, sampled):
    for k in sorted({1, min(100, MAXK), min(2048, MAXK), MAXK}):
        lens = _lengths(W, k, gen, extra_rows=1).to(DEV)
        x = _pattern(pattern, lens.shape[0], W, gen).to(dtype).to(DEV)
        a, b = _run_topk(x, lens, k)
        _assert_same(a, b, f"topk {pattern} {dtype} W={W} k={k}")


@pytest.mark.parametrize("pattern", ["randn", "one_bin", "few_values"])
def test_topk_overflowing_threshold_bin(pattern, gen, cluster, sampled):
    """Threshold bins far larger than the kernel's buffer must be rescanned, never truncated."""
    W = 8 * CAND_CAP + 13
    k = MAXK
    x = _pattern(pattern, 4, W, gen).to(DEV)
    lens = torch.tensor([W, W - 5, 4 * CAND_CAP, k + 1], dtype=torch.int32, device=DEV)
    a, b = _run_topk(x, lens, k)
    _assert_same(a, b, f"overflow {pattern}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_1m_columns(dtype, gen, sampled):
    W = (1 << 20) if not EMU else (1 << 16)
    x = torch.randn(3, W, generator=gen)
    x[1] = 1 + 0.245 * torch.rand(W, generator=gen)
    x[2] = torch.randint(0, 3, (W,), generator=gen).float()
    x = x.to(dtype).to(DEV)
    lens = torch.tensor([W, W - 1, W // 2 + 7], dtype=torch.int32, device=DEV)
    for k in sorted({min(2048, MAXK), MAXK}):
        a, b = _run_topk(x, lens, k)
        _assert_same(a, b, f"1M {dtype} k={k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset,pad", [(0, 0), (0, 3), (1, 5), (3, 0), (2, 64)])
@pytest.mark.parametrize("W", [W_SMALL + 1, W_CLUSTER, W_STREAM])
def test_topk_strided_rows(dtype, offset, pad, W, gen):
    """Padded row strides and misaligned row starts (views into a wider buffer)."""
    k = min(512, MAXK)
    R = 5
    buf = torch.randn(R, W + offset + pad, generator=gen).to(dtype).to(DEV)
    x = buf[:, offset:offset + W]
    lens = torch.tensor([W, W - 3, k + 2, 17, W // 3], dtype=torch.int32, device=DEV)
    a, b = _run_topk(x, lens, k)
    _assert_same(a, b, f"strided {dtype} offset={offset} pad={pad} W={W}")


@pytest.mark.parametrize("W", [SMEM_KEYS + 1, W_CLUSTER, CLUSTER_MAX * SMEM_KEYS])
@pytest.mark.parametrize("pattern", ["randn", "all_equal", "threshold_ties", "few_values", "specials", "ascending"])
def test_topk_cluster_slices(W, pattern, gen, cluster_always):
    """The cluster kernel's seams: rows ending inside each slice (later slices empty), ties spread over
    several slices (the lowest positions win across slice boundaries), k larger than a slice's winners,
    and the same rows through the one-CTA path give the same bits."""
    C = -(-W // SMEM_KEYS)
    S = (-(-W // C) + 15) // 16 * 16  # the library's slice width
    lens = [W, W - 1, S, S + 1, 2 * S - 3, S - 1, -1, W + 9]
    for k in sorted({1, min(100, MAXK), min(S + 5, MAXK), MAXK}):
        x = _pattern(pattern, len(lens), W, gen).to(DEV)
        ln = torch.tensor(lens, dtype=torch.int32, device=DEV)
        a, b = _run_topk(x, ln, k)
        _assert_same(a, b, f"cluster {pattern} W={W} k={k}")
        ct.set_cluster_mode("off")
        try:
            c, _ = _run_topk(x, ln, k)
        finally:
            ct.set_cluster_mode("always")
        testing.assert_bitwise_equal(c, a)


def _skewed_rows(skew, W, gen):
    """Four rows of W columns and their lengths whose sample (tiles spread over the row) misjudges the threshold:
    see test_topk_unrepresentative_sample."""
    x = torch.randn(4, W, generator=gen)
    lens = torch.tensor([W, W - 17, W // 2 + 3, SMEM_KEYS + 9], dtype=torch.int32)
    if skew == "ascending":
        x = x * 0.01 + torch.linspace(0, 100, W)
    elif skew == "descending":
        x = x * 0.01 + torch.linspace(100, 0, W)
    elif skew == "hot_quarter":  # the sample's first tile lies around W / 4
        x[:, W // 4 - W // 64: W // 4 + W // 64] += 50
    elif skew == "hot_sparse":  # a few huge winners outside the sample, the sample sees none of them
        x[:, 7::1013] += 100
    elif skew == "hot_few":  # before the first sampled tile (around W / 4)
        x[:, 5:5 + 37 * 20:37] += 100
    else:  # most sampled columns past the row's length
        lens = torch.tensor([W // 5, W // 3, SMEM_KEYS + 1, W // 4 + 1], dtype=torch.int32)
    return x, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skew", ["ascending", "descending", "hot_quarter", "hot_sparse", "hot_few", "lengths"])
@pytest.mark.parametrize("W", [W_SMEM, W_BITMAP, W_STREAM])
def test_topk_unrepresentative_sample(dtype, skew, W, gen, sampled):
    """Streamed rows whose sample (tiles spread over the row) misjudges the threshold: far too low (more
    than cand_cap elements above it: the pass stops and the two-pass path runs), far too high (fewer
    than k above it), or drawn from mostly invalid columns; rows on both sides of the bitmap limit, and
    shared-memory rows, which never sample. hot_few: 20 winners far above everything the sample saw, so that
    the buffer's key range (which its first digit spans) is ~50x the bulk's: for k <= 20 the k-th best is one
    of the winners, for k = 21 the best of the bulk, a few wide bins below them. Exact either way."""
    x, lens = _skewed_rows(skew, W, gen)
    ks = {1, 7, 20, 21} if skew == "hot_few" else set()
    for k in sorted(ks | {1, min(512, MAXK), min(2048, MAXK), MAXK}):
        a, b = _run_topk(x.to(dtype).to(DEV), lens.to(DEV), k)
        _assert_same(a, b, f"unrepresentative sample {skew} {dtype} k={k}")


@pytest.fixture
def wide_always():
    """Every dense topk launch on the wide-CTA kernel (cluster-width rows too: the cluster kernel off)."""
    prev, prev_c = ct.set_wide_mode("always"), ct.set_cluster_mode("off")
    yield
    ct.set_wide_mode(prev)
    ct.set_cluster_mode(prev_c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", WIDTHS + [W_BITMAP + 1])
def test_topk_wide(dtype, W, gen, sampled, wide_always):
    """The wide-CTA instantiation (tuning()["wide_threads"] threads per row; decode batches in "auto" mode) on
    every row path: shared-memory rows, streamed rows sampled (buffered in any order up to W_BITMAP, ordered
    past it) and two-pass."""
    for k in sorted({1, 7, min(2048, MAXK), MAXK}):
        lens = _lengths(W, k, gen).to(DEV)
        x = torch.randn(lens.shape[0], W, generator=gen).to(dtype).to(DEV)
        a, b = _run_topk(x, lens, k)
        _assert_same(a, b, f"wide topk {dtype} W={W} k={k}")


@pytest.mark.parametrize("pattern", ["threshold_ties", "few_values", "one_bin", "specials", "nan_neginf", "ascending",
                                     "log_uniform"])
@pytest.mark.parametrize("W", [W_SMEM, W_BITMAP, W_STREAM])
def test_topk_wide_patterns(pattern, W, gen, sampled, wide_always):
    for k in sorted({1, min(100, MAXK), min(2048, MAXK), MAXK}):
        lens = _lengths(W, k, gen, extra_rows=1).to(DEV)
        x = _pattern(pattern, lens.shape[0], W, gen).to(DEV)
        a, b = _run_topk(x, lens, k)
        _assert_same(a, b, f"wide topk {pattern} W={W} k={k}")


def _same_as_one_cta(x, lens, k, got):
    """The same rows with split mode off give the same bits."""
    prev = ct.set_split_mode("off")
    try:
        again, _ = _run_topk(x, lens, k)
    finally:
        ct.set_split_mode(prev)
    testing.assert_bitwise_equal(again, got)


def _split_slice(W, C):
    return ((-(-W // C)) + 31) // 32 * 32  # the library's slice width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [SMEM_KEYS + 3, W_CLUSTER, W_BITMAP, W_BITMAP + 1, W_STREAM])
def test_topk_split(dtype, W, gen, split, sampled):
    """The split kernel (a cluster of CTAs per row, each streaming its slice after a shared sample's threshold)
    on random rows with edge lengths, rows buffered in any order (up to W_BITMAP) and in index order (past it)."""
    for k in sorted({1, 7, min(2048, MAXK), MAXK}):
        lens = _lengths(W, k, gen).to(DEV)
        x = torch.randn(lens.shape[0], W, generator=gen).to(dtype).to(DEV)
        a, b = _run_topk(x, lens, k)
        _assert_same(a, b, f"split{split} topk {dtype} W={W} k={k}")
        _same_as_one_cta(x, lens, k, a)


@pytest.mark.parametrize("pattern", ["randn", "all_equal", "threshold_ties", "few_values", "one_bin", "specials",
                                     "nan_neginf", "ascending", "log_uniform"])
@pytest.mark.parametrize("W", [W_BITMAP, W_STREAM])
def test_topk_split_seams(pattern, W, gen, split):
    """Rows ending inside each slice (later CTAs buffer nothing), ties spread over several slices (the lowest
    positions win across slice boundaries), candidates piling up in one slice (ascending), and rows whose
    buffers overflow or hold fewer than k (massive ties: rank 0 selects the row alone)."""
    S = _split_slice(W, split)
    lens = torch.tensor([W, W - 1, S, S + 1, 2 * S - 3, S - 1, -1, W + 9, SMEM_KEYS + 1], dtype=torch.int32)
    for k in sorted({1, min(100, MAXK), min(2048, MAXK), MAXK}):
        x = _pattern(pattern, lens.shape[0], W, gen).to(DEV)
        a, b = _run_topk(x, lens.to(DEV), k)
        _assert_same(a, b, f"split{split} {pattern} W={W} k={k}")
        _same_as_one_cta(x, lens.to(DEV), k, a)


@pytest.mark.parametrize("skew", ["ascending", "descending", "hot_quarter", "hot_sparse", "hot_few", "lengths"])
def test_topk_split_unrepresentative_sample(skew, gen, split):
    """Samples that misjudge the threshold (as test_topk_unrepresentative_sample): far too low (some CTA's buffer
    overflows), far too high (fewer than k in all buffers together), drawn from columns past the row's length."""
    x, lens = _skewed_rows(skew, W_BITMAP, gen)
    for k in sorted({1, 20, 21, min(512, MAXK), MAXK}):
        a, b = _run_topk(x.to(DEV), lens.to(DEV), k)
        _assert_same(a, b, f"split{split} unrepresentative sample {skew} k={k}")


def _each_mode(set_mode, modes, gen, launches=None):
    """One row of W_STREAM columns through every mode of a path switch (set_mode: a cuda_topk setter), each checked
    against the reference; returns {mode: output} and, with ``launches`` (a launch counter), {mode: whether the
    call launched that kernel}. Restores the mode it found."""
    W, k = W_STREAM, min(2048, MAXK)
    x = torch.randn(1, W, generator=gen).to(DEV)
    lens = torch.tensor([W - 11], dtype=torch.int32, device=DEV)
    prev = set_mode(modes[0])
    outs, ran = {}, {}
    try:
        for mode in modes:
            assert set_mode(mode) in modes
            n0 = launches() if launches else 0
            outs[mode], ref = _run_topk(x, lens, k)
            _assert_same(outs[mode], ref, f"mode {mode}")
            ran[mode] = launches() > n0 if launches else None
    finally:
        set_mode(prev)
    return prev, outs, ran


def test_topk_split_mode(gen):
    """Every mode gives the same bits, each forced size reaches the split kernel, "off" never does, and on a GPU
    "auto" (the default) splits one row, but not a batch of as many rows as SMs."""
    with pytest.raises(ValueError, match="mode"):
        ct.set_split_mode("16")
    prev, outs, ran = _each_mode(ct.set_split_mode, ct.SPLIT_MODES, gen, ct.split_launches)
    assert prev == "auto"
    for mode in ct.SPLIT_MODES:
        testing.assert_bitwise_equal(outs[mode], outs["off"])
        if mode != "auto":
            assert ran[mode] == (mode != "off"), mode
    assert ran["auto"] or EMU, "auto: one row of a long width on a GPU"
    R = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else int(
        os.environ.get("TSI_EMU_SMS", "2"))
    n0 = ct.split_launches()
    _run_topk(torch.randn(R, W_STREAM, generator=gen).to(DEV),
              torch.full((R,), W_STREAM, dtype=torch.int32, device=DEV), min(2048, MAXK))
    assert ct.split_launches() == n0, "auto: a batch of SMs rows"


def test_topk_wide_mode(gen):
    """"auto" (the default) takes the wide kernel for streamed rows of small batches (one row here: also in the
    emulation, which reports two SMs); every mode gives the same bits."""
    with pytest.raises(ValueError, match="mode"):
        ct.set_wide_mode("on")
    prev, outs, _ = _each_mode(ct.set_wide_mode, ct.WIDE_MODES, gen)
    assert prev == "auto"
    testing.assert_bitwise_equal(outs["auto"], outs["off"])


def test_topk_empty_and_tiny(gen):
    for R, W, k in [(0, 10, 5), (3, 0, 5), (2, 1, 1), (4, 3, MAXK)]:
        x = torch.randn(R, W, generator=gen).to(DEV)
        lens = torch.randint(-1, W + 2, (R,), generator=gen, dtype=torch.int32).to(DEV)
        a, b = _run_topk(x, lens, k)
        _assert_same(a, b, f"tiny R={R} W={W} k={k}")


# ----------------------------------------------------------------------------------------------------
# sparse_topk
# ----------------------------------------------------------------------------------------------------

def _sparse_case(R, nb, cbs, gen, holes=False):
    """Lengths, candidate blocks (contract: ascending valid ids, -1 padding; ``holes`` adds -1 entries
    between valid ones), and logits whose invalid columns hold large garbage (must be ignored)."""
    width = nb * cbs
    max_pos = 4 * width
    lens = torch.randint(0, max_pos + 1, (R,), generator=gen).tolist()
    lens[0] = max_pos
    lens[1 % R] = 0
    lens[2 % R] = 5
    blocks = testing.random_candidates(lens, nb, cbs, gen=gen)
    if holes:
        drop = torch.rand(blocks.shape, generator=gen) < 0.2
        blocks = torch.where(drop, torch.full_like(blocks, -1), blocks)
    x = torch.randn(R, width, generator=gen)
    garbage = 10 + torch.rand(R, width, generator=gen)
    pos, valid = reference._sparse_positions(blocks, cbs, torch.tensor(lens).clamp(min=0))
    x = torch.where(valid, x, garbage)
    return x, blocks, torch.tensor(lens, dtype=torch.int32)


def _run_sparse(x, blocks, cbs, lens, k):
    a = torch.full((x.shape[0], k), -7, dtype=torch.int32, device=x.device)
    b = torch.full((x.shape[0], k), -9, dtype=torch.int32, device=x.device)
    ct.sparse_topk(x, blocks, cbs, lens, k, a)
    reference.sparse_topk(x, blocks, cbs, lens, k, b)
    _sync()
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cbs", [8, 16, 32, 64])
@pytest.mark.parametrize("nb_width", [W_SMALL, W_SMEM, W_STREAM])
@pytest.mark.parametrize("holes", [False, True])
def test_sparse_topk(dtype, cbs, nb_width, holes, gen):
    nb = max(1, nb_width // cbs)
    x, blocks, lens = _sparse_case(6, nb, cbs, gen, holes)
    for k in sorted({1, min(64, MAXK), min(2048, MAXK)}):
        a, b = _run_sparse(x.to(dtype).to(DEV), blocks.to(DEV), cbs, lens.to(DEV), k)
        _assert_same(a, b, f"sparse {dtype} cbs={cbs} nb={nb} k={k} holes={holes}")


@pytest.mark.parametrize("cbs", [8, 64])
@pytest.mark.parametrize("garbage", ["neg_inf", "one_value", "spread", "nan"])
def test_sparse_topk_invalid_columns(cbs, garbage, gen):
    """Shared-memory rows whose candidate lists are mostly -1 (short contexts), with -1 holes and a partial last
    block: their invalid columns must stay out of the coarse histogram exactly. In whole-row loads, scores all in one
    bin (-inf, as the scorer writes; one value; NaN, whose key is in bin 0) take the merged decrements (per run,
    then one atomic per warp); spread over many bins, the per-run and per-lane ones."""
    nb = W_SMEM // cbs
    width = nb * cbs
    # valid columns between ~k and the whole row, lengths not multiples of cbs (the cut block). Rows 0 and 8 are
    # requests at least as long as the row whose lists end in a valid block (8 with 60% -1 holes), row 9 a long
    # request whose list ends in -1: the async load takes rows 0, 8 and 9 whole (then decrements) and copies only
    # the valid chunks of the others (requests shorter than the row; benchmarks/variants/wholerow.patch loads all
    # rows whole).
    lens = [width, width - 3, width // 2 + 5, width // 3 + 1, width // 4 + 7, 200 + 3, 130, 70, width, 2 * width]
    R = len(lens)
    blocks = testing.random_candidates(lens, nb, cbs, gen=gen)
    drop = (torch.rand(blocks.shape, generator=gen) < 0.15) & (torch.arange(nb) % 5 != 0)
    drop[0, -1] = False
    drop[8] = torch.rand(nb, generator=gen) < 0.6
    drop[8, -1] = False
    drop[9, -1] = True
    blocks = torch.where(drop, torch.full_like(blocks, -1), blocks)
    lens = torch.tensor(lens, dtype=torch.int32)
    _, valid = reference._sparse_positions(blocks, cbs, lens.long())
    bad = {"neg_inf": torch.full((R, width), float("-inf")), "one_value": torch.full((R, width), 10.5),
           "spread": torch.randn(R, width, generator=gen) * 1e4, "nan": torch.full((R, width), float("nan"))}
    x = torch.where(valid, torch.randn(R, width, generator=gen), bad[garbage])
    for k in sorted({1, min(64, MAXK)}):
        a, b = _run_sparse(x.to(DEV), blocks.to(DEV), cbs, lens.to(DEV), k)
        _assert_same(a, b, f"sparse invalid columns {garbage} cbs={cbs} k={k}")


@pytest.mark.parametrize("pattern", ["few_values", "one_bin", "specials", "all_equal"])
def test_sparse_topk_ties(pattern, gen, sampled):
    cbs = 16
    nb = W_STREAM // cbs
    x, blocks, lens = _sparse_case(4, nb, cbs, gen)
    pos, valid = reference._sparse_positions(blocks, cbs, lens.long().clamp(min=0))
    x = torch.where(valid, _pattern(pattern, 4, nb * cbs, gen), x)
    k = min(2048, MAXK)
    a, b = _run_sparse(x.to(DEV), blocks.to(DEV), cbs, lens.to(DEV), k)
    _assert_same(a, b, f"sparse ties {pattern}")


@pytest.mark.parametrize("nb_width", [W_SMALL, W_STREAM])
@pytest.mark.parametrize("disorder", ["shuffled", "duplicated"])
def test_sparse_topk_unordered_lists(nb_width, disorder, gen):
    """Out-of-contract candidate lists (valid ids not ascending, or repeated): the output is still
    ascending positions then -1, and on distinct scores it equals the reference exactly (only the
    tie-break among equal scores may follow column order, as cuda_topk documents)."""
    cbs = 16
    nb = max(4, nb_width // cbs)
    x, blocks, lens = _sparse_case(6, nb, cbs, gen, holes=True)
    for r in range(blocks.shape[0]):
        perm = torch.randperm(nb, generator=gen)
        blocks[r] = blocks[r][perm]
        if disorder == "duplicated":
            blocks[r, nb // 2:] = blocks[r, : nb - nb // 2]
    # distinct scores: integers below 2^24 (x + arange * 1e-3 rounded two of them to one float: run 120)
    x = torch.randperm(x.numel(), generator=gen).to(torch.float32).view_as(x)
    for k in sorted({1, 37, min(2048, MAXK)}):
        a, b = _run_sparse(x.to(DEV), blocks.to(DEV), cbs, lens.to(DEV), k)
        a = a.cpu()
        valid = a >= 0
        assert torch.equal(valid, valid.cummin(dim=1).values), "valid entries must form a prefix"
        nxt = torch.where(valid[:, 1:], a[:, 1:], torch.iinfo(torch.int32).max)
        assert (a[:, :-1][valid[:, :-1]] <= nxt[valid[:, :-1]]).all(), "positions must ascend"
        if disorder == "shuffled":
            _assert_same(a, b.cpu(), f"unordered lists k={k}")
        else:  # a repeated block's positions may be picked twice: same multiset of scores as the reference
            assert (valid.sum(1) == (b.cpu() >= 0).sum(1)).all()


# ----------------------------------------------------------------------------------------------------
# The three-CTA kernel (16-bit keys in shared memory; cuda_topk.set_tri_mode)
# ----------------------------------------------------------------------------------------------------

TRI_MAXK = _T.get("tri_max_k", 0)
TRI_KS = sorted({k for k in (1, 7, 100, 512, 1024, 2048, TRI_MAXK) if 0 < k <= TRI_MAXK})
TRI_PATTERNS = PATTERNS + ["rounded"]


@pytest.fixture
def tri_always():
    """Every qualifying topk / sparse_topk launch on the three-CTA kernel."""
    prev = ct.set_tri_mode("always")
    yield
    ct.set_tri_mode(prev)


def _tri_pattern(name, R, W, gen):
    if name == "rounded":  # randn at bf16 precision in fp32: a threshold bin small enough for the bitmap path,
        # with ties inside it
        return torch.randn(R, W, generator=gen).to(torch.bfloat16).float()
    return _pattern(name, R, W, gen)


def _rows16(x):
    """x as a view into rows padded to 16 bytes (fp32: a multiple of 4 columns, bf16: of 8), which the three-CTA
    kernel needs."""
    W, per = x.shape[1], 16 // x.element_size()
    buf = torch.full((x.shape[0], (W + per - 1) // per * per), 123.0, dtype=x.dtype, device=x.device)
    buf[:, :W] = x
    return buf[:, :W]


def _expect_tri(fn, qualifies=True):
    """Runs fn() and checks that it launched the three-CTA kernel (or, qualifies=False, that it did not)."""
    before = ct.tri_launches()
    out = fn()
    assert (ct.tri_launches() > before) == qualifies, "three-CTA kernel " + ("not " if qualifies else "") + "used"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [W_SMALL, SMEM_KEYS // 4 + 1, W_SMEM, SMEM_KEYS])
@pytest.mark.parametrize("k", TRI_KS)
def test_topk_tri_random(dtype, W, k, gen, tri_always):
    lens = _lengths(W, k, gen).to(DEV)
    x = _rows16(torch.randn(lens.shape[0], W, generator=gen).to(dtype).to(DEV))
    a, b = _expect_tri(lambda: _run_topk(x, lens, k))
    _assert_same(a, b, f"tri topk {dtype} W={W} k={k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", TRI_PATTERNS)
@pytest.mark.parametrize("W", [W_SMALL + 3, W_SMEM])
def test_topk_tri_patterns(dtype, pattern, W, gen, tri_always):
    """Threshold bins within the kernel's buffer (bitmap path, ties included) and beyond it (rescan), NaN, -inf,
    signed zeros, denormals: exact either way."""
    for k in sorted({1, min(100, TRI_MAXK), TRI_MAXK}):
        lens = _lengths(W, k, gen, extra_rows=1).to(DEV)
        x = _rows16(_tri_pattern(pattern, lens.shape[0], W, gen).to(dtype).to(DEV))
        a, b = _expect_tri(lambda: _run_topk(x, lens, k))
        _assert_same(a, b, f"tri topk {pattern} {dtype} W={W} k={k}")


def test_topk_tri_not_qualifying(gen, tri_always):
    """Rows the three-CTA kernel does not take (misaligned starts, wider rows, larger k) keep their kernels in
    "always" mode, exact."""
    W = SMEM_KEYS - 4
    x = torch.randn(5, W + 4, generator=gen).to(DEV)
    lens = torch.tensor([W, W - 1, 0, 3, W // 2], dtype=torch.int32, device=DEV)
    k = TRI_MAXK
    assert 2 * k <= MAXK
    xb = x.to(torch.bfloat16)
    for what, xx, kk, qualifies in [("aligned", x[:, :W], k, True), ("aligned bf16", xb[:, :W], k, True),
                                    ("misaligned", x[:, 1:], k, False), ("misaligned bf16", xb[:, 1:], k, False),
                                    ("k", x[:, :W], 2 * k, False),
                                    ("wide", torch.randn(3, SMEM_KEYS + 1, generator=gen).to(DEV), k, False)]:
        a, b = _expect_tri(lambda: _run_topk(xx, lens[: xx.shape[0]], kk), qualifies)
        _assert_same(a, b, f"tri mode, {what} rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cbs", [8, 16, 32, 64])
@pytest.mark.parametrize("nb_width", [W_SMALL, SMEM_KEYS])
@pytest.mark.parametrize("holes", [False, True])
def test_sparse_topk_tri(dtype, cbs, nb_width, holes, gen, tri_always):
    nb = max(1, nb_width // cbs)
    x, blocks, lens = _sparse_case(6, nb, cbs, gen, holes)
    for k in sorted({1, min(64, TRI_MAXK), TRI_MAXK}):
        a, b = _expect_tri(lambda: _run_sparse(x.to(dtype).to(DEV), blocks.to(DEV), cbs, lens.to(DEV), k))
        _assert_same(a, b, f"tri sparse {dtype} cbs={cbs} nb={nb} k={k} holes={holes}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["few_values", "one_bin", "specials", "all_equal", "rounded"])
@pytest.mark.parametrize("disorder", ["none", "shuffled"])
def test_sparse_topk_tri_ties(dtype, pattern, disorder, gen, tri_always):
    """Ties in and beyond the kernel's bin buffer; shuffled candidate lists (out of contract: distinct scores
    only, so the output must still be the reference's)."""
    if disorder == "shuffled" and dtype == torch.bfloat16:
        pytest.skip("distinct scores over 16K columns need fp32")
    cbs = 16
    nb = SMEM_KEYS // cbs
    x, blocks, lens = _sparse_case(4, nb, cbs, gen, holes=True)
    pos, valid = reference._sparse_positions(blocks, cbs, lens.long().clamp(min=0))
    if disorder == "shuffled":
        for r in range(blocks.shape[0]):
            blocks[r] = blocks[r][torch.randperm(nb, generator=gen)]
        x = torch.randperm(x.numel(), generator=gen).to(torch.float32).view_as(x)  # distinct scores
    else:
        x = torch.where(valid, _tri_pattern(pattern, 4, nb * cbs, gen), x)
    a, b = _expect_tri(lambda: _run_sparse(x.to(dtype).to(DEV), blocks.to(DEV), cbs, lens.to(DEV), TRI_MAXK))
    _assert_same(a, b, f"tri sparse {pattern} {dtype} {disorder}")


def test_tri_bitwise_repeatable(gen, tri_always):
    runs = 50 if not EMU else 3
    W = W_SMEM
    x = _rows16(_tri_pattern("rounded", 4, W, gen).to(DEV))
    lens = torch.tensor([W, W - 1, W // 2, 3000 % W], dtype=torch.int32, device=DEV)
    first = torch.empty(4, TRI_MAXK, dtype=torch.int32, device=DEV)
    _expect_tri(lambda: ct.topk(x, lens, TRI_MAXK, first))
    for _ in range(runs):
        again = torch.empty_like(first)
        ct.topk(x, lens, TRI_MAXK, again)
        testing.assert_bitwise_equal(again, first)


def test_tri_mode_auto(gen):
    """"auto" takes the three-CTA kernel for batches of at least 2 x SMs rows only; "off" never."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else int(
        os.environ.get("TSI_EMU_SMS", "2"))
    W, k = W_SMALL, min(64, TRI_MAXK)
    prev = ct.set_tri_mode("auto")
    try:
        for rows, mode, used in [(2 * sms, "auto", True), (2 * sms - 1, "auto", False), (2 * sms, "off", False)]:
            ct.set_tri_mode(mode)
            x = torch.randn(rows, W, generator=gen).to(DEV)
            lens = torch.full((rows,), W, dtype=torch.int32, device=DEV)
            a, b = _expect_tri(lambda: _run_topk(x, lens, k), used)
            _assert_same(a, b, f"tri mode {mode}, {rows} rows")
    finally:
        ct.set_tri_mode(prev)


# ----------------------------------------------------------------------------------------------------
# block_topk
# ----------------------------------------------------------------------------------------------------

def _run_block(x, lens, cbs, nbk):
    a = torch.full((x.shape[0], nbk), -7, dtype=torch.int32, device=x.device)
    b = torch.full((x.shape[0], nbk), -9, dtype=torch.int32, device=x.device)
    ct.block_topk(x, lens, cbs, a)
    reference.block_topk(x, lens, cbs, b)
    _sync()
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cbs", [8, 16, 32, 64])
@pytest.mark.parametrize("width", ["small", "smem", "stream"])
@pytest.mark.parametrize("offset", [0, 1])
def test_block_topk(dtype, cbs, width, offset, gen):
    """offset 1 misaligns every row start (the kernel's scalar path)."""
    # "stream": more blocks than the shared-memory limit.
    W = {"small": W_SMALL + 3, "smem": 4 * SMEM_KEYS + 5, "stream": cbs * (SMEM_KEYS + 100) + 9}[width]
    for nbk in sorted({1, min(64, MAXK), min(2048, MAXK)}):
        lens = _lengths(W, nbk * cbs, gen, extra_rows=1).to(DEV)
        buf = torch.randn(lens.shape[0], W + offset, generator=gen).to(dtype).to(DEV)
        a, b = _run_block(buf[:, offset:], lens, cbs, nbk)
        _assert_same(a, b, f"block {dtype} cbs={cbs} W={W} offset={offset} nbk={nbk}")


@pytest.mark.parametrize("pattern", ["few_values", "specials", "nan_neginf", "all_equal", "one_bin"])
@pytest.mark.parametrize("W", [W_SMALL * 8, 8 * SMEM_KEYS + 5])
def test_block_topk_patterns(pattern, W, gen, sampled):
    cbs = 8
    nbk = min(2048, MAXK)
    x = _pattern(pattern, 4, W, gen).to(DEV)
    lens = torch.tensor([W, W - 9, nbk * cbs + 3, 9], dtype=torch.int32, device=DEV)
    a, b = _run_block(x, lens, cbs, nbk)
    _assert_same(a, b, f"block {pattern} W={W}")


# ----------------------------------------------------------------------------------------------------
# Determinism, graphs, dispatch
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W", [W_CLUSTER, W_STREAM])
def test_bitwise_repeatable(W, gen, sampled):
    runs = 50 if not EMU else 3
    x = _pattern("few_values", 4, W, gen).to(DEV)
    lens = torch.tensor([W, W - 1, W // 2, 3000], dtype=torch.int32, device=DEV)
    k = min(2048, MAXK)
    first = torch.empty(4, k, dtype=torch.int32, device=DEV)
    ct.topk(x, lens, k, first)
    blocks = torch.empty(4, min(1024, MAXK), dtype=torch.int32, device=DEV)
    ct.block_topk(x, lens, 8, blocks)
    for _ in range(runs):
        again = torch.empty_like(first)
        ct.topk(x, lens, k, again)
        testing.assert_bitwise_equal(again, first)
        again_b = torch.empty_like(blocks)
        ct.block_topk(x, lens, 8, again_b)
        testing.assert_bitwise_equal(again_b, blocks)


@gpu_only
def test_cuda_graph_replay(gen):
    R, W, k, cbs = 8, 40000, 2048, 16
    nb = 1024
    x = torch.zeros(R, W, device=DEV)
    lens = torch.zeros(R, dtype=torch.int32, device=DEV)
    xs = torch.zeros(R, nb * cbs, device=DEV)
    blocks = torch.full((R, nb), -1, dtype=torch.int32, device=DEV)
    slens = torch.zeros(R, dtype=torch.int32, device=DEV)
    out = torch.empty(R, k, dtype=torch.int32, device=DEV)
    sout = torch.empty(R, k, dtype=torch.int32, device=DEV)
    bout = torch.empty(R, 512, dtype=torch.int32, device=DEV)

    def step():
        ct.topk(x, lens, k, out)
        ct.sparse_topk(xs, blocks, cbs, slens, k, sout)
        ct.block_topk(x, lens, 8, bout)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for it in range(4):
        pattern = ["randn", "few_values", "one_bin", "specials"][it]
        x.copy_(_pattern(pattern, R, W, gen))
        lens.copy_(torch.randint(-2, W + 3, (R,), generator=gen, dtype=torch.int32))
        sx, sb, sl = _sparse_case(R, nb, cbs, gen)
        xs.copy_(sx)
        blocks.copy_(sb)
        slens.copy_(sl)
        out.fill_(-5)
        sout.fill_(-5)
        bout.fill_(-5)
        g.replay()
        torch.cuda.synchronize()
        for got, fn, args, width in [(out, reference.topk, (x, lens, k), k),
                                     (sout, reference.sparse_topk, (xs, blocks, cbs, slens, k), k),
                                     (bout, reference.block_topk, (x, lens, 8), 512)]:
            exp = torch.empty(R, width, dtype=torch.int32, device=DEV)
            fn(*args, exp)
            _assert_same(got, exp, f"graph replay {it} {fn.__name__}")


@gpu_only
def test_dispatch_uses_cuda_backend(gen):
    x = torch.randn(4, 5000, generator=gen).to(DEV)
    lens = torch.tensor([5000, 10, 0, 4000], dtype=torch.int32, device=DEV)
    out = torch.empty(4, 256, dtype=torch.int32, device=DEV)
    assert backends.select("topk", x, lens, 256, out).name == "cuda"
    torch.ops.sparse_indexer.topk(x, lens, 256, out)
    exp = torch.empty_like(out)
    reference.topk(x, lens, 256, exp)
    _assert_same(out, exp, "dispatched topk")
    cb = torch.empty(4, 64, dtype=torch.int32, device=DEV)
    assert backends.select("block_topk", x, lens, 16, cb).name == "cuda"
    assert backends.select("sparse_topk", x[:, :4096], torch.zeros(4, 256, dtype=torch.int32, device=DEV), 16,
                           lens, 256, out).name == "cuda"
