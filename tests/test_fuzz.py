"""Property fuzzing (hypothesis): random configurations, ragged request mixes and extreme data for every op.

One set of strategies, two comparisons:

* ``cpu``: the op (reference backend) against the independent float64 oracle (tests/oracle.py);
* ``cuda`` (gpu-marked): the op under automatic dispatch (the GPU kernels) against
  ``use_backend("reference")`` on the same device tensors.

What is drawn: format, H (multiples of 4), D, cache block size, candidate block size, k, ragged request
mixes with MTP rows, padded rows (length 0, request index out of range, negative or too-long lengths), block
tables with -1 holes and stale ids, the cache's last page in use, 4-D cache views, int8-viewed MXFP4, bf16
weights / logits, and data: exact small integers, Gaussian, all-equal keys, zero keys, huge and tiny
magnitudes, uninitialised memory (random bytes, NaN patterns included) outside the valid ranges, and NaN /
inf bytes inside them.

What is asserted (SPEC sections 2, 4, 7):

* scores: positions outside a row's valid range are ``-inf`` in both; on clean data the ``-inf`` masks are
  identical, and values are within the float32 accumulation bound of the oracle (bit-equal on exact data) or
  ``calc_diff < 1e-5`` for a kernel against the reference's float32 scores, bf16 scores also within one bf16
  ulp everywhere (bit-equal on exact float32 data). Where valid positions
  hold garbage bytes, positions whose reference score is NaN or overflows are not compared (the reference
  propagates NaN; a kernel may give any value there) -- every other position still is;
* bytes that no valid position references (uninitialised pages, page tails, stale table entries, packed
  rows outside every row's range) never change any output: rerun with those bytes re-randomised, bitwise;
* selections are exact: every selection op (and the end-to-end op through the same scores) equals the oracle
  / reference selection on the very same logits, NaN ranking below everything, ``-0.0 == +0.0``, lower
  position first on ties;
* cache writes, gathers and query quantization are byte-exact.

Profiles: ``TSI_FUZZ_PROFILE=ci`` (default; small, for 2 CPU cores) or ``gpu`` (more examples, bigger
shapes). ``TSI_FUZZ_EXAMPLES=N`` overrides the per-test example count; ``TSI_FUZZ_BUDGET_S=s`` caps each
test's wall time (cases past it are skipped, not counted). The number of cases that ran (and,
on the GPU, how many ran a kernel backend) is printed at the end of the session and, with
``TSI_FUZZ_REPORT=path``, written as JSON.

Developer hook: ``TSI_FUZZ_EMULATE=1`` (CPU only) registers the Triton kernels under the Triton interpreter
(``TRITON_INTERPRET=1`` must be set too) and, with ``TSI_TOPK_EMU=lib.so``, the CPU emulation of the CUDA
top-k, then runs the kernel-vs-reference comparison on the CPU (slow; checks this file's GPU logic).
"""
from __future__ import annotations

import collections
import functools
import json
import math
import os
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from torch_sparse_indexer import backends, formats, workspace
from torch_sparse_indexer.testing import assert_scores_close

import cases
import oracle

ops = torch.ops.sparse_indexer

EMULATE = os.environ.get("TSI_FUZZ_EMULATE") == "1"
if EMULATE:
    from torch_sparse_indexer.testing import EMULATED_OPS, register_cpu_emulation
    # (the dense prefill kernel's launch failed under the interpreter when this hook was written: KeyError)
    register_cpu_emulation(os.environ.get("TSI_TOPK_EMU"), [op for op in EMULATED_OPS if op != "mqa_logits"])

PROFILE = os.environ.get("TSI_FUZZ_PROFILE", "ci")
NEG_INF = float("-inf")
BIG = 2 ** 31 - 1


@dataclass(frozen=True)
class Limits:
    examples: int          # per scoring test (decode / prefill, dense / sparse)
    light_examples: int    # per selection / cache-op test (cheaper cases)
    heads: tuple
    max_reqs: int
    max_len: int           # tokens per request
    max_cand: int          # candidate blocks per row
    max_k: int
    max_width: int         # selection-op logits width
    max_rows: int          # selection-op rows
    block_sizes: tuple = formats.CACHE_BLOCK_SIZES


LIMITS = {
    "ci": Limits(examples=60, light_examples=200, heads=(4, 8, 12, 16, 64), max_reqs=3, max_len=100, max_cand=5,
                 max_k=48, max_width=200, max_rows=6),
    "gpu": Limits(examples=150, light_examples=300, heads=(4, 8, 12, 16, 24, 32, 64, 128), max_reqs=8,
                  max_len=2500, max_cand=80, max_k=2048, max_width=40000, max_rows=12),
}
LIM = LIMITS[PROFILE]
EXAMPLES = int(os.environ.get("TSI_FUZZ_EXAMPLES", LIM.examples))
LIGHT_EXAMPLES = int(os.environ.get("TSI_FUZZ_EXAMPLES", LIM.light_examples))


