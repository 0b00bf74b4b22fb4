"""CUDA ``write_k_cache`` for MXFP4 caches (``csrc/cache_kernels.cuh``) against the reference: every byte of
the cache, written slots and untouched ones, equal to ``reference.write_k_cache`` computed on the CPU.

GPU tests are marked ``gpu`` and skip without a GPU and the built library. Developer hook, as in
``test_topk_cuda.py``: ``TSI_TOPK_EMU=/path/to/emulator.so`` (``csrc/emu/build_emu.sh``) runs the same kernel
logic on the CPU (``tests/test_emulated_kernels.py`` does so in CI).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from torch_sparse_indexer import backends, formats, reference
from torch_sparse_indexer.kernels import cuda_cache as cc
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
                                     reason="needs a CUDA GPU and the built library")]
gpu_only = pytest.mark.skipif(bool(EMU), reason="needs a real GPU")


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _cache(nb, bs, D, gen, pad=0):
    """Random bytes (untouched slots must keep them); ``pad`` > 0 puts the pages ``pad`` bytes apart."""
    bpt = formats.bytes_per_token("mxfp4", D)
    base = torch.randint(0, 256, (nb, bs * bpt + pad), generator=gen, dtype=torch.uint8)
    return base, base[:, : bs * bpt].unflatten(1, (bs, bpt))


def _check(k, slot, nb, bs, gen, pad=0):
    """Runs the kernel on a random cache and compares the whole cache (pad bytes included) with the reference."""
    D = k.shape[1]
    base, view = _cache(nb, bs, D, gen, pad)
    want_base = base.clone()
    reference.write_k_cache(k.cpu(), slot.cpu(),
                            want_base[:, : view.shape[1] * view.shape[2]].unflatten(1, view.shape[1:]), "mxfp4", True)
    got_base = base.to(DEV)
    got = got_base[:, : view.shape[1] * view.shape[2]].unflatten(1, view.shape[1:])
    cc.write_k_cache(k.to(DEV), slot.to(DEV), got, "mxfp4", True)
    _sync()
    diff = int((got_base.cpu() != want_base).sum())
    assert diff == 0, f"{diff} bytes differ (T={k.shape[0]} D={D} {k.dtype} slots {slot.dtype} bs={bs} pad={pad})"


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sdtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("trial", range(2))
def test_write_matches_reference(D, kdtype, sdtype, trial):
    gen = torch.Generator().manual_seed(1000 * trial + D + (7 if kdtype == torch.bfloat16 else 0))
    rng = random.Random(trial * 31 + D)
    bs = rng.choice(formats.CACHE_BLOCK_SIZES)
    nb = rng.randint(1, 5)
    T = rng.choice([1, 17, 33, rng.randint(1, nb * bs)])
    T = min(T, nb * bs)
    x = torch.randn(T, D, generator=gen) * torch.rand(T, 1, generator=gen).mul(8) * 2.0 ** rng.randint(-30, 30)
    x[0, :32] = 0  # a group at the amax floor
    k = x.to(kdtype)
    slot = torch.randperm(nb * bs, generator=gen)[:T]  # distinct slots (duplicates race in every backend)
    slot[torch.rand(T, generator=gen) < 0.2] = -1
    if T > 2:
        slot[2] = nb * bs + 3  # past the cache: skipped
    _check(k, slot.to(sdtype), nb, bs, gen, pad=rng.choice([0, 16, 48]))


def test_write_rounding_ties_and_specials():
    """Every e2m1 rounding boundary (ties to even) and its fp32 neighbours in groups whose scale is exactly 2^e,
    +-6, zeros of both signs; then groups with inf, NaN, subnormal and huge values (scale exponent clamped to
    [1, 254], NaN amax as in torch) -- the paths a bit-level encoder gets wrong first."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    vals = torch.cat([bounds, torch.nextafter(bounds, torch.full_like(bounds, 10.0)),
                      torch.nextafter(bounds, torch.zeros_like(bounds)), torch.tensor([0.0, -0.0, 6.0])])
    vals = torch.cat([vals, -vals])
    row = torch.zeros(128)
    row[: vals.numel()] = vals
    row[31] = row[63] = row[95] = row[127] = 6.0
    rows = [row * 2.0 ** e for e in (-20, -3, 0, 4, 100)]
    special = torch.randn(4, 128)
    special[0, 3] = float("inf")
    special[0, 40] = float("-inf")
    special[1, 5] = float("nan")
    special[2, :32] = 1e-40  # subnormal group: scale exponent clamped at 1
    special[2, 32:64] = 3e38  # scale exponent 254 (inv = 2^-127, subnormal)
    special[3] = -0.0
    x = torch.cat([torch.stack(rows), special])
    slot = torch.arange(x.shape[0])
    _check(x, slot, 1, 16, torch.Generator().manual_seed(5))
    _check(x.to(torch.bfloat16), slot.to(torch.int32), 1, 16, torch.Generator().manual_seed(6))


