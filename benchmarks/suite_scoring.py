"""Scoring and cache kernels on the GPU: ours (Triton, and the CUDA decode kernels) vs DeepGEMM 2.8.2 (when
importable) vs plain PyTorch (``torch_sparse_indexer.reference``), all in one process.

Shapes (H = 64, D = 128 unless a row says otherwise; ANCHORS section 7 for DeepGEMM's figures):

* ``paged_sparse_mqa_logits``: 128 decode rows, context 16K..128K, 2048 candidate blocks of 8, page 64.
  Floor = candidate K bytes / copy bandwidth (the issue's definition).
* ``paged_mqa_logits``: 128 rows x context 16K..128K, page 64; floor = K bytes read / copy bandwidth.
* ``mqa_logits``: 4096 causal queries of one request of S = 16K..128K keys; floor = valid-pair flops / fp8 rate.
* ``sparse_mqa_logits``: 4096 queries of one 128K request, 2048 blocks of 8 each, neighbours sharing ~90%
  of their blocks; TFLOP/s counted on useful (query, candidate) pairs.
* ``write_k_cache`` / ``gather_k`` / ``quantize_q``: bytes read + written / copy bandwidth.

Each row: time (median of CUDA-graph replays, L2 flushed), floor, fraction of floor, ratio to DeepGEMM where
it has the same op, and ``calc_diff`` against DeepGEMM's output or the reference on a subset of rows.
``--quick`` shrinks every shape.
"""
from __future__ import annotations

import os
import random
import time

import torch
import triton
import triton.language as tl

import common
from torch_sparse_indexer import formats, reference, testing
from torch_sparse_indexer.kernels import cuda_scoring as cs
from torch_sparse_indexer.kernels import triton_cache as tc
from torch_sparse_indexer.kernels import triton_scoring as ts

try:
    import deep_gemm as dg  # noqa: F401
except Exception as _e:  # noqa: BLE001
    dg = None
    _DG_ERR = repr(_e)

COLUMNS = ["op", "impl", "fmt", "shape", "time_us", "floor_us", "frac_floor", "tflops", "tbps", "vs_deepgemm",
           "target", "meets", "check"]

H, D, PAGE, CBS = 64, 128, 64, 8
DEV = "cuda"


def _t(fn, graph=True, rep_ms=200):
    try:
        return common.time_us(fn, graph=graph, rep_ms=rep_ms)
    except Exception as e:  # noqa: BLE001  (capture can fail for a foreign library: time eagerly)
        if graph:
            print(f"  graph timing failed ({e!r}); timing eagerly")
            return common.time_us(fn, graph=False, rep_ms=rep_ms)
        raise


def _row(rows, **kw):
    t = kw.get("time_us")
    fl = kw.get("floor_us")
    if t and fl:
        kw["frac_floor"] = fl / t
    rows.append(common.record(**kw))
    r = rows[-1]
    print(f"  {r['op']:<24} {r['impl']:<22} {r.get('fmt', ''):<6} {r['shape']:<34} "
          f"{(r.get('time_us') or float('nan')):10.1f} us  floor {(r.get('floor_us') or float('nan')):9.1f}  "
          f"{r.get('check', '')}", flush=True)


def _random_cache(num_pages, fmt, gen_seed=0):
    """Random valid cache bytes: fp8 values without NaN codes and scales 2^-7..2^-4; mxfp4 any nibbles
    and UE8M0 bytes 120..127 (the ANCHORS setup: random e4m3 K, fixed-range scales)."""
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    vb = formats.value_bytes(fmt, D)
    cache = torch.empty(num_pages, PAGE, vb + 4, dtype=torch.uint8, device=DEV)
    vals, scales = formats.cache_views(cache, fmt)
    vu = vals.view(torch.uint8)
    vu.copy_(torch.randint(0, 256, vu.shape, generator=g, device=DEV, dtype=torch.uint8))
    if fmt == "fp8":
        vu[(vu & 0x7F) == 0x7F] = 0x38
        scales.copy_(torch.exp2(-torch.randint(4, 8, scales.shape, generator=g, device=DEV).float()))
    else:
        b = torch.randint(120, 128, (*scales.shape, 4), generator=g, device=DEV, dtype=torch.int32)
        scales.copy_(b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24))
    return cache