def _settings(n):
    return settings(max_examples=n, deadline=None, print_blob=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# Wall-clock budget per test (TSI_FUZZ_BUDGET_S): past it, new examples are rejected at once, so a slow machine
# (kernel compilation) ends the test early with every case that ran checked and counted.
BUDGET_S = float(os.environ.get("TSI_FUZZ_BUDGET_S", "0"))
_START: dict = {}


_FAILING: set = set()


def _in_budget(name):
    if BUDGET_S <= 0 or name in _FAILING:
        return True
    t0 = _START.setdefault(name, time.time())
    return time.time() - t0 < BUDGET_S


def _budgeted(name):
    """Skip examples past the budget, except once an example of this test has failed: hypothesis then
    replays it (to shrink and report), and the replay must run in full or hypothesis reports a flaky
    strategy instead of the failure."""
    def deco(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not _in_budget(name):
                return None
            try:
                return fn(*args, **kwargs)
            except BaseException:
                _FAILING.add(name)
                raise
        return inner
    return deco


FUZZ = _settings(EXAMPLES)
FUZZ_LIGHT = _settings(LIGHT_EXAMPLES)

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def kernel_mode(device):
    """True: compare automatic dispatch against the reference backend; False: reference against the oracle."""
    return device == "cuda" or EMULATE


# ----------------------------------------------------------------------------------------------------
# Case counting (the closing note reports it)
# ----------------------------------------------------------------------------------------------------

COUNTS = collections.Counter()      # (test, device) -> examples run
KERNEL = collections.Counter()      # (test, device, op, backend) -> examples where that backend ran
_T0 = time.time()


def _count(name, device):
    COUNTS[(name, device)] += 1


def _note_backend(name, device, op, *args):
    KERNEL[(name, device, op, backends.select(op, *args).name)] += 1


class _Summary:
    def pytest_terminal_summary(self, terminalreporter):
        if not COUNTS:
            return
        tr = terminalreporter
        tr.section(f"fuzz cases (profile {PROFILE}: up to {EXAMPLES} / {LIGHT_EXAMPLES} examples per scoring / other test)")
        for (name, dev), n in sorted(COUNTS.items()):
            tr.write_line(f"{name}[{dev}]: {n} cases")
        by_backend = collections.Counter()
        for (name, dev, op, be), n in KERNEL.items():
            by_backend[(dev, op, be)] += n
        for (dev, op, be), n in sorted(by_backend.items()):
            tr.write_line(f"  {dev} {op}: {n} calls compared on backend {be!r}")
        tr.write_line(f"fuzz total: {sum(COUNTS.values())} cases in {time.time() - _T0:.0f} s")
        path = os.environ.get("TSI_FUZZ_REPORT")
        if path:
            with open(path, "w") as f:
                json.dump({"profile": PROFILE, "examples_per_test": EXAMPLES,
                           "cases": {f"{n}[{d}]": c for (n, d), c in COUNTS.items()},
                           "backends": {f"{d} {o} {b}": c for (d, o, b), c in by_backend.items()},
                           "total": sum(COUNTS.values())}, f, indent=1)


@pytest.fixture(scope="module", autouse=True)
def _register_summary(request):
    pm = request.config.pluginmanager
    if not pm.has_plugin("tsi-fuzz-summary"):
        pm.register(_Summary(), "tsi-fuzz-summary")
    yield


def _skip_unavailable(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------

DATA_MODES = ("exact", "gauss", "allequal", "zeros", "scaled")


def _rows(shape, fmt, gen, mode, scale_exp=0):
    """Float rows ``[..., D]`` to quantize, by data mode (see module docstring)."""
    if mode == "exact":
        return cases.raw_rows(shape, fmt, gen, True)
    if mode == "allequal":
        one = cases.raw_rows((1, shape[-1]), fmt, gen, True)
        return one.expand(shape).clone()
    if mode == "zeros":
        return torch.zeros(shape)
    x = torch.randn(shape, generator=gen)
    return x * (10.0 ** scale_exp) if mode == "scaled" else x


def _weights(T, H, gen, mode, scale_exp=0):
    if mode in ("exact", "allequal", "zeros"):
        return cases.weights(T, H, gen, True)
    w = torch.randn(T, H, generator=gen) * H ** -0.5
    return w * (10.0 ** scale_exp) if mode == "scaled" else w


@st.composite
def scale_exps(draw):
    """Decimal exponents for (q, k, weights) whose product stays inside float32 range with headroom."""
    eq = draw(st.integers(-12, 12))
    ek = draw(st.integers(-12, 12))
    ew = draw(st.integers(max(-28 - eq - ek, -25), min(26 - eq - ek, 25)))
    return eq, ek, ew


def queries(T, H, D, fmt, gen, mode, exps, wdtype, int8):
    q = _rows((T, H, D), fmt, gen, "exact" if mode in ("allequal", "zeros") else mode, exps[0])
    qv, qs, wf = formats.quantize_q(q, _weights(T, H, gen, mode, exps[2]), fmt)
    if int8 and fmt == "mxfp4":
        qv = qv.view(torch.int8)
    return qv, qs, wf.to(wdtype)


def _nan_bytes(fmt, n, gen):
    """``n`` value bytes that decode to NaN (fp8) or to the largest codes (mxfp4 has no NaN)."""
    if fmt == "fp8":
        return torch.tensor([0x7F, 0xFF], dtype=torch.uint8)[torch.randint(0, 2, (n,), generator=gen)]
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)


_BAD_SCALE_WORDS = torch.tensor([0x7FC00000, 0x7F800000, -0x800000, -0x400000, 0x7F7FFFFF], dtype=torch.int64)


def _bad_scale(fmt, n, gen):
    """Scale words that decode to NaN / +-inf / the largest float (fp8) or carry UE8M0 byte 0xFF (mxfp4)."""
    if fmt == "fp8":
        w = _BAD_SCALE_WORDS[torch.randint(0, len(_BAD_SCALE_WORDS), (n,), generator=gen)]
        return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32).view(torch.float32)
    return torch.full((n,), -1, dtype=torch.int32)  # every scale byte 0xFF


# ----------------------------------------------------------------------------------------------------
# Decode (paged) cases
# ----------------------------------------------------------------------------------------------------

@st.composite
def lengths_for(draw, bs, hi):
    edges = [v for v in (0, 1, bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 3) if v <= hi]
    return draw(st.one_of(st.sampled_from(edges), st.integers(0, hi)))


@dataclass
class Paged:
    fmt: str
    H: int
    D: int
    bs: int
    cbs: int
    mode: str
    q: torch.Tensor
    q_scale: object
    weights: torch.Tensor
    cache: torch.Tensor          # as passed to the op (3-D or 4-D view)
    block_table: torch.Tensor
    context_lens: torch.Tensor
    req_indices: object
    referenced: torch.Tensor     # bool [NB, BS]: tokens some valid position may read
    clean: torch.Tensor          # bool [NB, BS]: tokens holding quantized data (not random bytes)
    dirty: bool                  # some valid position reads a token that is not clean
    garbage: bool
    seed: int

    def to(self, device):
        d = {k: (v.to(device) if isinstance(v, torch.Tensor) and k not in ("referenced", "clean") else v)
             for k, v in self.__dict__.items()}
        return Paged(**d)

    def __repr__(self):
        return (f"Paged({self.fmt} H{self.H} D{self.D} bs{self.bs} cbs{self.cbs} {self.mode} garbage={self.garbage} "
                f"dirty={self.dirty} seed={self.seed} lens={self.context_lens.tolist()} req="
                f"{None if self.req_indices is None else self.req_indices.tolist()} table={self.block_table.tolist()} "
                f"cache={list(self.cache.shape)})")


@st.composite
def paged_cases(draw, sparse):
    fmt = draw(st.sampled_from(formats.FORMATS))
    H = draw(st.sampled_from(LIM.heads))
    D = draw(st.sampled_from(formats.HEAD_DIMS))
    bs = draw(st.sampled_from(LIM.block_sizes))
    cbs = draw(st.sampled_from([c for c in formats.CANDIDATE_BLOCK_SIZES if bs % c == 0]))
    mode = draw(st.sampled_from(DATA_MODES))
    exps = draw(scale_exps()) if mode == "scaled" else (0, 0, 0)
    garbage = draw(st.booleans())
    nan_valid = garbage and draw(st.integers(0, 3)) == 0
    seed = draw(st.integers(0, 2 ** 31 - 1))
    gen = torch.Generator().manual_seed(seed)

    nreq = draw(st.integers(1, LIM.max_reqs))
    seq = draw(st.lists(lengths_for(bs, LIM.max_len), min_size=nreq, max_size=nreq))
    need = [(n + bs - 1) // bs for n in seq]
    spare = draw(st.integers(0, 2))
    NB = max(1, sum(need) + spare)
    MB = max(1, max(need) + draw(st.integers(0, 2)))
    vb = formats.value_bytes(fmt, D)

    cache = (torch.randint(0, 256, (NB, bs, vb + 4), generator=gen, dtype=torch.uint8) if garbage
             else torch.zeros(NB, bs, vb + 4, dtype=torch.uint8))
    vals_v, scales_v = formats.cache_views(cache, fmt)
    clean = torch.full((NB, bs), not garbage)
    perm = torch.randperm(NB, generator=gen).tolist()
    if draw(st.booleans()) and sum(need):  # the longest request ends on the cache's last page
        r = max(range(nreq), key=lambda i: need[i])
        slot = sum(need[:r]) + need[r] - 1
        j = perm.index(NB - 1)
        perm[slot], perm[j] = perm[j], perm[slot]
    bt = torch.full((nreq, MB), -1, dtype=torch.int32)
    it = iter(perm)
    for r, nb in enumerate(need):
        for b in range(nb):
            bt[r, b] = next(it)
        for b in range(nb, MB):  # past the request's pages: -1, a stale page id, or an id past the cache
            bt[r, b] = draw(st.sampled_from([-1, int(torch.randint(0, NB, (1,), generator=gen)), NB + 3, BIG]))
    # Valid tokens: request r's positions [0, seq[r]).
    for r, n in enumerate(seq):
        if n == 0:
            continue
        x = _rows((n, D), fmt, gen, mode, exps[1])
        v, s = formats.quantize_rows(x, fmt)
        p = torch.arange(n)
        page, off = bt[r, p // bs].long(), p % bs
        vals_v.view(torch.uint8)[page, off] = v.view(torch.uint8)
        scales_v[page, off] = s
        clean[page, off] = True
    if nan_valid and sum(seq):
        r = draw(st.sampled_from([i for i in range(nreq) if seq[i]]))
        for p in draw(st.lists(st.integers(0, seq[r] - 1), min_size=1, max_size=3)):
            page, off = int(bt[r, p // bs]), p % bs
            clean[page, off] = False
            if draw(st.booleans()):
                vals_v.view(torch.uint8)[page, off, :4] = _nan_bytes(fmt, 4, gen)
            else:
                scales_v[page, off] = _bad_scale(fmt, 1, gen)[0]

    # Rows: MTP rows per request (growing lengths), then padded / out-of-contract rows.
    lens, reqs = [], []
    for r, n in enumerate(seq):
        m = draw(st.integers(1, 3))
        for t in range(m):
            lens.append(max(0, n - m + 1 + t))
            reqs.append(r)
    pads = draw(st.lists(st.sampled_from(["zero", "badreq", "neg", "over"]), max_size=2))
    for kind in pads:
        r = draw(st.integers(0, nreq - 1))
        if kind == "zero":
            lens.append(0), reqs.append(r)
        elif kind == "badreq":
            lens.append(max(1, seq[r])), reqs.append(draw(st.sampled_from([-1, nreq, BIG])))
        elif kind == "neg":
            lens.append(-draw(st.integers(1, BIG))), reqs.append(r)
        else:  # past the block table: clamped to max_blocks * block_size (stale pages become readable)
            lens.append(MB * bs + draw(st.integers(1, 1000))), reqs.append(r)
    one_row_each = len(lens) == nreq and reqs == list(range(nreq))
    req_t = None if (one_row_each and draw(st.booleans())) else torch.tensor(reqs, dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)

    # Which tokens valid positions may read (documented clamping), and whether any of them is garbage.
    n_eff = oracle.decode_lengths(context_lens, bt, req_t, bs)
    referenced = torch.zeros(NB, bs, dtype=torch.bool)
    for i, (r, n) in enumerate(zip(reqs, n_eff.tolist())):
        if n and 0 <= r < nreq:
            p = torch.arange(n)
            page = bt[r, p // bs].long()
            ok = (page >= 0) & (page < NB)
            referenced[page[ok], (p % bs)[ok]] = True
    dirty = bool((referenced & ~clean).any())
    R = len(lens)
    wdtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    qv, qs, w = queries(R, H, D, fmt, gen, mode, exps, wdtype, draw(st.booleans()))
    view = cache.unsqueeze(2) if draw(st.booleans()) else cache
    return Paged(fmt, H, D, bs, cbs, mode, qv, qs, w, view, bt, context_lens, req_t, referenced, clean, dirty,
                 garbage, seed)


def _rerandomise_unreferenced(cache, referenced, gen):
    """A copy of ``cache`` whose tokens outside ``referenced`` (values and scale words) are new random bytes."""
    c = formats.as_3d_cache(cache).clone()
    nb, bs, bpt = c.shape
    vb = bpt - 4
    pages = formats.page_bytes(c)
    noise = torch.randint(0, 256, pages.shape, generator=gen, dtype=torch.uint8)
    tok = (~referenced).to(torch.bool)
    vmask = tok[:, :, None].expand(nb, bs, vb).reshape(nb, bs * vb)
    smask = tok[:, :, None].expand(nb, bs, 4).reshape(nb, bs * 4)
    mask = torch.cat([vmask, smask], dim=1)
    pages.copy_(torch.where(mask, noise, pages))
    return c.unsqueeze(2) if cache.dim() == 4 else c


# ----------------------------------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------------------------------

def _valid_mask_paged(c: Paged, width, cand=None):
    """bool [R, width] x 2: positions (dense) or sparse columns that are inside a row's valid range (documented
    clamping) and whose page id is in the cache -- computed here, apart from both implementations -- and, of
    those, the ones whose token holds quantized data (not random bytes)."""
    bt = c.block_table.cpu()
    req = None if c.req_indices is None else c.req_indices.cpu()
    n = oracle.decode_lengths(c.context_lens.cpu(), bt, req, c.bs).tolist()
    R = len(n)
    reqs = list(range(R)) if req is None else req.tolist()
    NB = formats.as_3d_cache(c.cache).shape[0]
    out = torch.zeros(R, width, dtype=torch.bool)
    clean = torch.zeros(R, width, dtype=torch.bool)
    col = torch.arange(width)
    for i in range(R):
        if cand is None:
            p, ok = col, torch.ones(width, dtype=torch.bool)
        else:
            b = cand[i, col // c.cbs].long()
            p, ok = b * c.cbs + col % c.cbs, b >= 0
        ok = ok & (p < n[i])
        if not ok.any():
            continue
        page = torch.full((width,), -1, dtype=torch.long)
        page[ok] = bt[reqs[i], p[ok] // c.bs].long()
        ok = ok & (page >= 0) & (page < NB)
        out[i] = ok
        clean[i, ok] = c.clean[page[ok], p[ok] % c.bs]
    return out, clean


def assert_scores_vs_oracle(got, orc, mag, valid, clean, D, H, exact, ctx):
    """Reference scores (float32/bf16) against the float64 oracle (see module docstring). ``clean``: valid
    positions whose key holds quantized data; the others (random bytes) are only checked for NaN
    propagation where the oracle sees a NaN value byte."""
    g = got.detach().cpu().double()
    assert torch.isneginf(g[~valid]).all() and torch.isneginf(orc[~valid]).all(), f"-inf outside range {ctx}"
    assert (torch.isfinite(mag[clean]) & (mag[clean] < 1e36)).all(), f"clean data gave a huge bound {ctx}"
    assert torch.isnan(g[valid & torch.isnan(orc)]).all(), f"a NaN input did not give a NaN score {ctx}"
    gs, os_, ms = g[clean], orc[clean], mag[clean]
    assert torch.isfinite(gs).all(), f"non-finite score on clean data {ctx}"
    if exact and got.dtype == torch.float32:
        bad = gs != os_
        assert not bad.any(), f"exact data not bit-equal {ctx}: {gs[bad][:4].tolist()} vs {os_[bad][:4].tolist()}"
        return
    tol = (D + H + 2) * 2.0 ** -24 * ms + 1e-38
    if got.dtype == torch.bfloat16:
        tol = tol + os_.abs() * 2.0 ** -8
    err = (gs - os_).abs()
    assert torch.all(err <= tol), f"score error {float((err / tol).max()):.3g} x bound {ctx}"


def assert_scores_vs_reference(got, ref, mag, valid, clean, exact, ctx):
    """Kernel scores against the reference backend's float32 scores on the same device inputs: identical -inf
    outside the valid ranges; on valid positions with clean keys, bit-equal (exact data, float32 scores) or
    ``assert_scores_close`` (calc_diff < 1e-5; bf16 scores within one bf16 ulp plus the tensor cores' share of the
    oracle's magnitude ``mag``). Valid positions whose key is random bytes may score anything (the reference
    propagates NaN; a kernel need not)."""
    g = got.detach().cpu()
    r = ref.detach().cpu()
    m = mag.float()
    assert torch.isneginf(g[~valid]).all() and torch.isneginf(r[~valid]).all(), f"-inf outside range {ctx}"
    if not clean.equal(valid):
        g, r, m = g[clean], r[clean], m[clean]
        assert torch.isfinite(g).all() and torch.isfinite(r).all(), f"non-finite score on clean keys {ctx}"
    if exact and got.dtype == torch.float32:
        assert torch.equal(g, r), f"exact data not bit-equal {ctx}: {int((g != r).sum())} differ"
    elif g.numel():
        assert_scores_close(g, r, 1e-5, ctx, mag=m)  # asserts identical -inf masks and no NaN


def _sel_expected(kind, device, logits, *rest):
    """Expected selection on the same logits: the oracle (CPU) or the reference backend (kernel mode)."""
    if not kernel_mode(device):
        fn = {"topk": oracle.topk, "sparse_topk": oracle.sparse_topk, "block_topk": oracle.block_topk}[kind]
        return fn(logits, *(rest if kind == "block_topk" else rest[:-1]))
    out_cols = rest[-1]
    args = [logits] + [a.to(logits.device) if isinstance(a, torch.Tensor) else a for a in rest[:-1]]
    out = torch.full((logits.shape[0], out_cols), 123, dtype=torch.int32, device=logits.device)
    with backends.use_backend("reference"):
        getattr(ops, kind)(*args, out)
    return out.cpu().tolist()


def _sel_run(name, device, kind, logits, *rest):
    out_cols = rest[-1]
    args = [logits] + list(rest[:-1])
    out = torch.full((logits.shape[0], out_cols), 123, dtype=torch.int32, device=logits.device)
    _note_backend(name, device, kind, *args, out)
    getattr(ops, kind)(*args, out)
    return out.cpu().tolist()


def _check_selection(name, device, kind, logits, *rest):
    """Run a selection op on ``logits`` and compare it with the expected selection on the same logits."""
    got = _sel_run(name, device, kind, logits, *rest)
    cpu_rest = [a.cpu() if isinstance(a, torch.Tensor) else a for a in rest]
    exp = _sel_expected(kind, device, logits if kernel_mode(device) else logits.cpu(),
                        *(rest if kernel_mode(device) else cpu_rest))
    assert got == exp, f"{kind} differs: first rows {got[:2]} vs {exp[:2]}"
    return got


def _ws(rows, width, device, small):
    if small:  # one or two rows per chunk: the end-to-end op runs its rows in several launches
        n = workspace.min_workspace_bytes(width) + (workspace.row_stride(width) * 4 + 8 if rows > 2 else 0)
    else:
        n = workspace.workspace_bytes(max(rows, 1), width)
    return torch.full((n,), 0xAB, dtype=torch.uint8, device=device)


# ----------------------------------------------------------------------------------------------------
# Tests: decode
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_fuzz_decode(device, sparse):
    _skip_unavailable(device)
    name = f"decode-{'sparse' if sparse else 'dense'}"

    @FUZZ
    @given(c=paged_cases(sparse), data=st.data())
    @_budgeted((name, device))
    def run(c, data):
        _decode_case(name, device, c, sparse, data)
        _count(name, device)
    run()


def _decode_case(name, device, c, sparse, data):
    gen = torch.Generator().manual_seed(c.seed + 1)
    d = c.to(device)
    R = c.context_lens.shape[0]
    n_eff = oracle.decode_lengths(c.context_lens, c.block_table, c.req_indices, c.bs)
    maxn = int(n_eff.max()) if R else 0
    ldt = data.draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]), label="logits dtype")
    exact = c.mode in ("exact", "allequal", "zeros")
    base = (d.q, d.q_scale, d.cache, d.weights, d.context_lens, d.block_table, d.req_indices)
    ctx = f"[{c.fmt} H{c.H} D{c.D} bs{c.bs} cbs{c.cbs} {c.mode} garbage={c.garbage} dirty={c.dirty} seed={c.seed}]"
    k = data.draw(st.integers(1, LIM.max_k), label="k")
    nbk = data.draw(st.integers(1, LIM.max_cand), label="candidate blocks")
    small_ws = data.draw(st.booleans(), label="small workspace")

    if not sparse:
        L = max(1, maxn + data.draw(st.integers(-3, 5), label="extra columns"))
        op, extra = "paged_mqa_logits", ()
        valid, clean = _valid_mask_paged(c, L)
    else:
        cand = cases.candidates(n_eff.tolist(), nbk, c.cbs, gen, junk=data.draw(st.booleans(), label="junk"))
        if data.draw(st.booleans(), label="holes") and nbk > 1:
            cand[:, 0] = -1  # a -1 before valid ids (out of contract: its columns are -inf)
        L = nbk * c.cbs
        op, extra = "paged_sparse_mqa_logits", (cand.to(device), c.cbs)
        valid, clean = _valid_mask_paged(c, L, cand)
    logits = torch.full((R, L), 7.0, dtype=ldt, device=device)
    _note_backend(name, device, op, *base, *extra, logits)
    getattr(ops, op)(*base, *extra, logits)

    if not sparse:
        orc, mag = oracle.paged_mqa_logits(c.q, c.q_scale, c.cache, c.weights, c.context_lens, c.block_table,
                                           c.req_indices, L)
    else:
        orc, mag = oracle.paged_sparse_mqa_logits(c.q, c.q_scale, c.cache, c.weights, c.context_lens,
                                                  c.block_table, c.req_indices, cand, c.cbs)
    if kernel_mode(device):
        ref = torch.full(logits.shape, 7.0, device=device)  # float32: the oracle for bf16 logits too
        with backends.use_backend("reference"):
            getattr(ops, op)(*base, *extra, ref)
        assert_scores_vs_reference(logits, ref, mag, valid, clean, exact, ctx)
    else:
        assert_scores_vs_oracle(logits, orc, mag, valid, clean, c.D, c.H, exact, ctx)

    # Bytes no valid position reads never matter.
    if c.garbage:
        other = _rerandomise_unreferenced(c.cache, c.referenced, gen).to(device)
        again = torch.full_like(logits, -7.0)
        getattr(ops, op)(d.q, d.q_scale, other, *base[3:], *extra, again)
        assert torch.equal(again.view(torch.uint8) if again.dtype != torch.float32 else again.view(torch.int32),
                           logits.view(torch.uint8) if logits.dtype != torch.float32 else logits.view(torch.int32)), \
            f"unreferenced cache bytes changed the scores {ctx}"

    # Selections on these very logits, then the end-to-end op (same scores: the selection must agree).
    lens_t = n_eff.clamp(max=BIG).to(torch.int32).to(device)
    f32 = _f32_logits(op, base + extra, logits)
    _check_selections_and_end_to_end("decode", name, device, c, sparse, base, extra, logits, f32, lens_t, k,
                                      nbk, L, R, small_ws, ctx)


def _check_selections_and_end_to_end(kind, name, device, c, sparse, base, extra, logits, f32, lens_t, k, nbk, L,
                                     rows, small_ws, ctx):
    """Selections on the scoring op's logits (and on their float32 form), then the end-to-end op of ``kind``
    ("decode" / "prefill"), which selects from the same scores and so must agree with them."""
    if not sparse:
        _check_selection(name, device, "topk", logits, lens_t, k, k)
        _check_selection(name, device, "block_topk", logits, lens_t, c.cbs, nbk)
        sel = _check_selection(name, device, "topk", f32, lens_t, k, k)
        blocks = _check_selection(name, device, "block_topk", f32, lens_t, c.cbs, nbk)
        op = f"indexer_{kind}"
        idx = torch.full((rows, k), 55, dtype=torch.int32, device=device)
        cbo = torch.full((rows, nbk), 55, dtype=torch.int32, device=device)
        e2e = (*base, L, k, c.cbs, _ws(rows, L, device, small_ws), idx, cbo)
        _note_backend(name, device, op, *e2e)
        getattr(ops, op)(*e2e)
        _e2e_agrees(name, device, op, e2e, idx.cpu().tolist(), sel, ctx)
        _e2e_agrees(name, device, op, e2e, cbo.cpu().tolist(), blocks, ctx)
    else:
        _check_selection(name, device, "sparse_topk", logits, extra[0], c.cbs, lens_t, k, k)
        sel = _check_selection(name, device, "sparse_topk", f32, extra[0], c.cbs, lens_t, k, k)
        op = f"sparse_indexer_{kind}"
        idx = torch.full((rows, k), 55, dtype=torch.int32, device=device)
        e2e = (*base, extra[0], c.cbs, k, _ws(rows, L, device, small_ws), idx)
        _note_backend(name, device, op, *e2e)
        getattr(ops, op)(*e2e)
        _e2e_agrees(name, device, op, e2e, idx.cpu().tolist(), sel, ctx)


def _f32_logits(op, args, logits):
    """The scores the end-to-end op selects from: its workspace holds float32 logits whatever dtype the
    scoring op was asked for."""
    if logits.dtype == torch.float32:
        return logits
    out = torch.full(logits.shape, 7.0, dtype=torch.float32, device=logits.device)
    getattr(ops, op)(*args, out)
    return out


def _e2e_agrees(name, device, op, args, got, expected, ctx):
    """The end-to-end op composes the stages over the same scores: its selection equals the selection op's on
    the scoring op's logits. (A fused end-to-end kernel would be held to the same result only up to score
    rounding; none is registered, so this is checked exactly; the check adapts if one appears.)"""
    be = backends.select(op, *args).name
    if be == "reference":
        assert got == expected, f"{op} differs from its stages on the same scores {ctx}: {got[:2]} vs {expected[:2]}"
    else:  # a fused kernel: same counts and -1 layout
        for g, e in zip(got, expected):
            assert sum(x >= 0 for x in g) == sum(x >= 0 for x in e), f"{op} ({be}) count differs {ctx}"


# ----------------------------------------------------------------------------------------------------
# Tests: prefill
# ----------------------------------------------------------------------------------------------------

@dataclass
class Prefill:
    fmt: str
    H: int
    D: int
    cbs: int
    mode: str
    q: torch.Tensor
    q_scale: object
    weights: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    garbage_rows: torch.Tensor   # bool [N]: packed rows outside every request
    clean: torch.Tensor          # bool [N]: rows holding quantized data (not random bytes)
    referenced: torch.Tensor     # bool [N]: rows some valid position reads
    dirty: bool
    garbage: bool
    seed: int

    def __repr__(self):
        return (f"Prefill({self.fmt} H{self.H} D{self.D} cbs{self.cbs} {self.mode} garbage={self.garbage} "
                f"dirty={self.dirty} seed={self.seed} N={self.k.shape[0]} ks={self.ks.tolist()} ke={self.ke.tolist()})")


@st.composite
def prefill_cases(draw):
    fmt = draw(st.sampled_from(formats.FORMATS))
    H = draw(st.sampled_from(LIM.heads))
    D = draw(st.sampled_from(formats.HEAD_DIMS))
    cbs = draw(st.sampled_from(formats.CANDIDATE_BLOCK_SIZES))
    mode = draw(st.sampled_from(DATA_MODES))
    exps = draw(scale_exps()) if mode == "scaled" else (0, 0, 0)
    garbage = draw(st.booleans())
    nan_valid = garbage and draw(st.integers(0, 3)) == 0
    seed = draw(st.integers(0, 2 ** 31 - 1))
    gen = torch.Generator().manual_seed(seed)
    nreq = draw(st.integers(1, LIM.max_reqs))
    seq = draw(st.lists(lengths_for(cbs, LIM.max_len), min_size=nreq, max_size=nreq))
    gaps = draw(st.lists(st.sampled_from([0, 0, 1, 3]), min_size=nreq + 1, max_size=nreq + 1))
    starts, pos = [], gaps[0]
    for n, g in zip(seq, gaps[1:]):
        starts.append(pos)
        pos += n + g
    N = pos
    vb = formats.value_bytes(fmt, D)
    kbytes = (torch.randint(0, 256, (N, vb), generator=gen, dtype=torch.uint8) if garbage
              else torch.zeros(N, vb, dtype=torch.uint8))
    sbytes = (torch.randint(0, 256, (N, 4), generator=gen, dtype=torch.uint8) if garbage
              else torch.zeros(N, 4, dtype=torch.uint8))
    garbage_rows = torch.ones(N, dtype=torch.bool)
    for a, n in zip(starts, seq):
        if n:
            v, s = formats.quantize_rows(cases.with_duplicates(_rows((n, D), fmt, gen, mode, exps[1]), gen), fmt)
            kbytes[a:a + n] = v.view(torch.uint8).view(n, vb)
            sbytes[a:a + n] = s.contiguous().view(torch.uint8).view(n, 4)
            garbage_rows[a:a + n] = False
    corrupt = torch.zeros(N, dtype=torch.bool)
    if nan_valid and sum(seq):
        r = draw(st.sampled_from([i for i in range(nreq) if seq[i]]))
        for p in draw(st.lists(st.integers(0, seq[r] - 1), min_size=1, max_size=3)):
            corrupt[starts[r] + p] = True
            if draw(st.booleans()):
                kbytes[starts[r] + p, :4] = _nan_bytes(fmt, 4, gen)
            else:
                sbytes[starts[r] + p] = _bad_scale(fmt, 1, gen).view(torch.uint8)
    ks, ke = [], []
    for a, n in zip(starts, seq):
        rows = draw(st.lists(st.integers(0, n), min_size=1, max_size=4, unique=True))
        for r in sorted(rows):
            ks.append(a), ke.append(a + r)
    for kind in draw(st.lists(st.sampled_from(["empty0", "emptyN", "neg", "past", "swapped"]), max_size=2)):
        a = draw(st.integers(0, N))
        ks.append({"empty0": 0, "emptyN": N, "neg": -draw(st.integers(1, BIG)), "past": a, "swapped": a}[kind])
        ke.append({"empty0": 0, "emptyN": N, "neg": draw(st.integers(0, N)), "past": N + draw(st.integers(1, 1000)),
                   "swapped": max(0, a - 3)}[kind])
    ks_t, ke_t = torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)
    referenced = torch.zeros(N, dtype=torch.bool)
    n_eff = oracle.prefill_lengths(ks_t, ke_t, N)
    for a, n in zip(ks_t.tolist(), n_eff.tolist()):
        a = min(max(a, 0), N)
        referenced[a:a + n] = True
    clean = ~corrupt & (~garbage_rows | (not garbage))
    dirty = bool((referenced & ~clean).any())
    kdt = formats.FP8_DTYPE if fmt == "fp8" else (torch.int8 if draw(st.booleans()) else torch.uint8)
    k = kbytes.view(kdt)
    k_scale = sbytes.view(torch.float32 if fmt == "fp8" else torch.int32).view(N)
    T = len(ks)
    wdtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    qv, qs, w = queries(T, H, D, fmt, gen, mode, exps, wdtype, draw(st.booleans()))
    return Prefill(fmt, H, D, cbs, mode, qv, qs, w, k, k_scale, ks_t, ke_t, garbage_rows, clean, referenced, dirty,
                   garbage, seed)


def _valid_mask_prefill(c: Prefill, width, cand=None):
    """(valid, clean) bool [T, width], as :func:`_valid_mask_paged` for packed K."""
    N = c.k.shape[0]
    n = oracle.prefill_lengths(c.ks, c.ke, N).tolist()
    start = c.ks.long().clamp(0, N).tolist()
    out = torch.zeros(len(n), width, dtype=torch.bool)
    clean = torch.zeros(len(n), width, dtype=torch.bool)
    col = torch.arange(width)
    for i in range(len(n)):
        if cand is None:
            p, ok = col, torch.ones(width, dtype=torch.bool)
        else:
            b = cand[i, col // c.cbs].long()
            p, ok = b * c.cbs + col % c.cbs, b >= 0
        ok = ok & (p < n[i])
        out[i] = ok
        clean[i, ok] = c.clean[start[i] + p[ok]]
    return out, clean


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_fuzz_prefill(device, sparse):
    _skip_unavailable(device)
    name = f"prefill-{'sparse' if sparse else 'dense'}"

    @FUZZ
    @given(c=prefill_cases(), data=st.data())
    @_budgeted((name, device))
    def run(c, data):
        _prefill_case(name, device, c, sparse, data)
        _count(name, device)
    run()


def _prefill_case(name, device, c, sparse, data):
    gen = torch.Generator().manual_seed(c.seed + 1)
    T, N = c.ks.shape[0], c.k.shape[0]
    n_eff = oracle.prefill_lengths(c.ks, c.ke, N)
    maxn = int(n_eff.max())
    ldt = data.draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]), label="logits dtype")
    exact = c.mode in ("exact", "allequal", "zeros")
    dv = lambda t: None if t is None else t.to(device)  # noqa: E731
    base = (dv(c.q), dv(c.q_scale), dv(c.k), dv(c.k_scale), dv(c.weights), dv(c.ks), dv(c.ke))
    ctx = f"[{c.fmt} H{c.H} D{c.D} cbs{c.cbs} {c.mode} garbage={c.garbage} dirty={c.dirty} seed={c.seed}]"
    k = data.draw(st.integers(1, LIM.max_k), label="k")
    nbk = data.draw(st.integers(1, LIM.max_cand), label="candidate blocks")
    small_ws = data.draw(st.booleans(), label="small workspace")
    if not sparse:
        L = max(1, maxn + data.draw(st.integers(0, 5), label="extra columns"))
        op, extra = "mqa_logits", ()
        valid, clean = _valid_mask_prefill(c, L)
    else:
        cand = cases.candidates(n_eff.tolist(), nbk, c.cbs, gen, junk=data.draw(st.booleans(), label="junk"))
        L = nbk * c.cbs
        op, extra = "sparse_mqa_logits", (cand.to(device), c.cbs)
        valid, clean = _valid_mask_prefill(c, L, cand)
    logits = torch.full((T, L), 7.0, dtype=ldt, device=device)
    _note_backend(name, device, op, *base, *extra, logits)
    getattr(ops, op)(*base, *extra, logits)
    if not sparse:
        orc, mag = oracle.mqa_logits(c.q, c.q_scale, c.k, c.k_scale, c.weights, c.ks, c.ke, L)
    else:
        orc, mag = oracle.sparse_mqa_logits(c.q, c.q_scale, c.k, c.k_scale, c.weights, c.ks, c.ke, cand, c.cbs)
    if kernel_mode(device):
        ref = torch.full(logits.shape, 7.0, device=device)  # float32: the oracle for bf16 logits too
        with backends.use_backend("reference"):
            getattr(ops, op)(*base, *extra, ref)
        assert_scores_vs_reference(logits, ref, mag, valid, clean, exact, ctx)
    else:
        assert_scores_vs_oracle(logits, orc, mag, valid, clean, c.D, c.H, exact, ctx)

    if c.garbage and (~c.referenced).any():
        kb = c.k.view(torch.uint8).clone()
        sb = c.k_scale.view(torch.uint8).view(N, 4).clone()
        un = ~c.referenced
        kb[un] = torch.randint(0, 256, (int(un.sum()), kb.shape[1]), generator=gen, dtype=torch.uint8)
        sb[un] = torch.randint(0, 256, (int(un.sum()), 4), generator=gen, dtype=torch.uint8)
        k2 = kb.view(c.k.dtype).to(device)
        s2 = sb.view(c.k_scale.dtype).view(N).to(device)
        again = torch.full_like(logits, -7.0)
        getattr(ops, op)(base[0], base[1], k2, s2, *base[4:], *extra, again)
        assert torch.equal(again.float(), logits.float()) or torch.equal(again.view(torch.uint8),
                                                                         logits.view(torch.uint8)), \
            f"unreferenced packed rows changed the scores {ctx}"

    lens_t = n_eff.to(torch.int32).to(device)
    f32 = _f32_logits(op, base + extra, logits)
    _check_selections_and_end_to_end("prefill", name, device, c, sparse, base, extra, logits, f32, lens_t, k,
                                      nbk, L, T, small_ws, ctx)


# ----------------------------------------------------------------------------------------------------
# Tests: selection ops on extreme logits
# ----------------------------------------------------------------------------------------------------

def _f32(bits):
    return torch.tensor([bits - 2 ** 32 if bits >= 2 ** 31 else bits], dtype=torch.int32).view(torch.float32)[0]


SPECIALS = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), float(_f32(0xFFC00000)),
            float(_f32(0x7FC00001)), 3.4e38, -3.4e38, 1e-45, -1e-45, 1.1754944e-38, 2.0 ** 100]
