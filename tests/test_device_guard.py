"""The ops launch on their tensors' device, not on whichever CUDA device is current.

Triton, the CUDA libraries and DeepGEMM launch on the current device, and a Python kernel registered through
``torch.library`` gets no device guard from the dispatcher, so ``ops.py`` makes the tensors' device current
around dispatch (and ``_cudalib.on_device`` does for the warmups). The CPU tests check that wiring with fake
``cuda:1`` tensors and a stand-in for ``torch.cuda``'s current device; the GPU test runs real kernels on
``cuda:1`` with ``cuda:0`` current (it needs two GPUs).
"""
import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_sparse_indexer as tsi
from torch_sparse_indexer import backends, ops, testing
from torch_sparse_indexer.kernels import _cudalib


@pytest.fixture
def current(monkeypatch):
    """A stand-in for the process's current CUDA device: ``state["cur"]`` (0 at first); ``state["entered"]``
    counts ``torch.cuda.device`` contexts."""
    state = {"cur": 0, "entered": 0}

    @contextlib.contextmanager
    def device(d):
        d = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
        prev = state["cur"]
        state["cur"] = d.index
        state["entered"] += 1
        try:
            yield
        finally:
            state["cur"] = prev

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["cur"])
    monkeypatch.setattr(torch.cuda, "device", device)
    return state


def _fake_topk_args(device):
    with FakeTensorMode():
        logits = torch.empty(3, 64, device=device)
        lengths = torch.empty(3, dtype=torch.int32, device=device)
        indices = torch.empty(3, 8, dtype=torch.int32, device=device)
    return logits, lengths, 8, indices


def _fake_paged_args(device):
    T, H, D, bs, nblk = 2, 8, 128, 64, 4
    with FakeTensorMode():
        q = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=device)
        cache = torch.empty(nblk, bs, D + 4, dtype=torch.uint8, device=device)
        w = torch.empty(T, H, device=device)
        lens = torch.empty(T, dtype=torch.int32, device=device)
        bt = torch.empty(T, nblk, dtype=torch.int32, device=device)
        logits = torch.empty(T, nblk * bs, device=device)
    # q_scale and req_indices None: the guard skips arguments that are not tensors.
    return q, None, cache, w, lens, bt, None, logits


# Where CUDA is present, a fake tensor on cuda:1 opens a context on that device (FakeTensor's init_gpu_context), which a
# one-GPU machine lacks ("invalid device ordinal"); CPU runs (CI) and machines with two GPUs check the wiring.
@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="fake cuda:1 tensors need a second GPU where CUDA is present")
@pytest.mark.parametrize("op,make", [("topk", _fake_topk_args), ("paged_mqa_logits", _fake_paged_args)])
def test_dispatch_runs_on_the_tensors_device(current, op, make):
    seen = []

    def stub(*args):
        seen.append(torch.cuda.current_device())

    impl = ops._make_impl(op)  # the function registered for the op's CPU and CUDA keys
    with backends.registry_scope():
        backends.register(op, "cuda", stub, priority=1000)
        impl(*make("cuda:1"))
        assert seen == [1], f"{op} on cuda:1 tensors dispatched with device {seen} current"
        assert current["cur"] == 0, "the caller's current device is restored"
        assert current["entered"] == 1
        # Already current: no device switch at all (the common case costs one current_device() query).
        current["cur"] = 1
        impl(*make("cuda:1"))
        assert seen == [1, 1] and current["entered"] == 1
        # A stub that raises still leaves the caller's device current.
        current["cur"] = 0
        backends.register(op, "cuda", lambda *a: (_ for _ in ()).throw(RuntimeError("launch failed")), priority=1000)
        with pytest.raises(RuntimeError, match="launch failed"):
            impl(*make("cuda:1"))
        assert current["cur"] == 0


def test_cpu_tensors_take_no_guard(current):
    seen = []
    impl = ops._make_impl("topk")
    logits = torch.randn(3, 64)
    args = (logits, torch.full((3,), 64, dtype=torch.int32), 8, torch.empty(3, 8, dtype=torch.int32))
    with backends.registry_scope():
        backends.register("topk", "cuda", lambda *a: seen.append(torch.cuda.current_device()), priority=1000)
        impl(*args)
    assert seen == [0] and current["entered"] == 0


def test_on_device_decorator(current):
    @_cudalib.on_device
    def body(device, x, *, y):
        return device, torch.cuda.current_device(), x + y

    assert body("cuda:1", 1, y=2) == (torch.device("cuda:1"), 1, 3)
    assert current["cur"] == 0 and current["entered"] == 1
    dev, cur, _ = body("cpu", 0, y=0)  # CPU: no device switch
    assert dev == torch.device("cpu") and cur == 0 and current["entered"] == 1


def test_the_warmups_take_the_guard():
    from torch_sparse_indexer.kernels import deepgemm, triton_cache, triton_scoring
    for mod in (triton_cache, triton_scoring, deepgemm):
        assert getattr(mod.warmup, "__wrapped__", None) is not None, f"{mod.__name__}.warmup is not on_device"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_on_the_second_gpu_with_the_first_current(seed):
    gen = torch.Generator().manual_seed(seed)
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    lens = [700, 1024, 3]
    R, W, k = len(lens), 1024, 64
    logits = torch.randn(R, W, generator=gen)
    lengths = torch.tensor(lens, dtype=torch.int32)
    with backends.use_backend("reference"):
        want = tsi.topk(logits, lengths, k)
    got = tsi.topk(logits.to(dev), lengths.to(dev), k)
    assert got.device == dev
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)

    # K cache write and dense decode scores (Triton or CUDA, whichever dispatch picks on that GPU).
    fmt, H, D, bs = "fp8", 8, 128, 64
    case = testing.make_paged_cache(lens, bs, D, fmt, gen=gen)
    qs = testing.make_queries(R, H, D, fmt, gen=gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    args = (qs.q, qs.q_scale, case.kv_cache, qs.weights, ctx, case.block_table, None)
    with backends.use_backend("reference"):
        ref = tsi.paged_mqa_logits(*args, max_context=W)
    out = tsi.paged_mqa_logits(*(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args), max_context=W)
    assert out.device == dev
    testing.assert_scores_close(out.cpu(), ref, ctx="paged_mqa_logits on cuda:1")
    new_k = torch.randn(5, D, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    slots = torch.tensor([0, 1, 2, 64, 65])
    cpu_cache, gpu_cache = case.kv_cache.clone(), case.kv_cache.to(dev)
    with backends.use_backend("reference"):
        tsi.write_k_cache(new_k, slots, cpu_cache, fmt)
    tsi.write_k_cache(new_k.to(dev), slots.to(dev), gpu_cache, fmt)
    assert torch.equal(gpu_cache.cpu(), cpu_cache)
    torch.cuda.synchronize(dev)
    assert torch.cuda.current_device() == 0
