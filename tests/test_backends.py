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
