"""DeepGEMM-backed ops vs the other backends, in one process (``python benchmarks/bench.py --suite deepgemm``).

Rows (fp8, H = 64, D = 128, page 64; SM90 is what this suite measures):

* ``paged_mqa_logits`` / ``mqa_logits``: ``dg-raw`` (DeepGEMM's own call: metadata + kernel, its padded
  output), ``op:deepgemm`` (our op on DeepGEMM: sanitize + kernel + the masked copy into the caller's
  buffer), ``op:triton`` (our kernels), ``op:torch`` (the reference, smallest shape only).
* ``indexer_decode`` / ``indexer_prefill`` (k = 2048): ``e2e:deepgemm`` (DeepGEMM scoring, our top-k run on
  its padded buffer, no copy) vs ``e2e:composed`` (DeepGEMM disabled: the composition of our scoring op and
  top-k op through the workspace). Top-k is whatever backend ``topk`` dispatches to (shown in ``topk``).

Times: median of CUDA-graph replays (L2 flushed), eager when capture fails. Floors: decode = K bytes read /
copy bandwidth; prefill = valid-pair flops / fp8 rate. ``vs_raw_dg`` = raw DeepGEMM time / row time.
``--quick`` shrinks every shape.
"""
from __future__ import annotations

import time

import torch

import common
from torch_sparse_indexer import backends, formats, testing, workspace
from torch_sparse_indexer.kernels import deepgemm as dgb
from torch_sparse_indexer.kernels import deepgemm_translate as tr

COLUMNS = ["op", "impl", "shape", "time_us", "floor_us", "frac_floor", "tbps", "tflops", "vs_raw_dg", "topk",
           "check"]

H, D, PAGE, TOPK, CBS = 64, 128, 64, 2048, 16
DEV = "cuda"
_ops = torch.ops.sparse_indexer


def _t(fn, graph=True):
    try:
        return common.time_us(fn, graph=graph)
    except Exception as e:  # noqa: BLE001
        if graph:
            print(f"  graph timing failed ({type(e).__name__}: {str(e)[:120]}); timing eagerly")
            torch.cuda.synchronize()
            return common.time_us(fn, graph=False)
        raise


def _forced(name, fn):
    def run():
        with backends.use_backend(name):
            fn()
    return run


def _without_dg(fn):
    def run():
        backends.disable_backend("deepgemm")
        try:
            fn()
        finally:
            backends.disable_backend("deepgemm", False)
    return run


def _row(rows, raw=None, **kw):
    t, fl = kw.get("time_us"), kw.get("floor_us")
    if t and fl:
        kw["frac_floor"] = fl / t
    if t and raw:
        kw["vs_raw_dg"] = raw / t
    rows.append(common.record(**kw))
    r = rows[-1]
    print(f"  {r['op']:<18} {r['impl']:<14} {r['shape']:<22} {t or float('nan'):10.1f} us  "
          f"floor {fl or float('nan'):8.1f}  {r.get('check', '')}", flush=True)


def _has(op, name):
    return any(b.name == name for b in backends.candidates(op))


def _topk_backend(logits, lens, idx):
    try:
        return backends.select("topk", logits, lens, TOPK, idx).name
    except Exception:  # noqa: BLE001
        return "?"


