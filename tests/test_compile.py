"""torch.compile: every op compiles with ``fullgraph=True`` and no graph break, gives the eager results, and
one dense and one sparse end-to-end step lower to direct calls of our mutable ops on their (input)
buffers: no ``auto_functionalized``, no ``clone``, no ``copy_`` between buffers (post-grad graph pinned)."""
from __future__ import annotations

import os
import re
import shutil

import expecttest
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from torch.testing._internal.logging_utils import logs_to_string

from torch_sparse_indexer import formats, workspace
from torch_sparse_indexer.ops import SCHEMAS

import cases

ops = torch.ops.sparse_indexer


def _raw(t):
    if t is None:
        return None
    return t.detach().cpu().reshape(-1).view(torch.uint8) if t.numel() else t.detach().cpu()


def _clone_args(a, device="cpu"):
    return {n: (v.clone().to(device) if isinstance(v, torch.Tensor) else v) for n, v in a.items()}


def _as_fn(op, a):
    """``fn(*tensors)`` calling ``op`` with the non-tensor arguments of ``a`` baked in."""
    names = cases.arg_names(op)
    is_t = [isinstance(a[n], torch.Tensor) for n in names]
    statics = [None if t else a[n] for n, t in zip(names, is_t)]

    def fn(*tensors):
        it = iter(tensors)
        return getattr(ops, op)(*[next(it) if t else s for t, s in zip(is_t, statics)])
    return fn, [a[n] for n, t in zip(names, is_t) if t]


def _outputs(op, a, ret):
    outs = [a[n] for n in cases.mutated_args(op) if a[n] is not None]
    if ret is not None:
        outs += [r for r in ret if r is not None]
    return [_raw(t) for t in outs]


COMPILE_PARAMS = [pytest.param(op, fmt, dyn, id=f"{op}-{fmt}-{'dynamic' if dyn else 'static'}")
                  for op in SCHEMAS for fmt in ("fp8", "mxfp4") for dyn in (False, True)
                  if not (dyn and fmt == "mxfp4")]


@pytest.mark.parametrize("op, fmt, dynamic", COMPILE_PARAMS)
def test_op_compiles_fullgraph(op, fmt, dynamic):
    torch._dynamo.reset()
    a = cases.op_args(op, fmt)
    ea = _clone_args(a)
    eager = _outputs(op, ea, cases.call(op, ea))

    ca = _clone_args(a)
    fn, tensors = _as_fn(op, ca)
    expl = torch._dynamo.explain(fn)(*[t.clone() for t in tensors])
    assert expl.graph_break_count == 0 and expl.graph_count == 1, expl.break_reasons
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("inductor")
    ret = torch.compile(fn, backend=cnt, fullgraph=True, dynamic=dynamic)(*tensors)
    # One graph holds the op; with dynamic=True Dynamo may also hand the backend an empty graph.
    ours = [g for g in cnt.graphs if f"sparse_indexer.{op}" in g.code]
    assert len(ours) == 1
    for g in cnt.graphs:
        if g is not ours[0]:
            assert not [n for n in g.graph.nodes if n.op not in ("placeholder", "output")], g.code
    got = _outputs(op, ca, ret)
    assert len(got) == len(eager)
    for g, e in zip(got, eager):
        assert torch.equal(g, e)


# ----------------------------------------------------------------------------------------------------
# End-to-end steps, post-grad graph pinned
# ----------------------------------------------------------------------------------------------------

MC, TOPK, CBS, NB = 48, 8, 8, 3
FMT, BS, D, H = "fp8", 16, 64, 8


