"""The backend registry: scoped registrations leave the registry as they found it."""
import pytest
import torch

from torch_sparse_indexer import backends, testing


def _names(op):
    return [(b.name, b.fn) for b in backends.candidates(op)]


def test_registry_scope_undoes_additions_and_replacements():
    before = {op: _names(op) for op in ("topk", "paged_mqa_logits")}
    marker = lambda *a: None  # noqa: E731
    with pytest.raises(RuntimeError):
        with backends.registry_scope():
            backends.register("topk", "cuda", marker, priority=99)          # replaces or adds
            backends.register("paged_mqa_logits", "triton", marker, priority=99)
            assert backends.candidates("topk")[0].fn is marker
            raise RuntimeError("leaving the block by an exception restores too")
    assert {op: _names(op) for op in before} == before


def test_registry_scope_clears_the_named_ops_only_inside():
    before = {op: _names(op) for op in ("topk", "paged_mqa_logits")}
    assert before["paged_mqa_logits"], "the reference backend is always registered"
    with backends.registry_scope("paged_mqa_logits"):
        assert backends.candidates("paged_mqa_logits") == []
        assert _names("topk") == before["topk"]                 # ops not named keep their backends
        with pytest.raises(NotImplementedError, match="no backend registered"):
            backends.select("paged_mqa_logits")
        backends.register("paged_mqa_logits", "triton", lambda *a: None, priority=1)
        assert [b.name for b in backends.candidates("paged_mqa_logits")] == ["triton"]
    assert {op: _names(op) for op in before} == before


def test_cpu_emulation_inside_a_scope_does_not_leak():
    """test_triton_kernels registers the interpreter's kernels for CPU tensors inside a scope; afterwards CPU
    tensors dispatch to the reference again (a test module in the same process, e.g. test_fuzz's CPU mode,
    relies on that)."""
    pytest.importorskip("triton")
    from torch_sparse_indexer import formats
    cache = formats.allocate_k_cache(num_blocks=2, block_size=16, head_dim=64, fmt="fp8")
    args = (torch.randn(3, 64), torch.arange(3), cache, "fp8", False)
    assert backends.select("write_k_cache", *args).name == "reference"
    with backends.registry_scope():
        testing.register_cpu_emulation(ops=("write_k_cache",))
        assert backends.select("write_k_cache", *args).name == "triton"
    assert backends.select("write_k_cache", *args).name == "reference"


def test_defer_passes_a_supporting_backend_over_only_in_automatic_dispatch():
    first = lambda *a: None  # noqa: E731
    later = lambda *a: None  # noqa: E731
    # Cleared: on a GPU machine the real CUDA backend (priority 20) would otherwise be asked last.
    with backends.registry_scope("paged_mqa_logits"):
        backends.register("paged_mqa_logits", "deepgemm", first, priority=99,
                          defer=lambda x: "slower here" if x == "defer" else None)
        backends.register("paged_mqa_logits", "triton", later, priority=98)
        assert backends.select("paged_mqa_logits", "defer").name == "triton"
        assert backends.select("paged_mqa_logits", "keep").name == "deepgemm"
        with backends.use_backend("deepgemm"):                # forcing ignores defer
            assert backends.select("paged_mqa_logits", "defer").name == "deepgemm"
        backends.register("paged_mqa_logits", "triton", later, priority=98, supports=lambda x: "no")
        backends.register("paged_mqa_logits", "reference", later, priority=-100, supports=lambda x: "no")
        with pytest.raises(NotImplementedError, match="deepgemm: slower here; triton: no"):
            backends.select("paged_mqa_logits", "defer")


def test_deepgemm_decode_defers_to_triton_on_sm90_only(monkeypatch):
    """deepgemm.defer_decode's rule, without a GPU: SM90 and a Triton backend that takes the call (and is not
    disabled) defer; SM100, a disabled or refusing Triton backend do not. Checked end to end on a GPU with
    DeepGEMM in tests/test_deepgemm_gpu.py."""
    from torch_sparse_indexer.kernels import deepgemm as dgb
    seen = []
    args = (torch.zeros(2, 64, 128), None, torch.zeros(4, 64, 132, dtype=torch.uint8), torch.zeros(2, 64))
    with backends.registry_scope():
        backends.register("paged_mqa_logits", "triton", lambda *a: None, priority=10,
                          supports=lambda *a: seen.append(len(a)) or None)
        monkeypatch.setattr(dgb, "_arch", lambda device: "sm90")
        assert "faster" in dgb.defer_decode(*args, "more", "args")
        assert seen == [4]                                    # the four arguments every caller has
        backends.disable_backend("triton")
        try:
            assert dgb.defer_decode(*args) is None
        finally:
            backends.disable_backend("triton", False)
        monkeypatch.setattr(dgb, "_arch", lambda device: "sm100")
        assert dgb.defer_decode(*args) is None
        monkeypatch.setattr(dgb, "_arch", lambda device: "sm90")
        backends.register("paged_mqa_logits", "triton", lambda *a: None, priority=10, supports=lambda *a: "no")
        assert dgb.defer_decode(*args) is None
