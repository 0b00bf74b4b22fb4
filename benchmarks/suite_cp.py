"""Context-parallel decode (``torch_sparse_indexer.distributed``) against the single-GPU step.

Launch: ``python benchmarks/bench.py --suite cp`` on one GPU (an NCCL group of one: its all-gather is a device
copy, so the row measures what the CP path itself adds), or ``torchrun --nproc-per-node N benchmarks/bench.py
--suite cp`` with one rank per GPU (rank 0 writes the CSV). Shape (``--quick``: 16 rows of 16K): 128 decode rows
of 128K-token requests, H 64, D 128, FP8, top-k 2048, 2048 published candidate blocks of 8, interleave 1 and 64.

Rows: ``cp_indexer_decode`` on each rank's shard (scores of its own positions, local top-k and block top-m,
one all-gather of fixed-size candidates, exact merge), timed on rank 0 with every rank replaying the same
CUDA graph, selecting through the single-GPU top-k ops (default) and through the ``cp_*`` ops ("cp ops");
``indexer_decode`` over the whole cache on one GPU (rank 0). ``check``: rank 0 also builds the whole cache and
requires the merged top-k and candidate blocks to equal the single-GPU step's.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

import common
from torch_sparse_indexer import distributed as cp, formats, workspace

ops = torch.ops.sparse_indexer
H, D, BS, TOPK, NBK, CBS, FMT = 64, 128, 64, 2048, 2048, 8, "fp8"
COLUMNS = ["op", "impl", "world", "interleave", "shape", "time_us", "vs_single_gpu", "check"]


def _init():
    """This process's rank and world size; an NCCL group of one when not launched by torchrun."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
            dist.init_process_group("nccl")
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _request_k(r, ctx, dev):
    """Request r's K (the same bits on every rank: a per-request seed)."""
    g = torch.Generator(device=dev).manual_seed(1000 + r)
    return torch.randn(ctx, D, generator=g, device=dev).to(torch.bfloat16)


def _cache(B, ctx, dev, shard=None):
    """Pages of B requests of ctx positions: the whole cache, or (``shard``) this rank's positions only."""
    n = ctx if shard is None else int(shard.local_length(ctx))
    per = (n + BS - 1) // BS
    cache = formats.allocate_k_cache(B * per, BS, D, FMT, dev)
    bt = (torch.arange(B * per, device=dev, dtype=torch.int32)).view(B, per)
    pos = torch.arange(ctx, device=dev)
    for r in range(B):
        if shard is None:
            slots = r * per * BS + pos
        else:
            slots = cp.cp_slot_mapping(pos, torch.full_like(pos, r), bt, BS, shard)
        ops.write_k_cache(_request_k(r, ctx, dev), slots, cache, FMT, True)
    return cache, bt


def _queries(B, dev):
    g = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(B, H, D, generator=g, device=dev).to(torch.bfloat16)
    w = torch.rand(B, H, generator=g, device=dev)
    return ops.quantize_q(q, w, FMT, H ** -0.5)


def run(args) -> list[dict]:
    if not torch.cuda.is_available():
        print("[cp] skipped: needs CUDA GPUs")
        return []
    rank, W = _init()
    dev = torch.device("cuda", torch.cuda.current_device())
    quick = getattr(args, "quick", False)
    B, ctx = (16, 16384) if quick else (128, 131072)
    shape = f"B{B} ctx{ctx} H{H} D{D} {FMT} k{TOPK} m{NBK}x{CBS}"
    qv, qs, wv = _queries(B, dev)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    req = torch.arange(B, dtype=torch.int32, device=dev)
    rows = []
    single = None
    if rank == 0:  # the single-GPU step, and the answer every sharded run must give
        cache, bt = _cache(B, ctx, dev)
        ws = torch.empty(workspace.dense_workspace_bytes(B, ctx), dtype=torch.uint8, device=dev)
        idx = torch.empty(B, TOPK, dtype=torch.int32, device=dev)
        cb = torch.empty(B, NBK, dtype=torch.int32, device=dev)

        def single_step():
            ops.indexer_decode(qv, qs, cache, wv, lens, bt, req, ctx, TOPK, CBS, ws, idx, cb)

        single_step()
        want = (idx.clone(), cb.clone())
        single = common.replay_us(single_step)
        rows.append(common.record(op="indexer_decode", impl="one GPU", world=1, interleave=0, shape=shape,
                                  time_us=single, vs_single_gpu=1.0, check=""))
        del cache, ws
    for interleave in (1, 64):
        shard = cp.CPShard(rank, W, interleave)
        cache, bt = _cache(B, ctx, dev, shard)
        buf = cp.dense_buffers(shard, B, ctx, TOPK, NBK, CBS, device=dev)
        idx = torch.empty(B, TOPK, dtype=torch.int32, device=dev)
        cb = torch.empty(B, NBK, dtype=torch.int32, device=dev)

        def step():
            cp.cp_indexer_decode(qv, qs, cache, wv, lens, bt, req, ctx, TOPK, CBS, buf, idx, cb)

        # The step's selection through the single-GPU top-k kernels (the default), and through the cp_* ops'
        # reference backend (how every step selected before; cp.SELECT_BY_CP_OPS).
        for by_ops in (False, True):
            cp.SELECT_BY_CP_OPS = by_ops
            try:
                idx.fill_(-7)
                cb.fill_(-7)
                step()
                torch.cuda.synchronize()
                check = ""
                if rank == 0:
                    check = "exact" if torch.equal(idx, want[0]) and torch.equal(cb, want[1]) else "MISMATCH"
                # Every rank replays the same graph the same number of times, so the collectives pair up; rank
                # 0's figure is reported.
                t = common.replay_us(step)
            finally:
                cp.SELECT_BY_CP_OPS = False
            if rank == 0:
                impl = f"{W} rank(s), NCCL" + (", cp ops" if by_ops else "")
                rows.append(common.record(op="cp_indexer_decode", impl=impl, world=W, interleave=interleave,
                                          shape=shape, time_us=t, vs_single_gpu=t / single, check=check))
                print(f"[cp] W={W} interleave={interleave} {impl}: {t:.1f} us ({t / single:.2f}x one GPU), "
                      f"{check}", flush=True)
        del cache, buf
        torch.cuda.empty_cache()
    return rows if rank == 0 else []