def _decode_setup(B, ctx, fmt, seed=0):
    pages_per = ctx // PAGE
    cache = _random_cache(B * pages_per + 1, fmt, seed)
    perm = torch.randperm(B * pages_per, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
    bt = perm.view(B, pages_per).to(torch.int32).contiguous()
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    qs = testing.make_queries(B, H, D, fmt, device=DEV)
    return cache, bt, lens, qs


def _cands(B, nblocks, nbk, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = torch.rand(B, nblocks, generator=g, device=DEV)
    return r.topk(nbk, dim=1).indices.sort(dim=1).values.to(torch.int32).contiguous()


def decode_call(kind, fmt, B=128, ctx=131072, nbk=2048, impl="triton"):
    """``(run, out)``: one decode scoring call at a target shape of this suite (``kind`` ``sparse``: 2048
    candidate blocks of 8 per row; ``dense``: every position) on the ``impl`` kernels (``triton`` or ``cuda``), for
    the development scripts (``scripts/``)."""
    mod = cs if impl == "cuda" else ts
    cache, bt, lens, qs = _decode_setup(B, ctx, fmt)
    if kind == "sparse":
        cand = _cands(B, ctx // CBS, nbk)
        out = torch.empty(B, nbk * CBS, device=DEV)
        return (lambda: mod.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, CBS,
                                                    out)), out
    out = torch.empty(B, ctx, device=DEV)
    return (lambda: mod.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, out)), out


def _ref_rows_diff(mine, ref_fn, rows):
    ref = torch.empty(rows, mine.shape[1], device=DEV)
    ref_fn(ref)
    return testing.calc_diff(mine[:rows], ref)


FAST = os.environ.get("TSI_BENCH_FAST", "0") == "1"  # target shapes only, no config sweeps / torch rows


@triton.jit
def _read_blocks(cache_ptr, bt_ptr, cand_ptr, out_ptr, NCAND, BT_STRIDE, PS, NB: tl.constexpr, BW: tl.constexpr,
                 CONTIG: tl.constexpr):
    """Sum of the bytes ``paged_sparse_mqa_logits`` reads (D 128, page 64, blocks of 8): each candidate block's BW
    int32 words of values (FP8 1 KB, MXFP4 512 B) and 32 B of scales, NB blocks per program; CONTIG: the same
    byte count back to back."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = chunk * NB + tl.arange(0, NB)
    w = tl.arange(0, BW)
    words = cache_ptr.to(tl.pointer_type(tl.int32))
    if CONTIG:
        vbase = (row.to(tl.int64) * NCAND + b) * (BW + 8)  # a block's values and scales, back to back
        sbase = vbase + BW
    else:
        blk = tl.load(cand_ptr + row.to(tl.int64) * NCAND + b)
        page = tl.load(bt_ptr + row.to(tl.int64) * BT_STRIDE + (blk >> 3)).to(tl.int64)
        off = (blk & 7).to(tl.int64)
        vbase = page * (PS // 4) + off * BW  # page stride % 16 == 0
        sbase = page * (PS // 4) + 8 * BW + off * 8  # the page's 64 tokens' values, then their scale words
    vals = tl.load(words + vbase[:, None] + w[None, :])
    sc = tl.load(words + sbase[:, None] + tl.arange(0, 8)[None, :])
    tl.store(out_ptr + row * tl.num_programs(1) + chunk, tl.sum(tl.sum(vals, 1) ^ tl.sum(sc, 1), 0))


def read_same_bytes(cache, bt, cand, contig=False, warps=8, fmt="fp8"):
    """``fn()`` reading the sparse decode's bytes with a plain load-and-sum kernel (the achievable read of that
    access pattern for a simple kernel, next to the copy-bandwidth floor), and the byte count."""
    B, nbk = cand.shape
    NB = 32
    bw = 8 * formats.value_bytes(fmt, D) // 4
    assert PAGE == 64 and D == 128 and CBS == 8 and nbk % NB == 0 and cache.stride(0) % 16 == 0
    assert cache.stride(0) == PAGE * formats.bytes_per_token(fmt, D), "cache pages of 64 tokens, no padding"
    nbytes = B * nbk * (bw + 8) * 4
    out = torch.empty(B * (nbk // NB), dtype=torch.int32, device=DEV)
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV) if contig else cache
    return (lambda: _read_blocks[(B, nbk // NB)](src, bt, cand, out, nbk, bt.stride(0), cache.stride(0), NB=NB,
                                                 BW=bw, CONTIG=contig, num_warps=warps)), nbytes

@triton.jit
def _copy_to_slots(k_ptr, slot_ptr, cache_ptr, T, PS, PAGE_: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr,
                   BT: tl.constexpr):
    """``write_k_cache``'s memory traffic without its encoding: each token's input row read whole (KW int32
    words), folded by XOR into VW words stored as the slot's values, and their XOR stored as its 4-byte scale
    word (page layout: PAGE_ tokens' values, then their scale words)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < T
    src = k_ptr.to(tl.pointer_type(tl.int32))
    row = tl.load(src + t.to(tl.int64)[:, None] * KW + tl.arange(0, KW)[None, :], mask=ok[:, None], other=0)
    vals = tl.xor_sum(tl.reshape(row, [BT, KW // VW, VW]), 1)
    slot = tl.load(slot_ptr + t, mask=ok, other=0).to(tl.int64)
    page, off = slot // PAGE_, slot % PAGE_
    dst = cache_ptr.to(tl.pointer_type(tl.int32)) + page * (PS // 4)
    tl.store(dst[:, None] + off[:, None] * VW + tl.arange(0, VW)[None, :], vals, mask=ok[:, None])
    tl.store(dst + PAGE_ * VW + off, tl.xor_sum(vals, 1), mask=ok)


def copy_to_slots(k, slot, cache, fmt, bt=32, warps=4):
    """``fn()`` moving the bytes ``write_k_cache(k, slot, cache, fmt)`` moves, to the same slots, with no
    quantization: what a memory-only kernel gets on that access pattern (random slots make every 4-byte scale
    store a partial-sector write), next to the copy-bandwidth floor. ``k [T, D]`` 16-bit, ``cache [pages, PAGE,
    bytes_per_token]``."""
    T, Dk = k.shape
    vb = formats.value_bytes(fmt, Dk)
    assert k.element_size() == 2 and k.is_contiguous() and cache.is_contiguous()
    page, ps = cache.shape[1], cache.stride(0)
    return lambda: _copy_to_slots[(triton.cdiv(T, bt),)](k, slot, cache, T, ps, PAGE_=page, KW=Dk // 2,
                                                         VW=vb // 4, BT=bt, num_warps=warps)


# Row-kernel launch configurations compared at the target shapes (triton_scoring._rows_config):
# (BLOCK_N, warps, stages, tiles per program, per-tile id loads, packed ids, register cap). Two stages and a
# register cap of 96 let 5 CTAs share an SM instead of 3-4 (shared memory / registers; MXFP4 spills under a
# cap). Paged sparse rows with per-tile id loads and three stages do not compile with triton 3.6 (a
# RemoveLayoutConversions failure): that row shows "failed" for the paged sparse shapes.
ROW_SWEEP = [(64, 4, 3, 32, False, True), (128, 4, 3, 16, False, True), (128, 4, 3, 16, True),
             (128, 4, 2, 16, True, False, 96), (128, 4, 2, 32, True, False, 96), (64, 4, 3, 32, True, False, 96),
             (64, 4, 2, 32, True, False, 80)]


# FP8 dense decode (128 x 128K) on SM90, the full 8-tuple (the last element, CTAs per SM, sizes the programs):
# the default first and last (drift), then deeper pipelines, one-page tiles at higher occupancy, wider tiles, and
# fixed 32-tile programs (CTAs per SM None: no wave sizing).
DENSE_DECODE_SWEEP = [ts._ROW_DENSE_DECODE, (128, 4, 3, 32, True, False, 96, 3), (128, 4, 2, 32, True, False, 104, 4),
                      (64, 4, 3, 64, True, False, 80, 6), (64, 4, 4, 64, True, False, 80, 5),
                      (256, 8, 2, 16, True, False, 96, 2), (128, 4, 2, 32, True, False, 96, None),
                      (128, 8, 2, 32, True, False, 64, 5), ts._ROW_DENSE_DECODE]
# The same shape through TMA tiles (triton_scoring._dense_decode_tma_kernel; CONFIG_OVERRIDES["dense_tma"]):
# (tokens per tile, warps, stages, loop iterations per program, register cap, CTAs per SM[, tiles per iteration]),
# one-page tiles at 64-token pages, deeper pipelines at fewer CTAs per SM (a stage is 8 KB of K per tile), and two
# pages per iteration (128-token steps, as the row kernel's).
DENSE_TMA_SWEEP = [(64, 4, 3, 64, None, 6), (64, 4, 4, 64, None, 5), (64, 4, 6, 64, None, 3),
                   (64, 4, 2, 64, None, 8), (64, 4, 4, 64, 96, 5), (64, 4, 2, 32, 96, 5, 2), (64, 4, 3, 32, 96, 3, 2)]


def _sweep(rows, overrides, key, configs, fn, *, op, fmt, shape, floor, nbytes=None, flops=None, check=None,
           label="triton", **extra):
    """One row per launch configuration: ``overrides[key] = cfg`` (a kernel module's ``CONFIG_OVERRIDES``),
    ``check()`` (optional) runs first and gives the row's check column, then ``fn`` is timed (impl
    ``f"{label}{cfg}"``)."""
    for cfg in configs:
        overrides[key] = cfg
        try:
            chk = check() if check else ""
            t2 = _t(fn)
            _row(rows, op=op, impl=f"{label}{cfg}", fmt=fmt, shape=shape, time_us=t2, floor_us=floor,
                 tbps=(nbytes / t2 / 1e6) if nbytes else "", tflops=(flops / t2 / 1e6) if flops else "", check=chk,
                 **extra)
        except Exception as e:  # noqa: BLE001
            print(f"  {key} config {cfg} failed: {e!r}")
        finally:
            overrides.pop(key, None)


def _sweep_rows(rows, fn, **kw):
    _sweep(rows, ts.CONFIG_OVERRIDES, "rows", ROW_SWEEP, fn, **kw)


def bench_decode(rows, quick):
    B = 16 if quick else 128
    ctxs = [16384, 32768] if quick else ([131072] if FAST else [16384, 32768, 65536, 131072])
    nbk = 256 if quick else 2048
    for ctx in ctxs:
        dg_t = None
        for fmt in ("fp8", "mxfp4"):
            cache, bt, lens, qs = _decode_setup(B, ctx, fmt)
            bpt = formats.bytes_per_token(fmt, D)
            cand = _cands(B, ctx // CBS, nbk)
            out = torch.empty(B, nbk * CBS, device=DEV)
            shape = f"B{B} ctx{ctx} nbk{nbk}x{CBS}"
            fn = lambda: ts.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand, CBS, out)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            chk = _ref_rows_diff(out, lambda ref: reference.paged_sparse_mqa_logits(
                qs.q[:4], qs.q_scale[:4] if qs.q_scale is not None else None, cache, qs.weights[:4], lens[:4],
                bt[:4], None, cand[:4], CBS, ref), 4)
            t = _t(fn)
            kbytes = B * nbk * CBS * bpt
            tgt = 85.0 if fmt == "fp8" else 50.0
            at_target = ctx == 131072 and B == 128
            # the target sits on the row of the kernel dispatch picks: CUDA for MXFP4, Triton for FP8
            dispatched = "cuda" if fmt == "mxfp4" and cs.available() else "triton"
            _row(rows, op="paged_sparse_mqa_logits", impl="triton", fmt=fmt, shape=shape, B=B, ctx=ctx, time_us=t,
                 floor_us=common.floor_us(kbytes), tbps=kbytes / t / 1e6,
                 tflops=2 * B * nbk * CBS * H * D / t / 1e6,
                 target=f"<= {tgt} us" if at_target and dispatched == "triton" else "",
                 meets=(t <= tgt) if at_target and dispatched == "triton" else "", check=f"diff_vs_ref={chk:.2e}")
            if cs.available():  # (called directly: FP8 too, which dispatch leaves to Triton)
                outc = torch.empty_like(out)
                fc = lambda: cs.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, cand,  # noqa: E731
                                                        CBS, outc)
                fc()
                torch.cuda.synchronize()
                tc = _t(fc)
                _row(rows, op="paged_sparse_mqa_logits", impl="cuda", fmt=fmt, shape=shape, B=B, ctx=ctx, time_us=tc,
                     floor_us=common.floor_us(kbytes), tbps=kbytes / tc / 1e6,
                     tflops=2 * B * nbk * CBS * H * D / tc / 1e6,
                     target=f"<= {tgt} us" if at_target and dispatched == "cuda" else "",
                     meets=(tc <= tgt) if at_target and dispatched == "cuda" else "",
                     check=f"diff_vs_triton={testing.calc_diff(outc, out):.2e}")
                del outc
            if ctx == 131072 and B == 128 and fmt == "mxfp4":
                # every tile with per-group scale multiplies: what the folded operands replaced
                ts.CONFIG_OVERRIDES["qfold"] = False
                try:
                    tg = _t(fn)
                finally:
                    ts.CONFIG_OVERRIDES.pop("qfold")
                _row(rows, op="paged_sparse_mqa_logits", impl="triton per-group scales", fmt=fmt, shape=shape, B=B,
                     ctx=ctx, time_us=tg, floor_us=common.floor_us(kbytes), tbps=kbytes / tg / 1e6)
            if ctx == 131072 and B == 128:
                try:  # context for the time above: a plain read of the same bytes in the same access pattern
                    rd, rbytes = read_same_bytes(cache, bt, cand, fmt=fmt)
                    tr = _t(rd)
                    _row(rows, op="paged_sparse_mqa_logits", impl="read (same bytes)", fmt=fmt, shape=shape, B=B,
                         ctx=ctx, time_us=tr, floor_us=common.floor_us(rbytes), tbps=rbytes / tr / 1e6)
                except Exception as e:  # noqa: BLE001
                    print(f"  read row failed: {e!r}")
            if ctx == 131072 and B == 128 and not FAST:
                _sweep_rows(rows, fn, op="paged_sparse_mqa_logits", fmt=fmt, shape=shape, B=B, ctx=ctx,
                            floor=common.floor_us(kbytes), nbytes=kbytes)
            if FAST and fmt != "fp8":
                continue
            # dense decode over the same cache
            outd = torch.empty(B, ctx, device=DEV)
            fnd = lambda: ts.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, outd)  # noqa: E731
            fnd()
            torch.cuda.synchronize()
            dbytes = B * ctx * bpt
            chk = _ref_rows_diff(outd, lambda ref: reference.paged_mqa_logits(
                qs.q[:2], qs.q_scale[:2] if qs.q_scale is not None else None, cache, qs.weights[:2], lens[:2],
                bt[:2], None, ref), 2)
            extra = ""
            if fmt == "fp8" and dg is not None:
                try:
                    meta = dg.get_paged_mqa_logits_metadata(lens.view(B, 1), PAGE, common_sms())
                    kv4 = cache.view(-1, PAGE, 1, D + 4)
                    q4 = qs.q.view(B, 1, H, D)
                    fdg = lambda: dg.fp8_fp4_paged_mqa_logits((q4, None), kv4, qs.weights, lens.view(B, 1), bt, meta, ctx)  # noqa: E731
                    theirs = fdg()
                    torch.cuda.synchronize()
                    extra = f" diff_vs_dg={testing.calc_diff(outd, theirs.float()):.2e}"
                    dg_t = _t(fdg)
                    _row(rows, op="paged_mqa_logits", impl="deepgemm", fmt=fmt, shape=f"B{B} ctx{ctx}", B=B, ctx=ctx,
                         time_us=dg_t, floor_us=common.floor_us(dbytes), tbps=dbytes / dg_t / 1e6)
                except Exception as e:  # noqa: BLE001
                    print(f"  deepgemm paged failed: {e!r}")
            t = _t(fnd)
            if ctx == 131072 and B == 128 and not FAST and fmt == "fp8":
                base = outd.clone()

                def same_as_default():
                    outd.fill_(float("nan"))
                    fnd()
                    return (f"vs_default bitwise={bool(torch.equal(outd, base))} "
                            f"diff={testing.calc_diff(outd, base):.1e}")

                for key, configs in (("rows", DENSE_DECODE_SWEEP), ("dense_tma", DENSE_TMA_SWEEP)):
                    _sweep(rows, ts.CONFIG_OVERRIDES, key, configs, fnd, op="paged_mqa_logits", fmt=fmt,
                           shape=f"B{B} ctx{ctx}", B=B, ctx=ctx, floor=common.floor_us(dbytes), nbytes=dbytes,
                           check=same_as_default, label="tma" if key == "dense_tma" else "triton")
                del base
            _row(rows, op="paged_mqa_logits", impl="triton", fmt=fmt, shape=f"B{B} ctx{ctx}", B=B, ctx=ctx,
                 time_us=t, floor_us=common.floor_us(dbytes), tbps=dbytes / t / 1e6,
                 vs_deepgemm=(dg_t / t) if (dg_t and fmt == "fp8") else "",
                 target=">= 0.9x deepgemm" if fmt == "fp8" else "",
                 meets=(dg_t / t >= 0.9) if (dg_t and fmt == "fp8") else "", check=f"diff_vs_ref={chk:.2e}{extra}")
            if cs.available():
                outdc = torch.empty_like(outd)
                fdc = lambda: cs.paged_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt, None, outdc)  # noqa: E731
                fdc()
                torch.cuda.synchronize()
                tc = _t(fdc)
                _row(rows, op="paged_mqa_logits", impl="cuda", fmt=fmt, shape=f"B{B} ctx{ctx}", B=B, ctx=ctx,
                     time_us=tc, floor_us=common.floor_us(dbytes), tbps=dbytes / tc / 1e6,
                     vs_deepgemm=(dg_t / tc) if (dg_t and fmt == "fp8") else "",
                     check=f"diff_vs_triton={testing.calc_diff(outdc, outd):.2e}")
                del outdc
            if fmt == "fp8" and ctx == ctxs[0] and not FAST:
                # plain PyTorch: the reference backend on the same inputs
                tr = _t(lambda: reference.paged_sparse_mqa_logits(qs.q, qs.q_scale, cache, qs.weights, lens, bt,
                                                                  None, cand, CBS, out), graph=False, rep_ms=50)
                _row(rows, op="paged_sparse_mqa_logits", impl="torch", fmt=fmt, shape=shape, B=B, ctx=ctx,
                     time_us=tr, floor_us=common.floor_us(kbytes))
            del cache, outd
            torch.cuda.empty_cache()


def common_sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def bench_prefill_dense(rows, quick):
    T = 512 if quick else 4096
    Ss = [8192, 16384] if quick else [16384, 32768, 65536, 131072]
    for S in Ss:
        dg_t = None
        for fmt in ("fp8", "mxfp4"):
            k, ksc = testing.make_packed_k(S, D, fmt, device=DEV, pow2_scale=(fmt != "fp8"))
            qs = testing.make_queries(T, H, D, fmt, device=DEV)
            ks = torch.zeros(T, dtype=torch.int32, device=DEV)
            ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32, device=DEV)
            pairs = float((ke - ks).double().sum())
            flops = 2 * pairs * H * D
            out = torch.empty(T, S, device=DEV)
            fn = lambda: ts.mqa_logits(qs.q, qs.q_scale, k, ksc, qs.weights, ks, ke, out)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            chk = _ref_rows_diff(out, lambda ref: reference.mqa_logits(
                qs.q[:2], qs.q_scale[:2] if qs.q_scale is not None else None, k, ksc, qs.weights[:2], ks[:2],
                ke[:2], ref), 2)
            extra = ""
            if fmt == "fp8" and dg is not None:
                try:
                    fdg = lambda: dg.fp8_fp4_mqa_logits((qs.q, None), (k, ksc), qs.weights, ks, ke, S)  # noqa: E731
                    theirs = fdg()
                    torch.cuda.synchronize()
                    valid = torch.arange(S, device=DEV)[None, :] < (ke - ks)[:, None]
                    extra = f" diff_vs_dg={testing.calc_diff(out.masked_fill(~valid, 0), theirs.float().masked_fill(~valid, 0)):.2e}"
                    del theirs, valid
                    dg_t = _t(fdg)
                    _row(rows, op="mqa_logits", impl="deepgemm", fmt=fmt, shape=f"T{T} S{S} causal", S=S,
                         time_us=dg_t, floor_us=common.floor_us(flops=flops), tflops=flops / dg_t / 1e6)
                except Exception as e:  # noqa: BLE001
                    print(f"  deepgemm prefill failed: {e!r}")
            t = _t(fn)
            _row(rows, op="mqa_logits", impl="triton", fmt=fmt, shape=f"T{T} S{S} causal", S=S, time_us=t,
                 floor_us=common.floor_us(flops=flops), tflops=flops / t / 1e6,
                 vs_deepgemm=(dg_t / t) if (dg_t and fmt == "fp8") else "",
                 target=">= 0.8x deepgemm" if fmt == "fp8" else "",
                 meets=(dg_t / t >= 0.8) if (dg_t and fmt == "fp8") else "", check=f"diff_vs_ref={chk:.2e}{extra}")
            if fmt == "fp8" and S == Ss[-1] and not quick:
                for cfg in [(128, 8, 2), (64, 4, 3), (128, 4, 3)]:
                    ts.CONFIG_OVERRIDES["prefill_dense"] = cfg
                    try:
                        t2 = _t(fn)
                        _row(rows, op="mqa_logits", impl=f"triton{cfg}", fmt=fmt, shape=f"T{T} S{S} causal", S=S,
                             time_us=t2, floor_us=common.floor_us(flops=flops), tflops=flops / t2 / 1e6)
                    except Exception as e:  # noqa: BLE001
                        print(f"  config {cfg} failed: {e!r}")
                    finally:
                        ts.CONFIG_OVERRIDES.pop("prefill_dense", None)
            if fmt == "fp8" and S == Ss[0]:
                Tr, Sr = 256, 4096
                kr, kscr = k[:Sr], ksc[:Sr]
                ker = torch.arange(Sr - Tr + 1, Sr + 1, dtype=torch.int32, device=DEV)
                outr = torch.empty(Tr, Sr, device=DEV)
                tr = _t(lambda: reference.mqa_logits(qs.q[:Tr], None, kr, kscr, qs.weights[:Tr], ks[:Tr], ker, outr),
                        graph=False, rep_ms=50)
                fl = 2 * float((ker - ks[:Tr]).double().sum()) * H * D
                _row(rows, op="mqa_logits", impl="torch", fmt=fmt, shape=f"T{Tr} S{Sr} causal", S=Sr, time_us=tr,
                     floor_us=common.floor_us(flops=fl), tflops=fl / tr / 1e6)
            del out
            torch.cuda.empty_cache()


def _shared_lists(T, S, nbk, share, seed=0):
    """Candidate lists for T causal queries of one S-token request: row i's list is row i-1's with a
    fraction (1 - share) of its blocks swapped for others valid at row i (sorted, unique)."""
    rng = random.Random(seed)
    out = torch.full((T, nbk), -1, dtype=torch.int32)
    cur = None
    for i in range(T):
        n = S - T + i + 1
        nb = (n + CBS - 1) // CBS
        if cur is None:
            cur = set(rng.sample(range(nb), min(nbk, nb)))
        else:
            swap = int(round(len(cur) * (1 - share)))
            drop = rng.sample(sorted(cur), swap)
            cur.difference_update(drop)
            while len(cur) < min(nbk, nb):
                cur.add(rng.randrange(nb))
        ids = sorted(cur)
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out.to(DEV)


def bench_prefill_sparse(rows, quick):
    T = 512 if quick else 4096
    S = 16384 if quick else 131072
    nbk = 256 if quick else 2048
    t0 = time.time()
    cand = _shared_lists(T, S, nbk, 0.9)
    c = cand.cpu()
    union = sum(len(set(c[i].tolist()) | set(c[i + 1].tolist())) for i in range(0, T - 1, 2))
    print(f"  candidate lists built in {time.time() - t0:.1f} s; pair union / (2 * list) = {union / (T * nbk):.3f}")
    for fmt in ("fp8", "mxfp4"):
        k, ksc = testing.make_packed_k(S, D, fmt, device=DEV)
        qs = testing.make_queries(T, H, D, fmt, device=DEV)
        ks = torch.zeros(T, dtype=torch.int32, device=DEV)
        ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32, device=DEV)
        out = torch.empty(T, nbk * CBS, device=DEV)
        useful = T * nbk * CBS
        flops = 2.0 * useful * H * D
        shape = f"T{T} S{S} nbk{nbk}x{CBS} share0.9"
        for pair in ((ts._PAIR_DEFAULT,) if FAST else (True, False)):
            default = pair == ts._PAIR_DEFAULT  # the target is judged on what the op launches
            fn = lambda: ts._launch_prefill_sparse(qs.q, qs.q_scale, k, ksc, qs.weights, ks, ke, cand, CBS, out, pair)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            chk = _ref_rows_diff(out, lambda ref: reference.sparse_mqa_logits(
                qs.q[:4], qs.q_scale[:4] if qs.q_scale is not None else None, k, ksc, qs.weights[:4], ks[:4],
                ke[:4], cand[:4], CBS, ref), 4)
            t = _t(fn)
            _row(rows, op="sparse_mqa_logits", impl="triton-pair" if pair else "triton-rows", fmt=fmt, shape=shape,
                 time_us=t, floor_us=common.floor_us(flops=flops), tflops=flops / t / 1e6,
                 target=">= 600 TFLOP/s" if (default and not quick) else "",
                 meets=(flops / t / 1e6 >= 600) if (default and not quick) else "", check=f"diff_vs_ref={chk:.2e}")
            if not pair and fmt == "fp8" and not quick and not FAST:
                _sweep_rows(rows, fn, op="sparse_mqa_logits", fmt=fmt, shape=shape, floor=common.floor_us(flops=flops),
                            flops=flops)
            if pair and fmt == "fp8" and not quick and not FAST:
                for cfg in [(128, 8, 3), (64, 8, 3), (64, 4, 2)]:
                    ts.CONFIG_OVERRIDES["pair"] = cfg
                    try:
                        t2 = _t(fn)
                        _row(rows, op="sparse_mqa_logits", impl=f"triton-pair{cfg}", fmt=fmt, shape=shape,
                             time_us=t2, floor_us=common.floor_us(flops=flops), tflops=flops / t2 / 1e6)
                    except Exception as e:  # noqa: BLE001
                        print(f"  config {cfg} failed: {e!r}")
                    finally:
                        ts.CONFIG_OVERRIDES.pop("pair", None)
        if fmt == "fp8" and not FAST:
            Tr = 64
            outr = torch.empty(Tr, nbk * CBS, device=DEV)
            tr = _t(lambda: reference.sparse_mqa_logits(qs.q[:Tr], None, k, ksc, qs.weights[:Tr], ks[:Tr], ke[:Tr],
                                                        cand[:Tr], CBS, outr), graph=False, rep_ms=50)
            fl = 2.0 * Tr * nbk * CBS * H * D
            _row(rows, op="sparse_mqa_logits", impl="torch", fmt=fmt, shape=f"T{Tr} S{S} nbk{nbk}x{CBS}", time_us=tr,
                 floor_us=common.floor_us(flops=fl), tflops=fl / tr / 1e6)


def bench_cache(rows, quick):
    T = 1 << (16 if quick else 20)
    for fmt in ("fp8", "mxfp4"):
        bpt = formats.bytes_per_token(fmt, D)
        nb = T // PAGE
        cache = formats.allocate_k_cache(nb + 8, PAGE, D, fmt, DEV)
        k = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
        slot = torch.randperm((nb + 8) * PAGE, device=DEV)[:T]
        fn = lambda: tc.write_k_cache(k, slot, cache, fmt, True)  # noqa: E731
        fn()
        # Byte checks on the benchmark's bf16 input with power-of-two scales, and on fp32 input with exact
        # scales (values that need real rounding: e4m3 midpoints, subnormals, -0).
        kf = torch.randn(4096, D, device=DEV) * torch.rand(4096, 1, device=DEV).pow(8)
        kf[:8, :4] = -1e-30

        def write_check():
            ok = True
            for src, p2 in ((k[:4096], True), (kf, False)):
                want = formats.allocate_k_cache(nb + 8, PAGE, D, fmt, DEV)
                reference.write_k_cache(src, slot[:4096], want, fmt, p2)
                got = formats.allocate_k_cache(nb + 8, PAGE, D, fmt, DEV)
                tc.write_k_cache(src, slot[:4096], got, fmt, p2)
                ok = ok and torch.equal(got, want)
            return f"bytes_equal_ref={ok}"
        same = write_check()
        by = T * (D * 2 + 8 + bpt)
        t = _t(fn)
        _row(rows, op="write_k_cache", impl="triton", fmt=fmt, shape=f"T{T} D{D} bf16", time_us=t,
             floor_us=common.floor_us(by), tbps=by / t / 1e6, target=">= 0.8 of copy bw",
             meets=common.floor_us(by) / t >= 0.8, check=same)
        if fmt == "mxfp4":
            # The fp32 encoder that bf16 input used before the bf16-pair one (and that fp16/fp32 input uses).
            tc.CONFIG_OVERRIDES["pairs"] = False
            try:
                chk = write_check()
                t32 = _t(fn)
            finally:
                tc.CONFIG_OVERRIDES.pop("pairs")
            _row(rows, op="write_k_cache", impl="triton fp32 encoder", fmt=fmt, shape=f"T{T} D{D} bf16",
                 time_us=t32, floor_us=common.floor_us(by), tbps=by / t32 / 1e6, target=">= 0.8 of copy bw",
                 meets=common.floor_us(by) / t32 >= 0.8, check=chk)
        # The same tokens written to consecutive slots, and to the slots a serving engine's prefill writes
        # (pages in random order, consecutive slots within a page: block_table[t // page] * page + t % page).
        # The random slots above make every 4-byte scale store a partial-sector write of its own.
        slot_p = (torch.randperm(nb + 8, device=DEV)[:nb, None] * PAGE + torch.arange(PAGE, device=DEV)).view(-1)
        for name, sl in (("contiguous slots", torch.arange(T, device=DEV)), ("paged slots", slot_p)):
            fc = lambda: tc.write_k_cache(k, sl, cache, fmt, True)  # noqa: E731
            fc()
            tcont = _t(fc)
            _row(rows, op="write_k_cache", impl=f"triton {name}", fmt=fmt, shape=f"T{T} D{D} bf16",
                 time_us=tcont, floor_us=common.floor_us(by), tbps=by / tcont / 1e6, target=">= 0.8 of copy bw",
                 meets=common.floor_us(by) / tcont >= 0.8, check="")
        # The same bytes to the same random slots by a kernel that only moves them: how much of the gap to the
        # floor the access pattern itself costs (check: write_k_cache's time over the plain copy's).
        for bt_, w_ in ((32, 4), (16, 1)):
            tp = _t(copy_to_slots(k, slot, cache, fmt, bt_, w_))
            _row(rows, op="write_k_cache", impl=f"plain copy ({bt_}, {w_})", fmt=fmt, shape=f"T{T} D{D} bf16",
                 time_us=tp, floor_us=common.floor_us(by), tbps=by / tp / 1e6, check=f"write/copy={t / tp:.3f}")
        # (tokens per program, integer e4m3 rounding[, warps[, L2 hints]]): the defaults (16 tokens on one warp;
        # FP8 with both hints, MXFP4 with none: triton_cache._WRITE_LAUNCH) and alternatives. Hints (a mask): 1 the
        # rows and values evict first, 2 the scale words evict last, so that neighbouring slots' partial-sector
        # scale stores merge in L2 (FP8 on random slots is at its target's edge).
        _sweep(rows, tc.CONFIG_OVERRIDES, "write", [(16, False, 1, 0), (16, False, 1, 1), (16, False, 1, 2),
                                                    (16, False, 1, 3), (32, False, 1, 0), (8, False, 1, 0),
                                                    (32, False, 4, True), (32, True)],
               fn, op="write_k_cache",
               fmt=fmt, shape=f"T{T} D{D} bf16", floor=common.floor_us(by), nbytes=by, check=write_check)
        bt = torch.randperm(nb, device=DEV).to(torch.int32).view(1, nb)
        cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
        vb = formats.value_bytes(fmt, D)
        ko = torch.empty(T, vb, dtype=torch.uint8, device=DEV)
        if fmt == "fp8":
            ko = ko.view(formats.FP8_DTYPE)
        so = torch.empty(T, dtype=torch.float32 if fmt == "fp8" else torch.int32, device=DEV)
        fn = lambda: tc.gather_k(cache, bt, cu, ko, so, fmt)  # noqa: E731
        fn()
        by = 2 * T * bpt
        t = _t(fn)
        _row(rows, op="gather_k", impl="triton", fmt=fmt, shape=f"T{T} D{D}", time_us=t, floor_us=common.floor_us(by),
             tbps=by / t / 1e6, target=">= 0.8 of copy bw", meets=common.floor_us(by) / t >= 0.8)
        want_k, want_s = ko.clone(), so.clone()

        def gather_check():
            ko.zero_()
            so.zero_()
            fn()
            same = torch.equal(ko.view(torch.uint8), want_k.view(torch.uint8)) and torch.equal(so, want_s)
            return f"same_as_default={same}"
        # (rows per program, request chunk; None sizes it from the batch): the default and its alternatives
        _sweep(rows, tc.CONFIG_OVERRIDES, "gather", [(32, 128), (32, None), (256, None)], fn, op="gather_k",
               fmt=fmt, shape=f"T{T} D{D}", floor=common.floor_us(by), nbytes=by, check=gather_check)
        Tq = 8192 if not quick else 1024
        q = torch.randn(Tq, H, D, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(Tq, H, device=DEV)
        fn = lambda: tc.quantize_q(q, w, fmt, 1.0)  # noqa: E731
        by = Tq * H * (2 * D + 4 + 4 + formats.value_bytes(fmt, D) + (4 if fmt == "mxfp4" else 0))
        t = _t(fn, graph=False)
        _row(rows, op="quantize_q", impl="triton", fmt=fmt, shape=f"T{Tq} H{H} D{D}", time_us=t,
             floor_us=common.floor_us(by), tbps=by / t / 1e6)
        del cache, k
        torch.cuda.empty_cache()


def run(args):
    rows: list[dict] = []
    quick = bool(getattr(args, "quick", False))
    if dg is None:
        print(f"deep_gemm not importable: {_DG_ERR}")
    for name, fn in [("decode", bench_decode), ("prefill_sparse", bench_prefill_sparse),
                     ("prefill_dense", bench_prefill_dense), ("cache", bench_cache)]:
        only = os.environ.get("TSI_BENCH_ONLY")
        if only and name not in only.split(","):
            continue
        print(f"[scoring] {name}", flush=True)
        t0 = time.time()
        try:
            fn(rows, quick)
        except Exception as e:  # noqa: BLE001  (a failing section must not lose the others' rows)
            import traceback
            traceback.print_exc()
            rows.append(common.record(op=name, impl="FAILED", shape="", check=repr(e)[:200]))
        print(f"[scoring] {name} done in {time.time() - t0:.0f} s", flush=True)
        # partial results survive a time limit that stops the run later
        common.write_csv(rows, os.path.join(getattr(args, "out", "."), "scoring_partial.csv"))
    return rows


def plot(rows, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for op, impl, fmt, style in [("paged_sparse_mqa_logits", "triton", "fp8", "o-"),
                                 ("paged_sparse_mqa_logits", "triton", "mxfp4", "o--"),
                                 ("paged_sparse_mqa_logits", "cuda", "mxfp4", "d--"),
                                 ("paged_mqa_logits", "cuda", "mxfp4", "v--"),
                                 ("paged_mqa_logits", "triton", "fp8", "s-"), ("paged_mqa_logits", "triton", "mxfp4", "s--"),
                                 ("paged_mqa_logits", "deepgemm", "fp8", "^-"),
                                 ("paged_sparse_mqa_logits", "torch", "fp8", "x:")]:
        pts = sorted((r["ctx"], r["time_us"]) for r in rows if r.get("op") == op and r.get("impl") == impl
                     and r.get("fmt") == fmt and r.get("ctx"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{op.replace('_mqa_logits', '')} {impl} {fmt}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length")
    ax.set_ylabel("latency (us)")
    ax.set_title("decode, 128 rows, H64 D128 (sparse: 2048 blocks of 8)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for impl, fmt, style in [("triton", "fp8", "o-"), ("triton", "mxfp4", "o--"), ("deepgemm", "fp8", "^-")]:
        pts = sorted((r["S"], r["time_us"]) for r in rows if r.get("op") == "mqa_logits" and r.get("impl") == impl
                     and r.get("fmt") == fmt and r.get("S") and r["S"] >= 8192)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"mqa_logits {impl} {fmt}")
    for r in rows:
        if r.get("op") == "sparse_mqa_logits" and r.get("impl") in ("triton-pair", "triton-rows"):
            ax.plot([131072], [r["time_us"]], "*" if r["impl"] == "triton-pair" else "+", label=f"sparse {r['impl']} {r['fmt']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("keys S")
    ax.set_ylabel("latency (us)")
    ax.set_title("prefill, 4096 causal queries, H64 D128")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scoring_latency.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    lab, val = [], []
    for r in rows:
        if r.get("frac_floor") and str(r.get("impl", "")).startswith(("triton", "deepgemm")) and "(" not in str(r.get("impl")):
            lab.append(f"{r['op'][:18]} {r['impl'][:11]} {r.get('fmt', '')} {r['shape'][:16]}")
            val.append(r["frac_floor"])
    ax.barh(range(len(val)), val)
    ax.set_yticks(range(len(val)))
    ax.set_yticklabels(lab, fontsize=5)
    ax.set_xlabel("fraction of the floor (1 = at the hardware floor)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scoring_floor.png"), dpi=110)