def _decode_case(B, ctx, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages = B * ctx // PAGE
    cache = torch.empty(pages + 1, PAGE, D + 4, dtype=torch.uint8, device=DEV)
    vals, scales = formats.cache_views(cache, "fp8")
    vu = vals.view(torch.uint8)
    vu.copy_(torch.randint(0, 256, vu.shape, generator=g, device=DEV, dtype=torch.uint8))
    vu[(vu & 0x7F) == 0x7F] = 0x38     # no NaN codes
    scales.copy_(torch.exp2(-torch.randint(4, 8, scales.shape, generator=g, device=DEV).float()))
    bt = torch.randperm(pages, device=DEV, generator=g).view(B, -1).to(torch.int32).contiguous()
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    qs = testing.make_queries(B, H, D, "fp8", device=DEV)
    return cache, bt, lens, qs


def _agreement(ours, dg_idx, scores):
    """The check column of an end-to-end row: ``same_as_dg=True``, or how the two selections (``[R, k]`` int32
    positions, ascending then -1) differ: the rows and positions, and the largest distance of a differing
    position's score from its row's k-th score in ``scores`` (DeepGEMM's ``[R, L]`` fp32 logits, -inf past the
    row), relative to the row's largest score. FP8 logits from two kernels differ by their summation order
    (``calc_diff`` ~1e-15 here), so positions tied at the threshold to within that may swap."""
    if torch.equal(ours, dg_idx):
        return "same_as_dg=True"
    bad = (ours != dg_idx).any(1).nonzero().flatten().tolist()
    npos, gap = 0, 0.0
    for r in bad:
        a, b = set(ours[r].tolist()) - {-1}, set(dg_idx[r].tolist()) - {-1}
        diff = torch.tensor(sorted(a ^ b), device=scores.device, dtype=torch.long)
        npos += diff.numel()
        row = scores[r]
        kth = torch.topk(row, max(1, len(b))).values[-1]
        gap = max(gap, float((row[diff] - kth).abs().max() / row.max().abs().clamp_min(1e-30)))
    return f"same_as_dg=False: {len(bad)} of {ours.shape[0]} rows, {npos} positions, within {gap:.1e} of the k-th"


def bench_decode(rows, quick):
    dg = dgb.deep_gemm()
    shapes = [(32, 8192)] if quick else [(64, 16384), (64, 65536), (128, 65536), (128, 131072)]
    for i, (B, ctx) in enumerate(shapes):
        cache, bt, lens, qs = _decode_case(B, ctx)
        kbytes = B * ctx * (D + 4)
        floor = common.floor_us(kbytes)
        shape = f"B{B} ctx{ctx}"
        ctx2d = lens.view(B, 1)
        kv4 = cache.unsqueeze(2)
        q4 = qs.q.view(B, 1, H, D)

        def raw():
            meta = dg.get_paged_mqa_logits_metadata(ctx2d, PAGE, dg.get_num_sms())
            return dg.fp8_fp4_paged_mqa_logits((q4, None), kv4, qs.weights, ctx2d, bt, meta, ctx)
        theirs = raw().float()
        t_raw = _t(raw)
        _row(rows, op="paged_mqa_logits", impl="dg-raw", shape=shape, time_us=t_raw, floor_us=floor,
             tbps=kbytes / t_raw / 1e6)
        out = torch.empty(B, ctx, device=DEV)
        args = (qs.q, None, cache, qs.weights, lens, bt, None, out)
        for name in ("deepgemm", "triton") + (("reference",) if i == 0 else ()):
            if not _has("paged_mqa_logits", name):
                continue
            fn = _forced(name, lambda: _ops.paged_mqa_logits(*args))
            fn()
            torch.cuda.synchronize()
            chk = f"diff_vs_dg={testing.calc_diff(out, theirs):.1e}"
            t = _t(fn, graph=name != "reference")
            _row(rows, raw=t_raw, op="paged_mqa_logits", impl=f"op:{name}" if name != "reference" else "op:torch",
                 shape=shape, time_us=t, floor_us=floor, tbps=kbytes / t / 1e6, check=chk)
        ws = torch.empty(workspace.dense_workspace_bytes(B, ctx), dtype=torch.uint8, device=DEV)
        idx = torch.empty(B, TOPK, dtype=torch.int32, device=DEV)
        eargs = (qs.q, None, cache, qs.weights, lens, bt, None, ctx, TOPK, CBS, ws, idx, None)
        tk = _topk_backend(out, lens, idx)
        res = {}
        for impl, fn in (("e2e:deepgemm", _forced("deepgemm", lambda: _ops.indexer_decode(*eargs))),
                         ("e2e:composed", _without_dg(lambda: _ops.indexer_decode(*eargs)))):
            fn()
            torch.cuda.synchronize()
            res[impl] = idx.clone()
            t = _t(fn)
            _row(rows, raw=t_raw, op="indexer_decode", impl=impl, shape=shape + f" k{TOPK}", time_us=t,
                 floor_us=floor, topk=tk, check="" if impl == "e2e:deepgemm" else
                 _agreement(res[impl], res["e2e:deepgemm"], theirs))
        del cache, out, ws, theirs
        torch.cuda.empty_cache()


def bench_prefill(rows, quick):
    dg = dgb.deep_gemm()
    shapes = [(512, 8192)] if quick else [(2048, 16384), (2048, 65536), (4096, 131072)]
    for i, (T, S) in enumerate(shapes):
        k, ksc = testing.make_packed_k(S, D, "fp8", device=DEV, pow2_scale=False)
        qs = testing.make_queries(T, H, D, "fp8", device=DEV)
        ks = torch.zeros(T, dtype=torch.int32, device=DEV)
        ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32, device=DEV)
        flops = 2.0 * float((ke - ks).double().sum()) * H * D
        floor = common.floor_us(flops=flops)
        shape = f"T{T} S{S} causal"

        def raw():
            return dg.fp8_fp4_mqa_logits((qs.q, None), (k, ksc), qs.weights, ks, ke, S)
        theirs = raw()
        valid = torch.arange(S, device=DEV)[None, :] < (ke - ks)[:, None]
        theirs = theirs.masked_fill(~valid, float("-inf"))
        t_raw = _t(raw)
        _row(rows, op="mqa_logits", impl="dg-raw", shape=shape, time_us=t_raw, floor_us=floor,
             tflops=flops / t_raw / 1e6)
        out = torch.empty(T, S, device=DEV)
        args = (qs.q, None, k, ksc, qs.weights, ks, ke, out)
        for name in ("deepgemm", "triton"):
            if not _has("mqa_logits", name):
                continue
            fn = _forced(name, lambda: _ops.mqa_logits(*args))
            fn()
            torch.cuda.synchronize()
            chk = f"diff_vs_dg={testing.calc_diff(out, theirs):.1e}"
            t = _t(fn)
            _row(rows, raw=t_raw, op="mqa_logits", impl=f"op:{name}", shape=shape, time_us=t, floor_us=floor,
                 tflops=flops / t / 1e6, check=chk)
        del valid
        ws = torch.empty(workspace.dense_workspace_bytes(T, S), dtype=torch.uint8, device=DEV)
        idx = torch.empty(T, TOPK, dtype=torch.int32, device=DEV)
        eargs = (qs.q, None, k, ksc, qs.weights, ks, ke, S, TOPK, CBS, ws, idx, None)
        tk = _topk_backend(out, ke, idx)
        del out
        res = {}
        for impl, fn in (("e2e:deepgemm", _forced("deepgemm", lambda: _ops.indexer_prefill(*eargs))),
                         ("e2e:composed", _without_dg(lambda: _ops.indexer_prefill(*eargs)))):
            fn()
            torch.cuda.synchronize()
            res[impl] = idx.clone()
            t = _t(fn)
            _row(rows, raw=t_raw, op="indexer_prefill", impl=impl, shape=shape + f" k{TOPK}", time_us=t,
                 floor_us=floor, topk=tk, check="" if impl == "e2e:deepgemm" else
                 _agreement(res[impl], res["e2e:deepgemm"], theirs))
        del ws, k, theirs
        torch.cuda.empty_cache()


