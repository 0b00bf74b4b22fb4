"""CUDA decode scoring kernels (``kernels/cuda_scoring.py``, ``csrc/scoring.cu``; SM90) beyond the paged tests
that ``test_triton_kernels.py`` runs on both backends: every padded head count, grids and prefetch depths
(results must not depend on them, bit for bit), shapes with many tiles per program, and what the backend
declines. Checks against the reference on the same quantized inputs (``calc_diff < 1e-5``, identical ``-inf``
masks, every element written).

Developer hook (run by ``test_emulated_kernels.py``, so CI runs it too): with
``TORCH_SPARSE_INDEXER_SCORING_LIB`` pointing at the CPU emulation build (``CSRC=scoring.cu
csrc/emu/build_emu.sh lib.so``: the same kernel source, wgmma and cp.async emulated), the kernel tests run on CPU
tensors with smaller shapes; the dispatch tests need the real GPU build and are skipped there."""
from __future__ import annotations

import random

import pytest
import torch

from torch_sparse_indexer import backends, formats, reference, testing
from torch_sparse_indexer.kernels import cuda_scoring as cs

ops = torch.ops.sparse_indexer
TOL = 1e-5
EMU = cs.emulated()
DEV = "cpu" if EMU else "cuda"
SCALE = 4 if EMU else 1  # contexts divided by this under the emulator (its threads are slow)
kernel_test = (lambda f: f) if EMU else pytest.mark.gpu
gpu_only = pytest.mark.skipif(EMU, reason="needs the GPU build (dispatch on CUDA tensors)")


@pytest.fixture(autouse=True)
def _fp8_enabled(monkeypatch):
    """The FP8 path too (dispatch sends FP8 caches to the Triton kernels unless enabled)."""
    monkeypatch.setitem(cs.CONFIG_OVERRIDES, "fp8", True)


def _gpu_ready():
    if EMU:
        return
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not cs.available():
        pytest.skip(f"CUDA scoring library: {cs._LIB.load_error}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA scoring kernels are SM90 (wgmma) kernels")