ROW_KINDS = ("ints", "equal", "gauss", "special", "mixed", "signed_zeros", "nan_heavy", "huge_tiny")


def _logit_row(kind, L, gen):
    if kind == "ints":
        return torch.randint(-3, 4, (L,), generator=gen).float()
    if kind == "equal":
        return torch.full((L,), float(torch.randn(1, generator=gen)))
    if kind == "gauss":
        return torch.randn(L, generator=gen)
    sp = torch.tensor(SPECIALS)
    if kind == "special":
        return sp[torch.randint(0, len(SPECIALS), (L,), generator=gen)]
    if kind == "signed_zeros":
        return torch.where(torch.rand(L, generator=gen) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
    if kind == "huge_tiny":
        e = torch.randint(-149, 128, (L,), generator=gen).float()
        return torch.sign(torch.randn(L, generator=gen)) * torch.pow(2.0, e)
    x = torch.randint(-2, 3, (L,), generator=gen).float()
    m = torch.rand(L, generator=gen)
    frac = 0.7 if kind == "nan_heavy" else 0.2
    x[m < frac] = sp[torch.randint(0, len(SPECIALS), (int((m < frac).sum()),), generator=gen)]
    return x


@st.composite
def selection_cases(draw):
    R = draw(st.integers(1, LIM.max_rows))
    L = draw(st.one_of(st.integers(1, 80), st.integers(1, LIM.max_width)))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=R, max_size=R))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    logits = torch.stack([_logit_row(kd, L, gen) for kd in kinds]).to(dtype)
    edge = [0, 1, L - 1, L, L + 1, -1, -BIG, BIG]
    lengths = torch.tensor(draw(st.lists(st.one_of(st.sampled_from(edge), st.integers(0, L)), min_size=R,
                                         max_size=R)), dtype=torch.int32)
    k = draw(st.one_of(st.integers(1, min(LIM.max_k, formats.MAX_TOPK)),
                       st.sampled_from([1, max(1, L - 1), L, L + 1]).filter(lambda v: v <= formats.MAX_TOPK)))
    padded = draw(st.booleans())  # rows padded in memory (stride(0) > width)
    return logits, lengths, k, padded, seed, kinds