def _step_inputs(gen):
    """A cache with 2 requests (lengths 30 and 45), 10 new tokens to write, prefill rows over the gathered
    K and MTP decode rows over the cache."""
    cache = formats.allocate_k_cache(8, BS, D, FMT)
    bt = torch.tensor([[5, 0, -1, -1], [3, 7, 1, -1]], dtype=torch.int32)
    seq = [30, 45]
    slots = torch.tensor([5 * BS + i for i in range(16)] + [0 * BS + i for i in range(14)] +
                         [3 * BS + i for i in range(16)] + [7 * BS + i for i in range(16)] +
                         [1 * BS + i for i in range(13)])
    k_new = torch.randn(sum(seq), D, generator=gen)
    cu = torch.tensor([0, 30, 75], dtype=torch.int32)
    kbuf = torch.zeros(75, D, dtype=formats.FP8_DTYPE)
    kscale = torch.zeros(75)
    ks = torch.tensor([0, 0, 30, 30, 30], dtype=torch.int32)
    ke = torch.tensor([10, 30, 31, 60, 75], dtype=torch.int32)
    qp = cases.queries(5, H, D, FMT, gen)
    lens = torch.tensor([30, 43, 44, 45], dtype=torch.int32)
    req = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    qd = cases.queries(4, H, D, FMT, gen)
    return dict(k_new=k_new, slots=slots, cache=cache, bt=bt, cu=cu, kbuf=kbuf, kscale=kscale, q=qp.q,
                w=qp.weights, ks=ks, ke=ke, qd=qd.q, wd=qd.weights, lens=lens, req=req)


def dense_step(k_new, slots, cache, bt, cu, kbuf, kscale, q, w, ks, ke, qd, wd, lens, req,
               ws, idx, cb, ws2, idx2, cb2):
    ops.write_k_cache(k_new, slots, cache, FMT, True)
    ops.gather_k(cache, bt, cu, kbuf, kscale, FMT)
    ops.indexer_prefill(q, None, kbuf, kscale, w, ks, ke, MC, TOPK, CBS, ws, idx, cb)
    ops.indexer_decode(qd, None, cache, wd, lens, bt, req, MC, TOPK, CBS, ws2, idx2, cb2)


def sparse_step(k_new, slots, cache, bt, cu, kbuf, kscale, q, w, ks, ke, qd, wd, lens, req,
                cb, cb2, ws, idx, ws2, idx2):
    ops.write_k_cache(k_new, slots, cache, FMT, True)
    ops.gather_k(cache, bt, cu, kbuf, kscale, FMT)
    ops.sparse_indexer_prefill(q, None, kbuf, kscale, w, ks, ke, cb, CBS, TOPK, ws, idx)
    ops.sparse_indexer_decode(qd, None, cache, wd, lens, bt, req, cb2, CBS, TOPK, ws2, idx2)


_ORDER = ["k_new", "slots", "cache", "bt", "cu", "kbuf", "kscale", "q", "w", "ks", "ke", "qd", "wd", "lens", "req"]


def _dense_buffers():
    return dict(ws=torch.zeros(workspace.dense_workspace_bytes(5, MC), dtype=torch.uint8),
                idx=torch.zeros(5, TOPK, dtype=torch.int32), cb=torch.zeros(5, NB, dtype=torch.int32),
                ws2=torch.zeros(workspace.dense_workspace_bytes(4, MC), dtype=torch.uint8),
                idx2=torch.zeros(4, TOPK, dtype=torch.int32), cb2=torch.zeros(4, NB, dtype=torch.int32))


def _sparse_buffers(cb, cb2):
    return dict(cb=cb, cb2=cb2, ws=torch.zeros(workspace.sparse_workspace_bytes(5, NB, CBS), dtype=torch.uint8),
                idx=torch.zeros(5, TOPK, dtype=torch.int32),
                ws2=torch.zeros(workspace.sparse_workspace_bytes(4, NB, CBS), dtype=torch.uint8),
                idx2=torch.zeros(4, TOPK, dtype=torch.int32))


_CALL = re.compile(r"= (torch\.ops\.[\w.]+\(.*?\))(;|$)")


def normalize_post_grad(text):
    """The op-call lines of a post-grad graph log, without annotations and ``x = None`` bookkeeping."""
    lines = []
    for line in text.splitlines():
        m = _CALL.search(line)
        if m:
            lines.append(m.group(1))
    return lines


def _compile_capture(fn, args):
    torch._dynamo.reset()
    stream, ctx = logs_to_string("torch._inductor.compile_fx", "post_grad_graphs")
    # Caches off: a cache hit would skip the post-grad passes and their log.
    with ctx(), torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return stream.getvalue(), "\n".join(code)