def _case(fmt, D, H, R, ctx, nbk, cbs, bs, gen, rng):
    seq = [max(1, ctx - rng.randint(0, ctx // 4)) for _ in range(R)]
    case = testing.make_paged_cache(seq, bs, D, fmt, device=DEV, gen=gen)
    lens = torch.tensor(seq, dtype=torch.int32, device=DEV)
    cand = testing.random_candidates(seq, nbk, cbs, gen=gen).to(DEV)
    qs = testing.make_queries(R, H, D, fmt, device=DEV, gen=gen)
    return case, lens, cand, qs


def _run(sparse, case, lens, cand, qs, cbs, L):
    out = torch.full((lens.shape[0], L), float("nan"), device=DEV)
    with backends.use_backend("cuda"), backends.record_dispatch() as ran:
        if sparse:
            ops.paged_sparse_mqa_logits(qs.q, qs.q_scale, case.kv_cache, qs.weights, lens, case.block_table, None,
                                        cand, cbs, out)
        else:
            ops.paged_mqa_logits(qs.q, qs.q_scale, case.kv_cache, qs.weights, lens, case.block_table, None, out)
    assert [name for _, name in ran] == ["cuda"], ran
    if not EMU:
        torch.cuda.synchronize()
    return out


def _ref(sparse, case, lens, cand, qs, cbs, L):
    ref = torch.empty(lens.shape[0], L, device=DEV)
    if sparse:
        reference.paged_sparse_mqa_logits(qs.q, qs.q_scale, case.kv_cache, qs.weights, lens, case.block_table, None,
                                          cand, cbs, ref)
    else:
        reference.paged_mqa_logits(qs.q, qs.q_scale, case.kv_cache, qs.weights, lens, case.block_table, None, ref)
    return ref


@kernel_test
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H", [4, 20, 40, 60])
def test_padded_head_counts(fmt, D, H, seed, gen):
    """Head counts that pad to 16, 32 and 64 wgmma columns (the padding heads must contribute nothing)."""
    _gpu_ready()
    rng = random.Random(seed)
    cbs, bs = rng.choice([(8, 64), (16, 16), (32, 256)])
    case, lens, cand, qs = _case(fmt, D, H, 6, rng.randint(200, 3000 // SCALE), 24, cbs, bs, gen, rng)
    for sparse in (True, False):
        L = 24 * cbs if sparse else int(lens.max()) + 5
        out = _run(sparse, case, lens, cand, qs, cbs, L)
        assert not torch.isnan(out).any(), "output elements not written"
        assert testing.calc_diff(out, _ref(sparse, case, lens, cand, qs, cbs, L)) < TOL


@kernel_test
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_grid_and_depth_do_not_change_bits(fmt, sparse, seed, gen, monkeypatch):
    """Long rows (many tiles per program): the reference's scores, and the same bits for every program size
    (1, 3, 64 tiles and the default) and every prefetch depth (3, 4, 6 tiles in flight)."""
    _gpu_ready()
    rng = random.Random(seed)
    D, H, cbs, bs = 128, 64, 8, 64
    # (emulated: two rows just past one 64-tile program, dense)
    R, ctx, nbk = (2, rng.randint(4200, 5200), 256) if EMU else (8, rng.randint(20000, 40000), 1024)
    case, lens, cand, qs = _case(fmt, D, H, R, ctx, nbk, cbs, bs, gen, rng)
    L = nbk * cbs if sparse else int(lens.max())
    base = _run(sparse, case, lens, cand, qs, cbs, L)
    assert testing.calc_diff(base, _ref(sparse, case, lens, cand, qs, cbs, L)) < TOL
    for tiles in (1, 3, 64):
        monkeypatch.setitem(cs.CONFIG_OVERRIDES, "row_tiles", tiles)
        testing.assert_bitwise_equal(_run(sparse, case, lens, cand, qs, cbs, L), base)
    monkeypatch.delitem(cs.CONFIG_OVERRIDES, "row_tiles")
    try:
        for depth in (3, 4, 6):
            cs.set_depth(depth)
            testing.assert_bitwise_equal(_run(sparse, case, lens, cand, qs, cbs, L), base)
    finally:
        cs.set_depth(0)


@pytest.mark.gpu
@gpu_only
def test_declines_what_it_cannot_take(gen):
    """128 heads, a cache whose pages are not 16-byte aligned: the CUDA backend declines (with the reason) and
    automatic dispatch falls back to the Triton kernels."""
    _gpu_ready()
    D, bs = 128, 16
    case = testing.make_paged_cache([40, 20], bs, D, "fp8", device="cuda", gen=gen)
    lens = torch.tensor([40, 20], dtype=torch.int32, device="cuda")
    qs = testing.make_queries(2, 128, D, "fp8", device="cuda", gen=gen)
    out = torch.empty(2, 48, device="cuda")
    args = (qs.q, None, case.kv_cache, qs.weights, lens, case.block_table, None, out)
    assert "heads" in cs.supports_paged_mqa_logits(*args)
    assert backends.select("paged_mqa_logits", *args).name != "cuda"
    raw = torch.zeros(case.kv_cache.numel() + 4, dtype=torch.uint8, device="cuda")
    shifted = raw[4:].view(case.kv_cache.shape)
    qs = testing.make_queries(2, 64, D, "fp8", device="cuda", gen=gen)
    args = (qs.q, None, shifted, qs.weights, lens, case.block_table, None, out)
    assert "16-byte" in cs.supports_paged_mqa_logits(*args)


@pytest.mark.gpu
@gpu_only
def test_fp8_goes_to_triton_by_default(gen, monkeypatch):
    """Without the override, automatic dispatch sends FP8 caches to the Triton kernels and MXFP4 ones here."""
    _gpu_ready()
    monkeypatch.delitem(cs.CONFIG_OVERRIDES, "fp8")
    lens = torch.tensor([40], dtype=torch.int32, device="cuda")
    out = torch.empty(1, 48, device="cuda")
    for fmt, want in (("fp8", "triton"), ("mxfp4", "cuda")):
        case = testing.make_paged_cache([40], 16, 128, fmt, device="cuda", gen=gen)
        qs = testing.make_queries(1, 64, 128, fmt, device="cuda", gen=gen)
        args = (qs.q, qs.q_scale, case.kv_cache, qs.weights, lens, case.block_table, None, out)
        assert backends.select("paged_mqa_logits", *args).name == want


@gpu_only
def test_declines_cpu_tensors():
    q = torch.zeros(2, 8, 128, dtype=formats.FP8_DTYPE)
    kv = torch.zeros(4, 16, 132, dtype=torch.uint8)
    why = cs.supports_paged_mqa_logits(q, None, kv, torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32),
                                       torch.zeros(2, 2, dtype=torch.int32), None, torch.zeros(2, 32))
    assert why is not None and "CUDA" in why


def test_library_loading_reports_missing_and_stale_builds(tmp_path):
    """A missing library, and one older than the package (a declared function absent): not available, with the
    reason; the backends that depend on it are then simply not registered."""
    from torch_sparse_indexer.kernels import _cudalib

    missing = _cudalib.Library("none.so", "TSI_TEST_NO_SUCH_VAR", lambda lib: None)
    missing.path = lambda: str(tmp_path / "none.so")
    assert not missing.available() and "not built" in missing.load_error

    def declare(lib):
        lib.tsi_function_that_does_not_exist.restype = None

    stale = _cudalib.Library("stale.so", "TSI_TEST_NO_SUCH_VAR", declare)
    stale.path = lambda: torch._C.__file__  # a loadable library without the declared function
    assert not stale.available() and "stale build" in stale.load_error and stale.lib is None