@pytest.mark.parametrize("T", [0, 1, 31, 32, 33, 257])
def test_write_token_counts(T):
    """Token counts around one CTA's share (32 tokens of D = 128, 64 of D = 64) and an empty call."""
    gen = torch.Generator().manual_seed(T)
    for D in (64, 128):
        k = torch.randn(T, D, generator=gen).to(torch.bfloat16)
        _check(k, torch.randperm(512, generator=gen)[:T], 4, 128, gen)


@gpu_only
def test_write_backend_choice_and_op():
    """Through the op: MXFP4 writes of bf16 keys take this kernel, FP8 writes and fp16 keys the Triton one; the
    op's bytes equal the reference either way."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(100, 128, generator=gen).to(torch.bfloat16).cuda()
    slot = torch.randperm(256, generator=gen)[:100].cuda()
    for fmt, kd, want_name in (("mxfp4", torch.bfloat16, "cuda"), ("fp8", torch.bfloat16, "triton"),
                               ("mxfp4", torch.float16, "triton")):
        cache = formats.allocate_k_cache(4, 64, 128, fmt, "cuda")
        args = (k.to(kd), slot, cache, fmt, True)
        assert backends.select("write_k_cache", *args).name == want_name
        ops.write_k_cache(*args)
        want = formats.allocate_k_cache(4, 64, 128, fmt, "cpu")
        reference.write_k_cache(k.to(kd).cpu(), slot.cpu(), want, fmt, True)
        assert torch.equal(cache.cpu(), want), f"{fmt} {kd}: bytes differ"


@gpu_only
def test_write_cuda_graph_replay():
    """Captured once, replayed with new keys and new slots (including skipped ones): each replay's cache equals
    the reference, no host sync inside."""
    gen = torch.Generator().manual_seed(11)
    T, D, nb, bs = 200, 128, 8, 64
    k = torch.zeros(T, D, dtype=torch.bfloat16, device="cuda")
    slot = torch.zeros(T, dtype=torch.int64, device="cuda")
    cache = formats.allocate_k_cache(nb, bs, D, "mxfp4", "cuda")
    cc.write_k_cache(k, slot, cache, "mxfp4", True)  # nothing to compile; one eager launch first anyway
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cc.write_k_cache(k, slot, cache, "mxfp4", True)
    for _ in range(3):
        k.copy_(torch.randn(T, D, generator=gen).to(torch.bfloat16))
        s = torch.randperm(nb * bs, generator=gen)[:T]
        s[torch.rand(T, generator=gen) < 0.1] = -1
        slot.copy_(s)
        cache.zero_()
        g.replay()
        want = formats.allocate_k_cache(nb, bs, D, "mxfp4", "cpu")
        reference.write_k_cache(k.cpu(), s, want, "mxfp4", True)
        assert torch.equal(cache.cpu(), want)
