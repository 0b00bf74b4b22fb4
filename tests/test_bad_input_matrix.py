"""The bad-input matrix of docs/bad_inputs.md, as tests: the doc's table is parsed and every clause of every
cell becomes one case, so the doc and the tests cannot drift (a coverage test checks that the table names every
op of ``ops.SCHEMAS``, every class, and every tensor argument of each op in its dtype and device cells).

Outcomes: ``TypeError`` / ``ValueError`` -- raised before anything is written, message starting with the
argument's name (device cells: naming every tensor's device); ``ok`` -- accepted, outputs equal to the same call
on plain contiguous aligned copies; ``clamped`` -- out-of-contract device values give the documented result
(the independent oracle's, tests/oracle.py), with canary bytes around every output left untouched (nothing
written out of bounds). On CUDA (gpu-marked) the same cases run on whatever backend dispatch picks.
"""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

from torch_sparse_indexer import backends, formats, workspace
from torch_sparse_indexer.ops import SCHEMAS
from torch_sparse_indexer.testing import calc_diff

import cases
import oracle

ops = torch.ops.sparse_indexer
DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "bad_inputs.md")
CLASSES = ("dtype", "shape", "device", "stride", "alignment", "fmt", "static", "values")
OUTCOMES = {"TypeError": TypeError, "ValueError": ValueError, "ok": None, "clamped": None}
BIG = 2 ** 31 - 1


# ----------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------

def parse_matrix(path=DOC):
    """{op: {class: cell text}} from the '| op | dtype | ... |' table."""
    rows, header = {}, None
    with open(path) as f:
        for line in f:
            if not line.startswith("|"):
                header = None if header and not line.strip() else header
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "op" and cells[1:] == list(CLASSES):
                header = cells
                continue
            if header and not set(cells[0]) <= set("-: "):
                rows[cells[0]] = dict(zip(CLASSES, cells[1:]))
    return rows


def parse_cell(cell):
    """'ValueError: a, b[tag]; ok: c' -> [(outcome, arg, tag)]; 'n/a ...' -> []."""
    if cell.startswith("n/a"):
        return []
    out = []
    for clause in cell.split(";"):
        outcome, _, items = clause.strip().partition(":")
        assert outcome in OUTCOMES, f"unknown outcome {outcome!r} in {cell!r}"
        items = re.sub(r"\([^)]*\)", "", items)  # footnote references like (C1, C4)
        for it in filter(None, (s.strip() for s in items.split(","))):
            m = re.fullmatch(r"(\w+)(?:\[(\w+)\])?", it)
            assert m, f"bad item {it!r} in {cell!r}"
            out.append((outcome, m.group(1), m.group(2)))
    return out


MATRIX = parse_matrix()
CASES = [pytest.param(op, cls, outcome, arg, tag, id=f"{op}-{cls}-{outcome}-{arg}{'-' + tag if tag else ''}")
         for op, row in MATRIX.items() for cls in CLASSES for outcome, arg, tag in parse_cell(row[cls])]


def _tensor_args(op):
    return [a.name for a in getattr(ops, op).default._schema.arguments
            if "Tensor" in str(a.type)]


def test_matrix_covers_every_op_class_and_argument():
    assert set(MATRIX) == set(SCHEMAS), f"ops missing from the doc: {set(SCHEMAS) - set(MATRIX)}; " \
                                        f"not ops: {set(MATRIX) - set(SCHEMAS)}"
    for op, row in MATRIX.items():
        assert set(row) == set(CLASSES), op
        for cls in ("dtype", "device"):
            named = {arg for _, arg, _ in parse_cell(row[cls])}
            assert named == set(_tensor_args(op)), (op, cls, set(_tensor_args(op)) ^ named)
        for cls in ("shape",):
            named = {arg for _, arg, _ in parse_cell(row[cls])}
            assert named == set(_tensor_args(op)), (op, cls, set(_tensor_args(op)) ^ named)
        index_like = {"ks", "ke", "context_lens", "block_table", "req_indices", "lengths", "slot_mapping",
                      "cu_seq_lens", "positions"}
        if index_like & set(_tensor_args(op)):
            assert parse_cell(row["values"]), f"{op}: takes device index values but documents no handling"


