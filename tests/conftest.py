"""Shared fixtures.

* ``gpu`` marker: skipped when CUDA is not available.
* ``device`` fixture: every test that takes it runs on ``cpu`` and, marked ``gpu``, on ``cuda``.
* ``seed`` / ``gen``: fresh random inputs each run; the seed is printed (shown with a failure) and
  ``TORCH_SPARSE_INDEXER_SEED=<n>`` replays it.
* ``call_op``: calls an op eagerly, or with ``TORCH_SPARSE_INDEXER_TEST_COMPILE=1`` through a
  ``torch.compile(fullgraph=True)`` wrapper (FlashInfer's ``FLASHINFER_TEST_TORCH_COMPILE`` idea), so the
  same tests check the fakes, functionalization and re-inplacing.
* ``TORCH_SPARSE_INDEXER_TEST_TRI_MODE=off|auto|always``: the CUDA top-k library's three-CTA mode for the whole
  run (``cuda_topk.set_tri_mode``), so the top-k GPU tests can be re-run with the three-CTA kernel taking every
  row it qualifies for.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import torch_sparse_indexer  # noqa: F401  (registers the ops)

TEST_COMPILE = os.environ.get("TORCH_SPARSE_INDEXER_TEST_COMPILE", "0") == "1"

if TEST_COMPILE:
    # Every test shape is a new compilation of the same wrapper code object.
    for _name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                  "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, _name):
            setattr(torch._dynamo.config, _name, 1 << 20)


def pytest_configure(config):
    mode = os.environ.get("TORCH_SPARSE_INDEXER_TEST_TRI_MODE")
    if mode:
        from torch_sparse_indexer.kernels import cuda_topk
        cuda_topk.set_tri_mode(mode)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return request.param


@pytest.fixture
def seed(request):
    env = os.environ.get("TORCH_SPARSE_INDEXER_SEED")
    s = int(env) if env else random.SystemRandom().randrange(1 << 31)
    print(f"\n{request.node.nodeid}: seed {s} (replay with TORCH_SPARSE_INDEXER_SEED={s})")
    return s


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


_COMPILED: dict = {}


def _compiled_call(op, *args):
    """Run ``op(*args)`` through a compiled wrapper; non-tensor arguments are baked in as constants."""
    is_t = tuple(isinstance(a, torch.Tensor) for a in args)
    statics = tuple(None if t else a for a, t in zip(args, is_t))
    key = (str(op), is_t, statics)
    fn = _COMPILED.get(key)
    if fn is None:
        def run(*tensors):
            it = iter(tensors)
            return op(*[next(it) if t else s for t, s in zip(is_t, statics)])
        fn = _COMPILED[key] = torch.compile(run, fullgraph=True, dynamic=False)
    return fn(*[a for a, t in zip(args, is_t) if t])


def _eager_call(op, *args):
    return op(*args)


@pytest.fixture
def call_op():
    """``call_op(torch.ops.sparse_indexer.X, *args)``: eager, or compiled when
    ``TORCH_SPARSE_INDEXER_TEST_COMPILE=1``."""
    return _compiled_call if TEST_COMPILE else _eager_call
