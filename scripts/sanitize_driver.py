"""Launch every GPU op once per edge case, for ``scripts/sanitize.sh`` (compute-sanitizer memcheck, racecheck,
initcheck, synccheck). Whatever backend dispatch picks on this machine runs (Triton scoring/cache kernels,
CUDA top-k, DeepGEMM where installed; the reference otherwise); the end-to-end ops run their composition.

Edge cases: a request whose last block is the cache's last page (the cache is allocated with no slack, so a
read past it leaves the allocation), context lengths ending mid-page, empty rows, -1 and out-of-range block
ids, request indices out of range, MTP rows, k larger than the row, large k, candidate lists with -1 holes and
ids past the row, prefill rows ending at the last packed key, selection rows wide enough for the streamed
top-k path; the same selection cases again on the three-CTA top-k kernel (forced on).

``--strict-init``: caches are ``torch.empty`` and only the valid tokens are written (through
``write_k_cache``), packed K is exactly what ``gather_k`` writes: under initcheck any read of a byte no valid
position covers is reported. Otherwise every input byte is initialised (random) and only outputs and
workspaces start uninitialised. Prints ``DRIVER OK <launches>`` at the end.

Usage: python3 scripts/sanitize_driver.py [--strict-init] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import torch_sparse_indexer  # noqa: F401  (registers the ops and the backends this machine can run)
from torch_sparse_indexer import backends, formats, workspace

ops = torch.ops.sparse_indexer
DEV = os.environ.get("TSI_SAN_DEVICE", "cuda")  # "cpu": check this script's logic on the reference
LAUNCHES = 0
USED = {}


def launch(name, *args):
    """One op call, synchronised so a fault is attributed to it."""
    global LAUNCHES
    USED.setdefault(name, set()).add(backends.select(name, *args).name)
    out = getattr(ops, name)(*args)
    if DEV == "cuda":
        torch.cuda.synchronize()
    LAUNCHES += 1
    return out


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def build_cache(fmt, D, bs, seqs, strict, g):
    """A paged cache with no spare page; the longest request ends on the last page (NB - 1). Returns
    (cache, block_table, stale_table) -- the stale table also carries -1, out-of-range and stale ids past each
    request's pages."""
    need = [(n + bs - 1) // bs for n in seqs]
    NB = sum(need)
    MB = max(need) + 2
    bpt = formats.bytes_per_token(fmt, D)
    if strict:
        cache = torch.empty(NB, bs, bpt, dtype=torch.uint8, device=DEV)
    else:
        cache = torch.randint(0, 256, (NB, bs, bpt), generator=g, dtype=torch.uint8).to(DEV)
    longest = max(range(len(seqs)), key=lambda r: need[r])
    order = [r for r in range(len(seqs)) if r != longest] + [longest]
    bt = torch.full((len(seqs), MB), -1, dtype=torch.int32)
    page = 0
    for r in order:
        for b in range(need[r]):
            bt[r, b] = page
            page += 1
    stale = bt.clone()
    for r in range(len(seqs)):
        if need[r] < MB:
            stale[r, need[r]] = [-1, NB + 3, 0, 2 ** 31 - 1][r % 4]
    # Valid tokens written through the op itself (every token of each request).
    slots = []
    for r, n in enumerate(seqs):
        for p in range(n):
            slots.append(int(bt[r, p // bs]) * bs + p % bs)
    k = torch.randn(len(slots), D, generator=g).to(torch.bfloat16).to(DEV)
    launch("write_k_cache", k, torch.tensor(slots, dtype=torch.int64, device=DEV), cache, fmt, True)
    return cache, bt.to(DEV), stale.to(DEV)


def queries(T, H, D, fmt, g):
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(T, H, generator=g).to(DEV)
    return launch("quantize_q", q, w, fmt, H ** -0.5)


def candidates(ns, nbk, cbs, g):
    cb = torch.full((len(ns), nbk), -1, dtype=torch.int32)
    for r, n in enumerate(ns):
        nb = (max(n, 0) + cbs - 1) // cbs
        m = min(nbk, nb)
        if m:
            cb[r, :m] = torch.randperm(nb, generator=g)[:m].sort().values.to(torch.int32)
        if r % 3 == 1 and nbk > 1:
            cb[r, -1] = nb + 5  # an id past the row: -inf columns
    return cb.to(DEV)


def decode_case(fmt, H, D, bs, cbs, strict, g, topk):
    seqs = [2 * bs + 17, 1, 0, 5 * bs, bs - 1]  # mid-page ends, a one-token and an empty request
    cache, bt, stale = build_cache(fmt, D, bs, seqs, strict, g)
    # MTP rows for request 0 and 3, one row for the others, a padded row (len 0) and an out-of-range request.
    lens = i32([seqs[0] - 2, seqs[0] - 1, seqs[0], seqs[1], seqs[2], seqs[3] - 1, seqs[3], seqs[4], 0, 7])
    req = i32([0, 0, 0, 1, 2, 3, 3, 4, 1, 99])
    R = lens.shape[0]
    qv, qs, w = queries(R, H, D, fmt, g)
    L = max(seqs) + 5
    for table in (bt, stale):
        for ri in (req, None):
            rows = R if ri is not None else len(seqs)
            args = (qv[:rows], None if qs is None else qs[:rows], cache, w[:rows],
                    lens[:rows] if ri is not None else i32(seqs), table, ri)
            launch("paged_mqa_logits", *args, torch.empty(rows, L, device=DEV))
    nbk = 6
    ns = [max(0, min(int(x), max(seqs))) for x in lens.tolist()]
    cb = candidates(ns, nbk, cbs, g)
    base = (qv, qs, cache, w, lens, stale, req)
    launch("paged_sparse_mqa_logits", *base, cb, cbs, torch.empty(R, nbk * cbs, device=DEV))
    idx = torch.empty(R, topk, dtype=torch.int32, device=DEV)
    pub = torch.empty(R, nbk, dtype=torch.int32, device=DEV)
    ws = torch.empty(workspace.dense_workspace_bytes(R, L), dtype=torch.uint8, device=DEV)
    launch("indexer_decode", *base, L, topk, cbs, ws, idx, pub)
    ws1 = torch.empty(workspace.min_workspace_bytes(L), dtype=torch.uint8, device=DEV)  # one row per chunk
    launch("indexer_decode", *base, L, topk, cbs, ws1, idx, pub)
    sws = torch.empty(workspace.sparse_workspace_bytes(R, nbk, cbs), dtype=torch.uint8, device=DEV)
    launch("sparse_indexer_decode", *base, pub, cbs, topk, sws, idx)
    return cache, bt, seqs


def prefill_case(fmt, H, D, cbs, cache, bt, seqs, strict, g, topk):
    cu = [0]
    for n in seqs:
        cu.append(cu[-1] + n)
    N = cu[-1]
    vb = formats.value_bytes(fmt, D)
    kdt = formats.FP8_DTYPE if fmt == "fp8" else torch.uint8
    sdt = torch.float32 if fmt == "fp8" else torch.int32
    if strict:
        k = torch.empty(N, vb, dtype=torch.uint8, device=DEV).view(kdt)
        ks_ = torch.empty(N, dtype=sdt, device=DEV)
    else:
        k = torch.randint(0, 256, (N, vb), generator=g, dtype=torch.uint8).to(DEV).view(kdt)
        ks_ = torch.randint(0, 256, (N, 4), generator=g, dtype=torch.uint8).to(DEV).view(sdt).view(N)
    launch("gather_k", cache, bt, i32(cu), k, ks_, fmt)
    # Causal rows of every request (the last reaching the last packed key), empty and clamped rows.
    ks, ke = [], []
    for r, n in enumerate(seqs):
        for e in sorted({1, n // 2, n}):
            if e <= n:
                ks.append(cu[r]), ke.append(cu[r] + e)
    ks += [0, N, -4, N - 3]
    ke += [0, N, 5, N + 100]
    T = len(ks)
    qv, qs, w = queries(T, H, D, fmt, g)
    ks_t, ke_t = i32(ks), i32(ke)
    L = max(seqs) + 3
    base = (qv, qs, k, ks_, w, ks_t, ke_t)
    launch("mqa_logits", *base, torch.empty(T, L, device=DEV))
    nbk = 5
    ns = [max(0, min(b, N) - max(0, min(a, N))) for a, b in zip(ks, ke)]
    cb = candidates(ns, nbk, cbs, g)
    launch("sparse_mqa_logits", *base, cb, cbs, torch.empty(T, nbk * cbs, device=DEV))
    idx = torch.empty(T, topk, dtype=torch.int32, device=DEV)
    pub = torch.empty(T, nbk, dtype=torch.int32, device=DEV)
    ws = torch.empty(workspace.dense_workspace_bytes(T, L), dtype=torch.uint8, device=DEV)
    launch("indexer_prefill", *base, L, topk, cbs, ws, idx, pub)
    sws = torch.empty(workspace.sparse_workspace_bytes(T, nbk, cbs), dtype=torch.uint8, device=DEV)
    launch("sparse_indexer_prefill", *base, pub, cbs, topk, sws, idx)


def selection_cases(g, quick):
    widths = [37, 5000] if quick else [37, 5000, 40000]
    for W in widths:
        R = 6
        x = torch.randn(R, W, generator=g)
        x[1] = 2.0                                   # all equal
        x[2, ::3] = float("nan")
        x[3, ::2] = float("-inf")
        x = x.to(DEV)
        lens = i32([W, 0, W - 1, 1, W + 10, -5])
        for k in sorted({1, min(W + 3, 4096), 2048}):
            launch("topk", x, lens, k, torch.empty(R, k, dtype=torch.int32, device=DEV))
        xb = x.to(torch.bfloat16)
        launch("topk", xb, lens, 512, torch.empty(R, 512, dtype=torch.int32, device=DEV))
        for cbs in (8, 64):
            nbk = max(1, min(2048, (W + cbs - 1) // cbs // 2))
            launch("block_topk", x, lens, cbs, torch.empty(R, nbk, dtype=torch.int32, device=DEV))
        cbs = 16
        nbk = max(1, W // cbs)
        cb = candidates([W] * R, nbk, cbs, g)
        sx = x[:, : nbk * cbs].contiguous()
        launch("sparse_topk", sx, cb, cbs, lens, 2048, torch.empty(R, 2048, dtype=torch.int32, device=DEV))


def tri_cases(g):
    """The same selection edge cases on the three-CTA top-k kernel (off by default: cuda_topk.set_tri_mode), forced
    on, fp32 and bf16, up to the widest rows it takes."""
    from torch_sparse_indexer.kernels import cuda_topk as ct
    if DEV != "cuda" or not ct.available():
        return
    prev = ct.set_tri_mode("always")
    try:
        for W in (5000, ct.tuning()["smem_keys"]):
            R = 6
            x = torch.randn(R, W, generator=g)
            x[1] = 2.0                                   # all equal: the rescan path
            x[2, ::3] = float("nan")
            x[3, ::2] = float("-inf")
            x = x.to(DEV)
            lens = i32([W, 0, W - 1, 1, W + 10, -5])
            for xx in (x, x.to(torch.bfloat16)):
                for k in (1, 2048):
                    launch("topk", xx, lens, k, torch.empty(R, k, dtype=torch.int32, device=DEV))
                cbs = 16
                nbk = W // cbs
                cb = candidates([W] * R, nbk, cbs, g)
                sx = xx[:, : nbk * cbs].contiguous()
                launch("sparse_topk", sx, cb, cbs, lens, 2048, torch.empty(R, 2048, dtype=torch.int32, device=DEV))
    finally:
        ct.set_tri_mode(prev)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strict-init", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    a = ap.parse_args()
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    configs = [("fp8", 64, 128, 64, 16), ("mxfp4", 64, 128, 64, 8)]
    if not a.quick:
        configs.append(("fp8", 16, 64, 16, 16))
    for fmt, H, D, bs, cbs in configs:
        cache, bt, seqs = decode_case(fmt, H, D, bs, cbs, a.strict_init, g, topk=512 if bs > 16 else 100)
        prefill_case(fmt, H, D, cbs, cache, bt, seqs, a.strict_init, g, topk=256)
        print(f"{fmt} H{H} D{D} bs{bs}: done ({LAUNCHES} launches, {time.time() - t0:.1f} s)", flush=True)
    selection_cases(g, a.quick)
    tri_cases(g)
    for name in sorted(USED):
        print(f"  {name}: {sorted(USED[name])}")
    print(f"DRIVER OK {LAUNCHES} launches in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    if DEV == "cuda" and not torch.cuda.is_available():
        print("DRIVER SKIP: no CUDA device")
        sys.exit(2)
    main()