def run(args):
    quick = bool(getattr(args, "quick", False))
    why = dgb.unavailable_reason() if torch.cuda.is_available() else "no CUDA device"
    if why:
        print(f"[deepgemm] skipped: {why}")
        return [common.record(op="deepgemm", impl="SKIPPED", shape="", check=why)]
    dgb.register()
    arch = dgb._arch(torch.device(DEV))
    if arch != "sm90":
        msg = f"this suite measures the SM90 dense path; device is {arch} (SM100 rows need an SM100 machine)"
        print(f"[deepgemm] {msg}")
        return [common.record(op="deepgemm", impl="SKIPPED", shape="", check=msg)]
    t0 = time.time()
    print("[deepgemm] warmup:", dgb.warmup(DEV, H, D, "fp8", block_size=PAGE, max_rows=128), flush=True)
    print(f"[deepgemm] warmup {time.time() - t0:.0f} s (DeepGEMM JIT)")
    rows: list[dict] = []
    for name, fn in (("decode", bench_decode), ("prefill", bench_prefill)):
        t0 = time.time()
        try:
            fn(rows, quick)
        except Exception as e:  # noqa: BLE001  (one failing section must not lose the other's rows)
            import traceback
            traceback.print_exc()
            rows.append(common.record(op=name, impl="FAILED", shape="", check=repr(e)[:200]))
        print(f"[deepgemm] {name} done in {time.time() - t0:.0f} s", flush=True)
    return rows