def _check_reinplaced(post_grad, code, our_ops):
    """No functionalization left: our ops called on graph inputs, no clone / auto_functionalized anywhere,
    and the only ``copy_`` nodes are the input-mutation epilogue's self-copies ``copy_(argN, argN)``, which
    Inductor drops (the generated code must contain no copy at all)."""
    for text in (post_grad, code):
        assert "auto_functionalized" not in text
        assert not re.search(r"aten\.clone|\.clone\(|clone_default", text)
    calls = normalize_post_grad(post_grad)
    for c in calls:
        if c.startswith("torch.ops.aten.copy_"):
            dst, src = re.match(r"torch\.ops\.aten\.copy_\.default\((\w+), (\w+)\)", c).groups()
            assert dst == src and dst.startswith("arg"), c
        else:
            assert c.startswith("torch.ops.sparse_indexer."), c
    assert not re.search(r"aten\.copy|\.copy_\(|\bcopy_\b", code)
    ours = [c for c in calls if c.startswith("torch.ops.sparse_indexer.")]
    assert [re.match(r"torch\.ops\.sparse_indexer\.(\w+)\.", c).group(1) for c in ours] == our_ops
    for op in our_ops:
        assert f"torch.ops.sparse_indexer.{op}.default(" in code
    return "\n".join(ours)


class TestPinnedGraphs(expecttest.TestCase):
    def _inputs(self):
        return _step_inputs(torch.Generator().manual_seed(1234))

    def _run(self, fn, base, bufs, names):
        eager = {n: v.clone() for n, v in {**base, **bufs}.items()}
        fn(*[eager[n] for n in names])
        comp = {n: v.clone() for n, v in {**base, **bufs}.items()}
        post_grad, code = _compile_capture(fn, [comp[n] for n in names])
        for n in names:  # every buffer the step writes matches eager, byte for byte
            self.assertTrue(torch.equal(_raw(comp[n]), _raw(eager[n])), n)
        return post_grad, code, eager

    def test_dense_step_reinplaced(self):
        base = self._inputs()
        names = _ORDER + ["ws", "idx", "cb", "ws2", "idx2", "cb2"]
        post_grad, code, eager = self._run(dense_step, base, _dense_buffers(), names)
        self.assertFalse(bool((eager["cb"] < 0).all()), "the dense step published no block")
        pinned = _check_reinplaced(post_grad, code, ["write_k_cache", "gather_k", "indexer_prefill",
                                                     "indexer_decode"])
        self.assertExpectedInline(pinned, """\
torch.ops.sparse_indexer.write_k_cache.default(arg0_1, arg1_1, arg2_1, 'fp8', True)
torch.ops.sparse_indexer.gather_k.default(arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, 'fp8')
torch.ops.sparse_indexer.indexer_prefill.default(arg7_1, None, arg5_1, arg6_1, arg8_1, arg9_1, arg10_1, 48, 8, 8, arg11_1, arg12_1, arg13_1)
torch.ops.sparse_indexer.indexer_decode.default(arg14_1, None, arg2_1, arg15_1, arg16_1, arg3_1, arg17_1, 48, 8, 8, arg18_1, arg19_1, arg20_1)""")

    def test_sparse_step_reinplaced(self):
        base = self._inputs()
        dense = {n: v.clone() for n, v in {**base, **_dense_buffers()}.items()}
        dense_step(*[dense[n] for n in _ORDER + ["ws", "idx", "cb", "ws2", "idx2", "cb2"]])
        names = _ORDER + ["cb", "cb2", "ws", "idx", "ws2", "idx2"]
        post_grad, code, _ = self._run(sparse_step, base, _sparse_buffers(dense["cb"], dense["cb2"]), names)
        pinned = _check_reinplaced(post_grad, code, ["write_k_cache", "gather_k", "sparse_indexer_prefill",
                                                     "sparse_indexer_decode"])
        self.assertExpectedInline(pinned, """\
torch.ops.sparse_indexer.write_k_cache.default(arg0_1, arg1_1, arg2_1, 'fp8', True)
torch.ops.sparse_indexer.gather_k.default(arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, 'fp8')
torch.ops.sparse_indexer.sparse_indexer_prefill.default(arg7_1, None, arg5_1, arg6_1, arg8_1, arg9_1, arg10_1, arg11_1, 8, 8, arg12_1, arg13_1)
torch.ops.sparse_indexer.sparse_indexer_decode.default(arg14_1, None, arg2_1, arg15_1, arg16_1, arg3_1, arg17_1, arg18_1, 8, 8, arg19_1, arg20_1)""")


