"""``torch.library.opcheck`` (all default checks: schema, autograd registration, fake tensor, AOT dispatch
with dynamic shapes) on every op, on several input sets each: both formats, empty and odd shapes, the 4-D
cache view, bf16 logits / weights, optional tensors None and present, padded (strided) logits rows."""
from __future__ import annotations

import pytest
import torch

from torch_sparse_indexer import formats, workspace
from torch_sparse_indexer.ops import SCHEMAS

import cases

PREFILL = {"mqa_logits", "sparse_mqa_logits", "indexer_prefill", "sparse_indexer_prefill"}
DECODE = {"paged_mqa_logits", "paged_sparse_mqa_logits", "indexer_decode", "sparse_indexer_decode"}
LOGITS_OUT = {"mqa_logits", "paged_mqa_logits", "sparse_mqa_logits", "paged_sparse_mqa_logits"}
LOGITS_IN = {"topk", "sparse_topk", "block_topk"}


def _padded_rows(t):
    """Same values in rows padded apart (stride(0) > width, stride(1) == 1): allowed for logits."""
    base = torch.zeros(t.shape[0], t.shape[1] + 5, dtype=t.dtype)
    v = base[:, : t.shape[1]]
    v.copy_(t)
    return v


def variants(op):
    """(id, argument dict) input sets for ``op``."""
    out = [("fp8", cases.op_args(op, "fp8")), ("mxfp4", cases.op_args(op, "mxfp4", D=128, H=4))]
    if op == "write_k_cache":
        a = cases.op_args(op, "mxfp4", BS=64)
        a["kv_cache"] = a["kv_cache"].unsqueeze(2)
        a["k"] = a["k"].to(torch.bfloat16)
        out.append(("4d-bf16", a))
        a = cases.op_args(op, "fp8")
        a["k"], a["slot_mapping"] = a["k"][:0], a["slot_mapping"][:0].to(torch.int32)
        out.append(("empty-int32-slots", a))
    elif op == "gather_k":
        a = cases.op_args(op, "fp8")
        a["kv_cache"] = a["kv_cache"].unsqueeze(2)
        out.append(("4d", a))
        a = cases.op_args(op, "mxfp4")
        a["k"], a["k_scale"] = a["k"][:0].clone(), a["k_scale"][:0].clone()
        a["cu_seq_lens"] = torch.zeros(1, dtype=torch.int32)
        out.append(("empty", a))
    elif op == "quantize_q":
        a = cases.op_args(op, "fp8", T=0)
        out.append(("empty", a))
        a = cases.op_args(op, "mxfp4", H=5)
        a["q"], a["weights"] = a["q"].to(torch.bfloat16), a["weights"].to(torch.bfloat16)
        out.append(("bf16-odd-heads", a))
    else:
        out.append(("empty", cases.op_args(op, "fp8", T=0)))
        a = cases.op_args(op, "mxfp4", H=64, T=5, L=13)
        if "q" in a:
            a["q"] = a["q"].view(torch.int8)
        if isinstance(a.get("k"), torch.Tensor):
            a["k"] = a["k"].view(torch.int8)
        if "weights" in a:
            a["weights"] = a["weights"].to(torch.bfloat16)
        if op in LOGITS_OUT | LOGITS_IN:
            a["logits"] = _padded_rows(a["logits"].to(torch.bfloat16))
        out.append(("odd-int8-bf16", a))
        if op in DECODE:
            a = cases.op_args(op, "fp8", T=5, BS=64)
            a["kv_cache"] = a["kv_cache"].unsqueeze(2)
            a["req_indices"] = torch.tensor([0, 0, 1, 1, 0], dtype=torch.int32)
            a["block_table"] = a["block_table"][:2].clone()
            out.append(("4d-req-indices", a))
        if op in {"indexer_prefill", "indexer_decode"}:
            a = cases.op_args(op, "fp8")
            a["candidate_blocks"] = None
            out.append(("no-candidates", a))
        if op in PREFILL:
            a = cases.op_args(op, "fp8", N=0)
            out.append(("no-keys", a))
    return out