# ----------------------------------------------------------------------------------------------------
# Building a call and breaking one argument
# ----------------------------------------------------------------------------------------------------

def _base(op, fmt, device):
    a = cases.op_args(op, fmt)
    return {n: (v.to(device) if isinstance(v, torch.Tensor) else v) for n, v in a.items()}


def _rows_of(op, a):
    for n in ("q", "logits", "k", "context_lens"):
        if isinstance(a.get(n), torch.Tensor):
            return a[n].shape[0] if not (op.startswith("cp_") and a[n].dim() == 3) else a[n].shape[1]
    return a["scores"].shape[1]


_WRONG = {"q": torch.float32, "q_scale": torch.float32, "k_scale": torch.float16, "weights": torch.float16,
          "logits": torch.float16, "kv_cache": torch.int8, "workspace": torch.int32, "slot_mapping": torch.float32,
          "scores": torch.float16}


def wrong_dtype(op, arg):
    if arg == "q" and op == "quantize_q":
        return torch.int32
    if arg == "k":
        return torch.int32 if op == "write_k_cache" else torch.float16
    return _WRONG.get(arg, torch.int64)


def strided(t):
    """Same values, ``stride(-1) == 2``."""
    base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    v = base[..., ::2]
    v.copy_(t)
    return v


def padded(t):
    """Same values, the last dim padded apart (``stride(-1) == 1``, not contiguous)."""
    base = torch.zeros(*t.shape[:-1], t.shape[-1] + 16, dtype=t.dtype, device=t.device)
    v = base[..., : t.shape[-1]]
    v.copy_(t)
    return v