_GOOD_POST = """
        write_k_cache_default = torch.ops.sparse_indexer.write_k_cache.default(arg0_1, arg1_1, arg2_1, 'fp8', True)
        copy_: "u8[8, 16, 68][1088, 68, 1]cpu" = torch.ops.aten.copy_.default(arg2_1, arg2_1)"""
_GOOD_CODE = "        torch.ops.sparse_indexer.write_k_cache.default(arg0_1, arg1_1, arg2_1, 'fp8', True)"


@pytest.mark.parametrize("where,old,new", [
    ("post", "write_k_cache_default = torch.ops.sparse_indexer.write_k_cache.default(arg0_1,",
     "auto_functionalized_v2 = torch.ops.higher_order.auto_functionalized_v2(torch.ops.sparse_indexer."
     "write_k_cache.default, arg0_1,"),
    ("post", "copy_.default(arg2_1, arg2_1)", "clone.default(arg2_1)"),
    ("post", "copy_.default(arg2_1, arg2_1)", "copy_.default(arg2_1, buf0)"),
    ("post", "write_k_cache.default(arg0_1", "gather_k.default(arg0_1"),
    ("code", "torch.ops.sparse_indexer.write_k_cache.default(arg0_1",
     "buf0 = arg2_1.clone(); torch.ops.sparse_indexer.write_k_cache.default(arg0_1"),
    ("code", "torch.ops.sparse_indexer.write_k_cache.default(arg0_1",
     "aten.copy_(arg2_1, buf0); torch.ops.sparse_indexer.write_k_cache.default(arg0_1"),
])
def test_reinplace_check_catches_each_leftover(where, old, new):
    """The check on hand-made text: a graph as the step compiles passes, and each kind of leftover of
    functionalization (an auto_functionalized call, a clone, a copy between buffers, another op or order) fails."""
    assert _check_reinplaced(_GOOD_POST, _GOOD_CODE, ["write_k_cache"]) == _GOOD_CODE.strip()
    post, code = _GOOD_POST, _GOOD_CODE
    if where == "post":
        assert old in post
        post = post.replace(old, new)
    else:
        assert old in code
        code = code.replace(old, new)
    with pytest.raises(AssertionError):
        _check_reinplaced(post, code, ["write_k_cache"])


def test_reinplace_check_is_not_vacuous():
    """With Inductor's re-inplacing pass replaced by one that re-inplaces nothing (every mutated base marked for a
    clone, as the pass leaves a write it cannot prove safe) the same step keeps clones, and the check fails."""
    import unittest.mock
    from torch._inductor.fx_passes import post_grad
    if not hasattr(post_grad, "reinplace_inplaceable_ops"):
        pytest.skip("this torch has no reinplace_inplaceable_ops pass to replace")
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++")):
        pytest.skip("the clones of the un-reinplaced graph need Inductor's C++ backend (no compiler here)")
    d = _step_inputs(torch.Generator().manual_seed(0))

    def write_only(k_new, slots, cache):
        ops.write_k_cache(k_new, slots, cache, FMT, True)

    marked = []

    def clone_every_base(*args, **kwargs):
        # Switching the pass off is not enough: torch 2.11 then clones nothing (the decomposition's default), 2.13+
        # clones every base. Marking every base is what the pass itself does with a write it cannot re-inplace.
        for node in args[-1].nodes:
            if node.target is torch.ops.higher_order.auto_functionalized_v2:
                node.meta["only_clone_these_tensors"] = list(range(len(node.kwargs["_all_bases"])))
                marked.append(node)
    with unittest.mock.patch.object(post_grad, "reinplace_inplaceable_ops", clone_every_base):
        post, code = _compile_capture(write_only, [d["k_new"], d["slots"], d["cache"]])
    torch._dynamo.reset()
    assert marked, "no auto_functionalized_v2 call reached the replaced pass (Inductor no longer calls it by this name?)"
    with pytest.raises(AssertionError):
        _check_reinplaced(post, code, ["write_k_cache"])
    post, code = _compile_capture(write_only, [d["k_new"], d["slots"], d["cache"]])
    _check_reinplaced(post, code, ["write_k_cache"])