def _pad_rows(x, pad):
    if not pad:
        return x
    base = torch.full((x.shape[0], x.shape[1] + 5), 9.0, dtype=x.dtype, device=x.device)
    base[:, : x.shape[1]] = x
    return base[:, : x.shape[1]]


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_selection(device):
    _skip_unavailable(device)
    name = "selection"

    @FUZZ_LIGHT
    @given(case=selection_cases(), data=st.data())
    @_budgeted((name, device))
    def run(case, data):
        logits, lengths, k, padded, seed, kinds = case
        gen = torch.Generator().manual_seed(seed + 1)
        R, L = logits.shape
        x = _pad_rows(logits.to(device), padded)
        _check_selection(name, device, "topk", x, lengths.to(device), k, k)
        cbs = data.draw(st.sampled_from(formats.CANDIDATE_BLOCK_SIZES), label="cbs")
        nbk = data.draw(st.integers(1, (L + cbs - 1) // cbs + 2), label="num_blocks")
        _check_selection(name, device, "block_topk", x, lengths.to(device), cbs, nbk)
        # Sparse: candidate lists over the rows' lengths (junk ids past n and -1 padding included).
        nsp = data.draw(st.integers(1, max(1, min(LIM.max_cand * 4, L // cbs + 1))), label="sparse blocks")
        W = nsp * cbs
        slog = torch.stack([_logit_row(kd, W, gen) for kd in kinds]).to(logits.dtype)
        ns = lengths.clamp(0, 4 * W + 17)
        cand = cases.candidates(ns.tolist(), nsp, cbs, gen, junk=True)
        _check_selection(name, device, "sparse_topk", _pad_rows(slog.to(device), padded), cand.to(device), cbs,
                         lengths.to(device), k, k)
        _count(name, device)
    run()


# ----------------------------------------------------------------------------------------------------
# Tests: cache write, gather, query quantization (byte-exact)
# ----------------------------------------------------------------------------------------------------

# Rows whose values sit exactly on rounding midpoints of the format (ties to even) after scaling.
_E4M3_MIDS = [(a[0] + b[0]) / 2 for a, b in zip(oracle._E4M3_POS[:-1], oracle._E4M3_POS[1:])]


def _quant_rows(shape, fmt, gen, mode, exp):
    D = shape[-1]
    if mode == "midpoints":
        if fmt == "fp8":
            mids = torch.tensor(_E4M3_MIDS)
            x = mids[torch.randint(0, len(mids), shape, generator=gen)]
            x[..., 0] = 448.0
        else:
            mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
            x = mids[torch.randint(0, len(mids), shape, generator=gen)]
            x[..., ::32] = 6.0
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        return x * sign * 2.0 ** exp
    if mode == "zeros":
        return torch.zeros(shape)
    if mode == "tiny":  # below the amax floor: everything flushes to zero codes
        return torch.randn(shape, generator=gen) * 1e-9
    return torch.randn(shape, generator=gen) * 10.0 ** exp


@st.composite
def cache_op_cases(draw):
    fmt = draw(st.sampled_from(formats.FORMATS))
    D = draw(st.sampled_from(formats.HEAD_DIMS))
    bs = draw(st.sampled_from(LIM.block_sizes))
    mode = draw(st.sampled_from(["gauss", "midpoints", "zeros", "tiny", "scaled"]))
    kdtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    hi = {torch.float16: 3, torch.bfloat16: 30, torch.float32: 30}[kdtype]
    exp = draw(st.integers(-20, hi)) if mode in ("scaled", "midpoints") else 0
    if mode == "midpoints" and kdtype == torch.float16:
        exp = min(exp, 5) if fmt == "mxfp4" else min(exp, 6)
        exp = max(exp, -6)
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return fmt, D, bs, mode, kdtype, exp, seed


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_cache_ops(device):
    _skip_unavailable(device)
    name = "cache-ops"

    @FUZZ_LIGHT
    @given(case=cache_op_cases(), data=st.data())
    @_budgeted((name, device))
    def run(case, data):
        fmt, D, bs, mode, kdtype, exp, seed = case
        gen = torch.Generator().manual_seed(seed)
        NB = data.draw(st.integers(1, 4), label="pages")
        bpt = formats.bytes_per_token(fmt, D)
        cache = torch.randint(0, 256, (NB, bs, bpt), generator=gen, dtype=torch.uint8)
        T = data.draw(st.integers(0, min(NB * bs, 24 if PROFILE == "ci" else 512)), label="tokens")
        slots = torch.randperm(NB * bs, generator=gen)[:T]
        extra = data.draw(st.lists(st.sampled_from([-1, -BIG, NB * bs, NB * bs + 5]), max_size=3), label="skipped")
        slots = torch.cat([slots, torch.tensor(extra, dtype=torch.int64)])
        slots = slots[torch.randperm(len(slots), generator=gen)]
        k = _quant_rows((len(slots), D), fmt, gen, mode, exp).to(kdtype)
        assert torch.isfinite(k).all()
        pow2 = True if fmt == "mxfp4" else data.draw(st.booleans(), label="pow2")
        sdt = data.draw(st.sampled_from([torch.int64, torch.int32]), label="slot dtype")
        dev_cache = cache.clone().to(device)
        view = dev_cache.unsqueeze(2) if data.draw(st.booleans(), label="4-D") else dev_cache
        wargs = (k.to(device), slots.to(sdt).to(device), view, fmt, pow2)
        _note_backend(name, device, "write_k_cache", *wargs)
        ops.write_k_cache(*wargs)
        if kernel_mode(device):
            want = cache.clone().to(device)
            with backends.use_backend("reference"):
                ops.write_k_cache(k.to(device), slots.to(sdt).to(device), want, fmt, pow2)
            assert torch.equal(dev_cache.cpu(), want.cpu()), \
                f"write_k_cache: {int((dev_cache.cpu() != want.cpu()).sum())} bytes differ"
        else:
            assert torch.equal(oracle.cache_pages(dev_cache), oracle.write_k_cache(k, slots, cache, fmt, pow2))

        # gather_k from the written cache: requests over random pages (holes and ids past the cache).
        nreq = data.draw(st.integers(1, 3), label="requests")
        MB = data.draw(st.integers(1, 3), label="max blocks")
        bt = torch.randint(-1, NB + 1, (nreq, MB), generator=gen, dtype=torch.int32)
        lens = data.draw(st.lists(st.integers(0, MB * bs + 3), min_size=nreq, max_size=nreq), label="lens")
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        Nr = int(cu[-1]) + data.draw(st.integers(0, 3), label="spare rows")
        vb = formats.value_bytes(fmt, D)
        kb = torch.randint(0, 256, (Nr, vb), generator=gen, dtype=torch.uint8)
        sb = torch.randint(0, 256, (Nr, 4), generator=gen, dtype=torch.uint8)
        kdt = formats.FP8_DTYPE if fmt == "fp8" else torch.uint8
        sdt2 = torch.float32 if fmt == "fp8" else torch.int32
        kk, ss = kb.clone().view(kdt).to(device), sb.clone().view(sdt2).view(Nr).to(device)
        gargs = (dev_cache, bt.to(device), cu.to(device), kk, ss, fmt)
        _note_backend(name, device, "gather_k", *gargs)
        ops.gather_k(*gargs)
        if kernel_mode(device):
            k2, s2 = kb.clone().view(kdt).to(device), sb.clone().view(sdt2).view(Nr).to(device)
            with backends.use_backend("reference"):
                ops.gather_k(dev_cache, bt.to(device), cu.to(device), k2, s2, fmt)
            assert torch.equal(oracle.u8(kk), oracle.u8(k2)) and torch.equal(oracle.u8(ss), oracle.u8(s2))
        else:
            ev, es = oracle.gather_k(dev_cache, bt, cu, Nr, fmt)
            gv, gs = oracle.u8(kk), oracle.u8(ss).view(Nr, 4)
            for t in range(Nr):
                assert gv[t].tolist() == (kb[t].tolist() if ev[t] is None else ev[t].tolist()), t
                assert gs[t].tolist() == (sb[t].tolist() if es[t] is None else es[t].tolist()), t

        # quantize_q on the same kind of values.
        Tq = data.draw(st.integers(0, 3), label="q rows")
        H = data.draw(st.sampled_from([4, 8, 12] if PROFILE == "ci" else list(LIM.heads)), label="H")
        q = _quant_rows((Tq, H, D), fmt, gen, mode, exp).to(kdtype)
        w = torch.randn(Tq, H, generator=gen).to(data.draw(st.sampled_from([torch.float32, torch.bfloat16]),
                                                          label="w dtype"))
        wscale = data.draw(st.sampled_from([1.0, 0.5, 0.0883883, 3.0e-3]), label="weight_scale")
        qargs = (q.to(device), w.to(device), fmt, wscale)
        _note_backend(name, device, "quantize_q", *qargs)
        qv, qs, wf = ops.quantize_q(*qargs)
        if kernel_mode(device):
            with backends.use_backend("reference"):
                rv, rs, rw = ops.quantize_q(*qargs)
            assert torch.equal(oracle.u8(qv), oracle.u8(rv)), "quantize_q values differ"
            assert (qs is None) == (rs is None) and (qs is None or torch.equal(qs.cpu(), rs.cpu()))
            assert torch.equal(wf.cpu().view(torch.int32), rw.cpu().view(torch.int32)), "quantize_q weights differ"
        else:
            ev, es, ew = oracle.quantize_q(q, w, fmt, wscale)
            assert torch.equal(oracle.u8(qv).view(ev.shape), ev)
            if fmt == "mxfp4":
                assert torch.equal(oracle.int32_bytes(qs), es)
            assert torch.equal(wf.cpu().double(), ew)
        _count(name, device)
    run()