def offset(t, nbytes):
    """Same values and shape, contiguous, starting ``nbytes`` into its storage (a multiple of the element size)."""
    es = t.element_size()
    n = nbytes // es
    flat = torch.zeros(t.numel() + n + 8, dtype=t.dtype, device=t.device)
    v = flat[n: n + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def cache_pages_apart(t, gap):
    nb, bs, bpt = t.shape
    flat = torch.zeros(nb * (bs * bpt + gap), dtype=torch.uint8, device=t.device)
    v = flat.as_strided((nb, bs, bpt), (bs * bpt + gap, bpt, 1))
    v.copy_(t)
    return v


def cache_tokens_apart(t):
    nb, bs, bpt = t.shape
    v = torch.zeros(nb, bs, bpt + 4, dtype=torch.uint8, device=t.device)[:, :, :bpt]
    v.copy_(t)
    return v


def other_device(t, device):
    dev = "meta" if device == "cpu" else "cpu"
    return torch.empty(t.shape, dtype=t.dtype, device=dev) if dev == "meta" else t.cpu()


def _shape_break(op, a, arg):
    t = a[arg]
    z = lambda *s: torch.zeros(*s, dtype=t.dtype, device=t.device)  # noqa: E731
    if arg == "q":
        return z(t.shape[0], t.shape[1], 96) if op == "quantize_q" else z(t.shape[0], 6, t.shape[2])
    if arg == "kv_cache":
        return z(t.shape[0], 24, t.shape[-1])
    if arg == "workspace":
        return t[: workspace.min_workspace_bytes(1) - 1]
    if arg in ("indices", "topk_indices", "out_positions") or (arg == "blocks" and t.dim() == 2):
        return z(t.shape[0], t.shape[1] + 1)
    if arg == "k":
        return z(t.shape[0], t.shape[1] + (64 if op == "write_k_cache" else 32))
    if arg == "block_table":
        return t[:, 0].contiguous()
    if arg == "cu_seq_lens":
        return t[:0]
    if arg == "req_indices":
        return torch.zeros(_rows_of(op, a) + 1, dtype=torch.int32, device=a["q"].device)
    if arg == "logits" or (arg == "scores" and t.dim() == 3):
        return t.unsqueeze(0)
    if arg in ("positions", "blocks"):
        return t[..., :-1].contiguous()
    return t[:-1].contiguous()


def break_arg(op, cls, arg, tag, a, device):
    """Apply the class's breakage to ``a[arg]`` (in place on the dict)."""
    t = a.get(arg)
    if cls == "dtype":
        shape = t.shape if isinstance(t, torch.Tensor) else (_rows_of(op, a),)
        a[arg] = torch.zeros(shape, dtype=wrong_dtype(op, arg), device=device)
    elif cls == "shape":
        a[arg] = _shape_break(op, a, arg)
    elif cls == "device":
        if t is None:
            t = torch.zeros(_rows_of(op, a), dtype=torch.int32, device=device)
        a[arg] = other_device(t, device)
    elif cls == "stride":
        if tag == "padded":
            a[arg] = padded(t)
        elif tag == "tokens":
            a[arg] = cache_tokens_apart(t)
        elif tag == "pagepad":
            a[arg] = cache_pages_apart(t, 16)
        else:
            if t is None:
                t = torch.zeros(_rows_of(op, a), dtype=torch.int32, device=device)
            a[arg] = strided(t)
    elif cls == "alignment":
        if tag == "pagestride":
            a[arg] = cache_pages_apart(t, 2)
        elif tag == "offset4":
            a[arg] = offset(t, 4)
        elif arg == "kv_cache":
            a[arg] = offset(t, 2)
        elif arg == "workspace":
            a[arg] = offset(t, 1)
        else:
            a[arg] = offset(t, t.element_size())
    elif cls == "fmt":
        if arg == "fmt":
            a["fmt"] = "fp4"
        elif tag == "other" and "fmt" in a:  # write_k_cache / gather_k: the other fmt string on this cache
            a["fmt"] = "mxfp4" if a["fmt"] == "fp8" else "fp8"
        elif tag == "other" and arg == "k":
            other = _base("mqa_logits", "mxfp4", device)
            a["k"], a["k_scale"] = other["k"], other["k_scale"]
        elif tag == "other" and arg == "kv_cache":
            D = 64
            a["kv_cache"] = formats.allocate_k_cache(t.shape[0], t.shape[1], D, "mxfp4", device)
        elif tag == "given":
            a["q_scale"] = torch.zeros(a["q"].shape[:2], dtype=torch.int32, device=device)
        elif tag == "missing":
            a["q_scale"] = None
    elif cls == "static":
        a[arg] = {"0": 0, "5000": 5000, "12": 12, "div": 32, "nan": float("nan"), "inf": float("inf")}[tag]
    else:
        raise AssertionError(cls)


def _outputs(op, a):
    return {n: a[n] for n in cases.mutated_args(op) if isinstance(a.get(n), torch.Tensor)}


def _raw(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def _call(op, a):
    return cases.call(op, a)


# ----------------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------------

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, cls, outcome, arg, tag", CASES)
def test_bad_input_matrix(device, op, cls, outcome, arg, tag):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fmt = "mxfp4" if tag in ("mxfp4", "missing") else "fp8"
    if cls == "values":
        return _check_values(op, arg, fmt, device)
    a = _base(op, fmt, device)
    clean = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in a.items()}
    break_arg(op, cls, arg, tag, a, device)
    if outcome == "ok":
        _call(op, clean)
        ret = _call(op, a)
        for n, t in _outputs(op, clean).items():
            assert torch.equal(_raw(a[n]), _raw(t)), f"{n} differs from the contiguous/aligned call"
        if ret is not None:
            ref = _call(op, {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in clean.items()})
            for x, y in zip(ret, ref):
                assert (x is None) == (y is None) and (x is None or torch.equal(_raw(x), _raw(y)))
        return
    before = {n: _raw(t) for n, t in _outputs(op, a).items() if t.device.type != "meta"}
    with pytest.raises(OUTCOMES[outcome]) as ei:
        _call(op, a)
    msg = str(ei.value)
    if cls == "device":
        dev = "meta" if device == "cpu" else "cpu"
        assert f"{arg}={dev}" in msg and "one device" in msg, msg
    else:
        assert msg.startswith(f"{arg}:"), msg
        assert "expected" in msg and "got" in msg, msg
    for n, raw in before.items():
        assert torch.equal(_raw(a[n]), raw), f"{n} written before the error"


# ----------------------------------------------------------------------------------------------------
# Out-of-contract device values: documented result, nothing out of bounds
# ----------------------------------------------------------------------------------------------------

def _oob_values(op, arg, a, device):
    """Put out-of-contract values into ``a[arg]`` (see docs/bad_inputs.md C1-C8)."""
    i32 = dict(dtype=torch.int32, device=device)
    R = _rows_of(op, a)
    if arg == "ks":
        N = a["k"].shape[0]
        a["ks"] = torch.tensor([-5, N + 7, 4, -BIG, BIG][:R], **i32)
    elif arg == "ke":
        N = a["k"].shape[0]
        a["ke"] = torch.tensor([N + 9, -2, 1, BIG, -BIG][:R], **i32)
    elif arg == "context_lens":
        a["context_lens"] = torch.tensor([-3, BIG, 1000, -BIG, 7][:R], **i32)
    elif arg == "req_indices":
        nreq = a["block_table"].shape[0]
        a["req_indices"] = torch.tensor([-1, BIG, nreq, 0, 1][:R], **i32)
    elif arg == "block_table":
        bt = a["block_table"].clone()
        nb = formats.as_3d_cache(a["kv_cache"]).shape[0]
        bt[0, -1] = -1
        bt[min(1, bt.shape[0] - 1), 0] = nb + 5
        bt[-1, 0] = BIG
        a["block_table"] = bt
    elif arg == "candidate_blocks":
        cb = a["candidate_blocks"].clone()
        cb[0, 0] = -1
        cb[min(1, R - 1), -1] = BIG // 64
        cb[-1, 0] = 1000
        a["candidate_blocks"] = cb
    elif arg == "lengths":
        a["lengths"] = torch.tensor([-BIG, BIG, -1, 100000, 0][:R], **i32)
    elif arg == "slot_mapping":
        nb, bs = a["kv_cache"].shape[:2]
        a["slot_mapping"] = torch.tensor([-BIG, nb * bs, 2 ** 40, 3, -1], dtype=a["slot_mapping"].dtype,
                                         device=device)
    elif arg == "cu_seq_lens":
        a["cu_seq_lens"] = torch.tensor([0, 30, 5, 40], **i32)  # decreasing, past the pages, past the table
    elif arg in ("positions", "blocks"):
        p = a[arg].clone()
        p.view(-1)[::3] = -BIG
        p.view(-1)[1::5] = -5
        a[arg] = p
    else:
        raise AssertionError(arg)


def _canaried(t, pad=256):
    """A view of ``t``'s values inside a larger buffer whose extra bytes hold a known pattern."""
    n = t.numel() * t.element_size()
    buf = torch.full((n + 2 * pad,), 0xA5, dtype=torch.uint8, device=t.device)
    v = buf[pad: pad + n].view(t.dtype).view(t.shape)
    v.copy_(t)
    return v, buf, pad, n


def _run_canaried(op, a):
    outs = _outputs(op, a)
    guards = {}
    for n, t in outs.items():
        v, buf, pad, nbytes = _canaried(t.contiguous() if n != "kv_cache" else t)
        a[n] = v
        guards[n] = (buf, pad, nbytes)
    ret = _call(op, a)
    for n, (buf, pad, nbytes) in guards.items():
        b = buf.cpu()
        assert (b[:pad] == 0xA5).all() and (b[pad + nbytes:] == 0xA5).all(), f"{op} wrote outside {n}"
    return ret


def _close_scores(got, orc, mag, kernel):
    g = got.detach().cpu().double()
    assert torch.equal(torch.isneginf(g), torch.isneginf(orc)), "-inf masks differ"
    fin = ~torch.isneginf(orc)
    if kernel:
        assert calc_diff(g, orc) < 1e-5
    else:
        assert torch.all((g[fin] - orc[fin]).abs() <= 300 * 2.0 ** -24 * mag[fin] + 1e-30)


_PREFILL = ("mqa_logits", "sparse_mqa_logits", "indexer_prefill", "sparse_indexer_prefill")
_SPARSE = ("sparse_mqa_logits", "paged_sparse_mqa_logits", "sparse_indexer_prefill", "sparse_indexer_decode")


def _scores(op, a):
    """The scoring op behind ``op`` (itself, or the stage an end-to-end op composes) run on ``a``'s inputs, and
    the oracle's scores for the same inputs."""
    prefill = op in _PREFILL
    sparse = op in _SPARSE
    q = (a["q"], a["q_scale"])
    if prefill:
        src = (a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"])
        name = "sparse_mqa_logits" if sparse else "mqa_logits"
    else:
        src = (a["kv_cache"], a["weights"], a["context_lens"], a["block_table"], a["req_indices"])
        name = "paged_sparse_mqa_logits" if sparse else "paged_mqa_logits"
    if sparse:
        cb, cbs = a["candidate_blocks"], a["cbs"]
        width = cb.shape[1] * cbs
        extra = (cb, cbs)
    else:
        width = a["logits"].shape[1] if "logits" in a else a["max_context"]
        extra = ()
    out = torch.full((q[0].shape[0], width), 7.0, device=q[0].device)
    getattr(ops, name)(*q, *src, *extra, out)
    if prefill:
        orc, mag = (oracle.sparse_mqa_logits(*q, *src, cb, cbs) if sparse else
                    oracle.mqa_logits(*q, *src, width))
        n = oracle.prefill_lengths(a["ks"], a["ke"], a["k"].shape[0])
    else:
        orc, mag = (oracle.paged_sparse_mqa_logits(*q, *src, cb, cbs) if sparse else
                    oracle.paged_mqa_logits(*q, *src, width))
        n = oracle.decode_lengths(a["context_lens"], a["block_table"], a["req_indices"],
                                  formats.as_3d_cache(a["kv_cache"]).shape[1])
    kernel = backends.select(name, *q, *src, *extra, out).name != "reference"
    return name, out, orc, mag, n, kernel


def _cp_select(values, ids, valid, k):
    """oracle.select over the valid entries of each row (``values/ids [R, C]`` CPU)."""
    res = []
    for vr, ir, ok in zip(values.double().tolist(), ids.tolist(), valid.tolist()):
        res.append(oracle.select([(i, v) for v, i, o in zip(vr, ir, ok) if o], k))
    return res


def _cp_blocks(values, ids, valid, m):
    res = []
    for vr, ir, ok in zip(values.double().tolist(), ids.tolist(), valid.tolist()):
        best = {}
        for v, b, o in zip(vr, ir, ok):
            if o and (b not in best or oracle._rank(v) < oracle._rank(best[b])):
                best[b] = v
        res.append(oracle.select(list(best.items()), m))
    return res


def _flat(x):
    W, R, C = x.shape
    return x.permute(1, 0, 2).reshape(R, W * C).cpu()


def _check_values(op, arg, fmt, device):
    a = _base(op, fmt, device)
    _oob_values(op, arg, a, device)
    if op == "write_k_cache":
        expect = oracle.write_k_cache(a["k"].cpu(), a["slot_mapping"].cpu(), a["kv_cache"].cpu(), a["fmt"],
                                      a["pow2_scale"])
        _run_canaried(op, a)
        assert torch.equal(oracle.cache_pages(a["kv_cache"]), expect)
        return
    if op == "gather_k":
        N = a["k"].shape[0]
        before_v, before_s = oracle.u8(a["k"]).clone(), oracle.u8(a["k_scale"]).view(N, 4).clone()
        # C7: decreasing offsets are first clamped to their running maximum (the oracle takes them as given).
        cu = torch.cummax(a["cu_seq_lens"].cpu().clamp(min=0), dim=0).values
        ev, es = oracle.gather_k(a["kv_cache"], a["block_table"], cu, N, a["fmt"])
        _run_canaried(op, a)
        gv, gs = oracle.u8(a["k"]), oracle.u8(a["k_scale"]).view(N, 4)
        for t in range(N):
            assert gv[t].tolist() == (before_v[t] if ev[t] is None else ev[t]).tolist(), t
            assert gs[t].tolist() == (before_s[t] if es[t] is None else es[t]).tolist(), t
        return
    if op in ("topk", "sparse_topk", "block_topk"):
        _run_canaried(op, a)
        lg = a["logits"].cpu()
        if op == "topk":
            assert a["indices"].cpu().tolist() == oracle.topk(lg, a["lengths"].cpu(), a["k"])
        elif op == "sparse_topk":
            assert a["indices"].cpu().tolist() == oracle.sparse_topk(lg, a["candidate_blocks"].cpu(), a["cbs"],
                                                                     a["lengths"].cpu(), a["k"])
        else:
            m = a["candidate_blocks"].shape[1]
            assert a["candidate_blocks"].cpu().tolist() == oracle.block_topk(lg, a["lengths"].cpu(), a["cbs"], m)
        return
    if op.startswith("cp_"):
        _run_canaried(op, a)
        if op == "cp_local_topk":
            exp = _cp_select(a["logits"].cpu(), a["positions"].cpu(), a["positions"].cpu() >= 0, a["k"])
            assert a["out_positions"].cpu().tolist() == exp
        elif op == "cp_topk_merge":
            p = _flat(a["positions"])
            assert a["indices"].cpu().tolist() == _cp_select(_flat(a["scores"]), p, p >= 0, a["k"])
        elif op == "cp_local_block_topk":
            p = a["positions"].cpu()
            ids = torch.where(p >= 0, p.div(a["cbs"], rounding_mode="floor"), -1)
            assert a["blocks"].cpu().tolist() == _cp_blocks(a["logits"].cpu(), ids, p >= 0, a["blocks"].shape[1])
        else:
            b = _flat(a["blocks"])
            m = a["candidate_blocks"].shape[1]
            assert a["candidate_blocks"].cpu().tolist() == _cp_blocks(_flat(a["scores"]), b, b >= 0, m)
        return
    # Scoring and end-to-end ops.
    name, lg, orc, mag, n, kernel = _scores(op, a)
    if op == name:
        _run_canaried(op, a)
        _close_scores(a["logits"], orc, mag, kernel)
        return
    _close_scores(lg, orc, mag, kernel)
    _run_canaried(op, a)
    k = a["topk"]
    lg = lg.cpu()
    if op in _SPARSE:
        assert a["topk_indices"].cpu().tolist() == oracle.sparse_topk(lg, a["candidate_blocks"].cpu(), a["cbs"], n, k)
    else:
        assert a["topk_indices"].cpu().tolist() == oracle.topk(lg, n, k)
        if a.get("candidate_blocks") is not None:
            m = a["candidate_blocks"].shape[1]
            assert a["candidate_blocks"].cpu().tolist() == oracle.block_topk(lg, n, a["cbs"], m)