PARAMS = [pytest.param(op, vid, a, id=f"{op}-{vid}") for op in SCHEMAS for vid, a in variants(op)]


ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _raw(t):
    return t.detach().reshape(-1).view(torch.uint8).clone() if t.numel() else t.detach().clone()


def _schema_check_bytes(op, a):
    """What ``test_schema`` checks, by bytes: only the ``(a!)`` arguments change, mutable ops return None.
    (Its SchemaCheckMode compares with ``torch.allclose``, which has no float8 kernel.)"""
    a = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in a.items()}
    before = {n: _raw(v) for n, v in a.items() if isinstance(v, torch.Tensor)}
    ret = cases.call(op, a)
    writes = set(cases.mutated_args(op))
    for n, b in before.items():
        if n not in writes:
            assert torch.equal(_raw(a[n]), b), f"{op} wrote its input {n}"
    if writes:
        assert ret is None


@pytest.mark.parametrize("op, vid, a", PARAMS)
def test_opcheck(op, vid, a):
    cases.call(op, {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in a.items()})  # valid as given
    args = tuple(a[n] for n in cases.arg_names(op))
    has_fp8 = any(isinstance(v, torch.Tensor) and v.dtype == formats.FP8_DTYPE for v in args)
    checks = ALL_CHECKS[1:] if has_fp8 else ALL_CHECKS
    if has_fp8:
        _schema_check_bytes(op, a)
    result = torch.library.opcheck(getattr(torch.ops.sparse_indexer, op), args, test_utils=checks)
    assert set(result) == set(checks) and all(v == "SUCCESS" for v in result.values()), result


def test_every_op_is_opchecked():
    assert {p.values[0] for p in PARAMS} == set(SCHEMAS)


def test_fake_outputs_match_real(device):
    """quantize_q (the op with outputs): the fake's dtype, shape, strides equal the real outputs'."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    for fmt in ("fp8", "mxfp4"):
        a = cases.op_args("quantize_q", fmt)
        real = cases.call("quantize_q", {n: (v.to(device) if isinstance(v, torch.Tensor) else v) for n, v in a.items()})
        with FakeTensorMode() as mode:
            fa = {n: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for n, v in a.items()}
            fake = cases.call("quantize_q", fa)
        for r, f in zip(real, fake):
            if r is None:
                assert f is None
                continue
            assert (r.dtype, r.shape, r.stride(), r.storage_offset()) == (f.dtype, f.shape, f.stride(), f.storage_offset())


@pytest.mark.parametrize("op", sorted(set(SCHEMAS) - {"gather_k"}))  # (gather_k has no float input)
def test_not_differentiable(op):
    """Float inputs that require grad are accepted; nothing the op writes or returns requires grad or carries a
    grad_fn, on the reference backend too (a PyTorch backend must not record an autograd graph through its
    writes), and no autograd warning is raised."""
    import warnings
    a = cases.op_args(op, "fp8")
    schema = getattr(torch.ops.sparse_indexer, op).default._schema
    written = {x.name for x in schema.arguments if x.alias_info is not None and x.alias_info.is_write}
    grads = []
    for n, v in a.items():
        if isinstance(v, torch.Tensor) and n not in written and v.dtype in (torch.float32, torch.bfloat16):
            a[n] = v.detach().clone().requires_grad_()
            grads.append(n)
    assert grads, f"{op}: no float input to make require grad"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ret = cases.call(op, a)
    outs = [a[n] for n in written if isinstance(a[n], torch.Tensor)]
    outs += [r for r in (ret if isinstance(ret, tuple) else ()) if isinstance(r, torch.Tensor)]
    assert outs, f"{op}: nothing written or returned"
    for t in outs:
        assert not t.requires_grad and t.grad_fn is None, f"{op}: an output requires grad ({t.grad_fn})"
