"""IndexerMetadataBuilder against a plain-Python implementation of the row rules (SPEC sections 4 and 6,
torch_sparse_indexer/metadata.py's docstring): random engine inputs with mixed batches, MTP, chunked
prefill, empty and padded requests, and out-of-capacity / out-of-contract device values; host-known
overflow raises; the builder works from device-side counts and reuses its buffers."""
from __future__ import annotations

import random

import pytest
import torch
import torch.utils._pytree as pytree

from torch_sparse_indexer.metadata import COUNT_NAMES, IndexerCapacities, IndexerMetadata, IndexerMetadataBuilder


# ----------------------------------------------------------------------------------------------------
# The rules, in plain Python (lists and ints only)
# ----------------------------------------------------------------------------------------------------

def python_rules(caps, qsl, seq_lens, table, nd, given_slots=None):
    R, T, Rd, N, bs = caps.max_reqs, caps.max_tokens, caps.max_decode_rows, caps.max_packed_k, caps.block_size
    n = len(seq_lens)
    width = len(table[0]) if table else 1
    starts, run = [], 0
    for x in qsl:                      # running max of max(x, 0): a decreasing entry means "no tokens"
        run = max(run, max(x, 0))
        starts.append(run)
    starts += [starts[-1]] * (R - n)
    nd = min(max(nd, 0), n)
    req = []
    raw_packed = 0
    cu = [0]
    for b in range(R):
        q = starts[b + 1] - starts[b]
        L = seq_lens[b] if b < n else 0
        valid = q <= L <= width * bs
        dec = b < nd
        pre = valid and not dec
        if pre:
            raw_packed += L
            pre = raw_packed <= N   # the packed prefix stops at the first request that does not fit
        cu.append(cu[-1] + (L if pre else 0))
        req.append(dict(q=q, L=L, valid=valid, dec=dec, pre=pre))

    def owner(t):
        for b in range(R):
            if starts[b] <= t < starts[b + 1]:
                return b
        return None

    out = dict(cu_seq_lens=cu, prefill_ks=[0] * T, prefill_ke=[0] * T, decode_context_lens=[0] * Rd,
               row_req=[-1] * T, row_len=[0] * T, slot_mapping=[-1] * T)
    decode_req = [None] * Rd
    served = 0
    for t in range(T):
        b = owner(t)
        if b is None:
            continue
        r = req[b]
        pos = r["L"] - r["q"] + (t - starts[b])
        out["row_req"][t] = b
        if r["valid"] and r["dec"] and t < Rd:
            out["decode_context_lens"][t] = pos + 1
            decode_req[t] = b
            out["row_len"][t] = pos + 1
            served += 1
        if r["pre"]:
            out["prefill_ks"][t] = cu[b]
            out["prefill_ke"][t] = cu[b] + pos + 1
            out["row_len"][t] = pos + 1
            served += 1
        if r["valid"] and given_slots is None:
            page = table[b][pos // bs]
            out["slot_mapping"][t] = page * bs + pos % bs if page >= 0 else -1
    if given_slots is not None:
        out["slot_mapping"][: len(given_slots)] = list(given_slots)
    total = starts[R]
    out["counts"] = [min(total, T), min(starts[nd], T), min(total, T) - min(starts[nd], T), cu[R], nd,
                     sum(r["q"] for r in req if r["valid"]) - served]
    return out, decode_req


# ----------------------------------------------------------------------------------------------------
# Random engine inputs
# ----------------------------------------------------------------------------------------------------

def random_step(rng: random.Random, caps, *, odd=False, mtp=None):
    """A step's engine inputs: decode requests (MTP: 1..mtp tokens) first, then prefill chunks (fresh or
    chunked: cached tokens + new), sometimes empty requests, padding to a random number of requests.
    ``odd``: also out-of-contract values (q > L, too long, decreasing query_start_loc, over capacity)."""
    R, bs, MB = caps.max_reqs, caps.block_size, caps.max_blocks_per_req
    n = rng.randint(0, R)
    n_dec = rng.randint(0, n) if caps.max_decode_rows else 0
    mtp = mtp or rng.choice([1, 1, 2, 3, 4])
    width = rng.randint(1, MB)
    cap = width * bs
    q_lens, seqs = [], []
    for b in range(n):
        kind = rng.random()
        if b < n_dec:
            q = rng.randint(1, mtp)
            L = rng.randint(q, cap)
        elif kind < 0.1:
            q, L = 0, rng.choice([0, rng.randint(0, cap)])          # empty or padding request
        else:
            L = rng.randint(1, cap)
            q = rng.randint(1, min(L, max(1, caps.max_prefill_rows // 2 + 1)))
            if rng.random() < 0.4:
                q = L                                              # fresh prefill (nothing cached)
        if odd and rng.random() < 0.15:
            q = L + rng.randint(1, 3)                              # more new tokens than the sequence
        if odd and rng.random() < 0.1:
            L = cap + rng.randint(1, bs)                           # longer than the block table holds
        q_lens.append(q)
        seqs.append(L)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    if odd and n >= 2 and rng.random() < 0.2:
        i = rng.randint(1, n)
        qsl[i] = max(0, qsl[i] - rng.randint(1, 5))                # decreasing entry
    table = [[rng.randint(-1, 40) for _ in range(width)] for _ in range(n)]
    return qsl, seqs, table, n_dec


CAPS = [
    IndexerCapacities(max_decode_rows=6, max_prefill_rows=10, max_packed_k=60, max_reqs=6, max_blocks_per_req=4,
                      block_size=16),
    IndexerCapacities(max_decode_rows=8, max_prefill_rows=0, max_packed_k=0, max_reqs=5, max_blocks_per_req=3,
                      block_size=32),
    IndexerCapacities(max_decode_rows=0, max_prefill_rows=12, max_packed_k=200, max_reqs=4,
                      max_blocks_per_req=5, block_size=16),
    IndexerCapacities(max_decode_rows=3, max_prefill_rows=5, max_packed_k=1000, max_reqs=8, max_blocks_per_req=2,
                      block_size=64),
]


def _tensors(qsl, seqs, table, dtype=torch.int32):
    q = torch.tensor(qsl, dtype=dtype)
    s = torch.tensor(seqs, dtype=dtype)
    t = torch.tensor(table, dtype=torch.int32) if table else torch.zeros(0, 1, dtype=torch.int32)
    return q, s, t


def _compare(m: IndexerMetadata, exp, decode_req, n, width, table):
    caps = m.capacities
    got = {k: getattr(m, k).tolist() for k in exp if k != "counts"}
    got["counts"] = m.counts.tolist()
    for k, v in exp.items():
        assert got[k] == v, (k, got[k], v)
    dri = m.decode_req_indices.tolist()
    for t, b in enumerate(decode_req):
        assert 0 <= dri[t] < caps.max_reqs
        if b is not None:
            assert dri[t] == b, (t, dri[t], b)
    if n:
        assert m.block_table[:n, :width].tolist() == table


@pytest.mark.parametrize("ci", range(len(CAPS)))
@pytest.mark.parametrize("odd", [False, True], ids=["in-contract", "out-of-contract"])
def test_builder_matches_python_rules(ci, odd, seed):
    caps = CAPS[ci]
    rng = random.Random(seed)
    builder = IndexerMetadataBuilder(caps)
    for it in range(60):  # the same builder every step: no state may leak from one step to the next
        qsl, seqs, table, nd = random_step(rng, caps, odd=odd)
        n = len(seqs)
        width = len(table[0]) if table else 1
        as_tensor = rng.random() < 0.5
        nd_arg = torch.tensor([nd + (rng.choice([-3, 0, 0, 5]) if odd else 0)]) if as_tensor else nd
        dtype = rng.choice([torch.int32, torch.int64])
        q, s, t = _tensors(qsl, seqs, table, dtype)
        m = builder.build(q, s, t, nd_arg)
        nd_eff = int(nd_arg) if as_tensor else nd
        exp, dreq = python_rules(caps, qsl, seqs, table, nd_eff)
        _compare(m, exp, dreq, n, width, table)


def test_named_cases():
    """Hand-checked: 2 decode requests (MTP 1 and 2), a chunked prefill (30 cached + 4 new), a fresh one,
    a padding request."""
    caps = CAPS[0]
    qsl = [0, 1, 3, 7, 9, 9]
    seqs = [20, 31, 34, 2, 0]
    table = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [-1, -1, -1, -1]]
    m = IndexerMetadataBuilder(caps).build(*_tensors(qsl, seqs, table), torch.tensor([2]))
    assert m.decode_context_lens.tolist() == [20, 30, 31, 0, 0, 0]
    assert m.decode_req_indices.tolist()[:3] == [0, 1, 1]
    assert m.cu_seq_lens.tolist() == [0, 0, 0, 34, 36, 36, 36]
    assert m.prefill_ks.tolist()[:10] == [0, 0, 0, 0, 0, 0, 0, 34, 34, 0]
    assert m.prefill_ke.tolist()[:10] == [0, 0, 0, 31, 32, 33, 34, 35, 36, 0]
    assert m.row_len.tolist()[:10] == [20, 30, 31, 31, 32, 33, 34, 1, 2, 0]
    assert m.slot_mapping.tolist()[:9] == [19, 93, 94, 158, 159, 160, 161, 192, 193]
    assert m.counts.tolist() == [9, 3, 6, 36, 2, 0]
    assert m.num_decode_tokens.tolist() == [3] and m.num_packed_k.tolist() == [36]


def test_capacity_overflow_is_masked_and_counted():
    """Device-known overflow: 4 decode tokens for 3 decode rows, packed K past its capacity, tokens past
    max_tokens. Over-capacity rows come out masked and are counted; K slots are still produced."""
    caps = IndexerCapacities(max_decode_rows=3, max_prefill_rows=4, max_packed_k=50, max_reqs=4,
                             max_blocks_per_req=4, block_size=16)
    qsl = [0, 2, 4, 7, 10]     # decode: 2 + 2 tokens; prefill: 3 + 3 tokens (row 9 is past max_tokens = 7)
    seqs = [10, 12, 40, 30]    # packed: 40 fits, 40 + 30 > 50 does not
    table = [[0, 1, 2, 3]] * 4
    m = IndexerMetadataBuilder(caps).build(*_tensors(qsl, seqs, table), 2)
    assert m.decode_context_lens.tolist() == [9, 10, 11]           # the 4th decode token has no row
    assert m.cu_seq_lens.tolist() == [0, 0, 0, 40, 40]
    assert m.prefill_ke.tolist() == [0, 0, 0, 0, 38, 39, 40]
    assert m.row_len.tolist() == [9, 10, 11, 0, 38, 39, 40]
    assert m.counts.tolist() == [7, 4, 3, 40, 2, 10 - 6]
    assert m.slot_mapping.tolist() == [8, 9, 10, 11, 37, 38, 39]


def test_packed_capacity_boundary():
    """Packed K ending exactly at max_packed_k fits; one more key does not (that request and the next are
    masked, though the next would fit on its own)."""
    caps = IndexerCapacities(max_decode_rows=1, max_prefill_rows=6, max_packed_k=50, max_reqs=3,
                             max_blocks_per_req=4, block_size=16)
    b = IndexerMetadataBuilder(caps)
    m = b.build(*_tensors([0, 1, 2, 3], [20, 30, 5], [[0, 1, 2, 3]] * 3), 0)
    assert m.cu_seq_lens.tolist() == [0, 20, 50, 50] and m.row_len.tolist()[:3] == [20, 30, 0]
    m = b.build(*_tensors([0, 1, 2, 3], [20, 31, 5], [[0, 1, 2, 3]] * 3), 0)
    assert m.cu_seq_lens.tolist() == [0, 20, 20, 20] and m.row_len.tolist()[:3] == [20, 0, 0]
    assert m.num_dropped_rows.tolist() == [2]


def test_given_slot_mapping_is_copied():
    caps = CAPS[0]
    b = IndexerMetadataBuilder(caps)
    slots = torch.tensor([5, -1, 7], dtype=torch.int64)
    m = b.build(*_tensors([0, 3], [3], [[0]]), 0, slot_mapping=slots)
    assert m.slot_mapping.tolist() == [5, -1, 7] + [-1] * (caps.max_tokens - 3)


def test_host_known_overflow_raises():
    caps = CAPS[0]
    b = IndexerMetadataBuilder(caps)
    q, s, t = _tensors([0, 1, 2], [5, 5], [[0], [1]])
    with pytest.raises(ValueError, match="query_start_loc"):
        b.build(torch.arange(caps.max_reqs + 2, dtype=torch.int32), torch.ones(caps.max_reqs + 1, dtype=torch.int32),
                torch.zeros(caps.max_reqs + 1, 1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="block_table"):
        b.build(q, s, torch.zeros(2, caps.max_blocks_per_req + 1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="seq_lens"):
        b.build(q, s[:1], t, 0)
    with pytest.raises(ValueError, match="num_decode_reqs"):
        b.build(q, s, t, 3)
    with pytest.raises(ValueError, match="slot_mapping"):
        b.build(q, s, t, 0, slot_mapping=torch.zeros(caps.max_tokens + 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="block_table"):
        b.build(q, s, t.long(), 0)
    with pytest.raises(ValueError, match="num_decode_reqs"):
        IndexerMetadataBuilder(CAPS[2]).build(q, s, t, 1)           # no decode capacity
    with pytest.raises(ValueError, match="max_reqs"):
        IndexerCapacities(max_decode_rows=1, max_prefill_rows=1, max_packed_k=1, max_reqs=0, max_blocks_per_req=1,
                          block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        IndexerCapacities(max_decode_rows=1, max_prefill_rows=1, max_packed_k=1, max_reqs=1, max_blocks_per_req=1,
                          block_size=24)


def test_metadata_is_a_pytree_with_static_capacities():
    caps = CAPS[0]
    m = IndexerMetadataBuilder(caps).build(*_tensors([0, 2], [4], [[1]]), 0)
    leaves, spec = pytree.tree_flatten(m)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert len(leaves) == 10                       # every tensor field (slot_mapping included)
    back = pytree.tree_unflatten([x.clone() for x in leaves], spec)
    assert isinstance(back, IndexerMetadata) and back.capacities == caps
    assert torch.equal(back.prefill_ke, m.prefill_ke)
    no_slots = IndexerMetadataBuilder(caps, with_slot_mapping=False).build(*_tensors([0, 2], [4], [[1]]), 0)
    assert no_slots.slot_mapping is None and len(pytree.tree_leaves(no_slots)) == 9
    assert COUNT_NAMES[5] == "num_dropped_rows"


def test_builder_outputs_live_in_its_buffers():
    """build() returns views of the builder's own buffers (static addresses for graph capture)."""
    caps = CAPS[0]
    b = IndexerMetadataBuilder(caps)
    ptrs = [t.data_ptr() for t in b.metadata_tensors()]
    m1 = b.build(*_tensors([0, 2, 5], [4, 9], [[1, 2], [3, 4]]), 1)
    m2 = b.build(*_tensors([0, 1], [7], [[5]]), torch.tensor([1]))
    for m in (m1, m2):
        assert [t.data_ptr() for t in pytree.tree_leaves(m)] == ptrs


_VIEW_OPS = {torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.as_strided.default,
             torch.ops.aten.alias.default, torch.ops.aten.view.default, torch.ops.aten.narrow.default}


def test_compiled_builder_searches_a_materialized_sequence():
    """The traced builder never hands ``searchsorted`` a view as its sorted sequence: Inductor's GPU lowering
    of searchsorted in torch 2.11 ignores a view's storage offset (pytorch/pytorch#182343; seen on the
    H200 as request indices off by one), so the sequence must be computed into a buffer of its own."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def backend(gm, example_inputs):
        def fw(g, inputs):
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    caps = CAPS[0]
    builder = IndexerMetadataBuilder(caps)
    qsl, seqs, table, nd = random_step(random.Random(0), caps, odd=False)
    args = _tensors(qsl, seqs, table, torch.int32) + (torch.tensor([nd]),)
    torch._dynamo.reset()
    torch.compile(builder.build, backend=backend, fullgraph=True)(*args)
    nodes = [n for g in graphs for n in g.graph.nodes if n.target is torch.ops.aten.searchsorted.Tensor]
    assert nodes, "the builder should call searchsorted"
    for n in nodes:
        seq = n.args[0]
        assert seq.op != "placeholder" and seq.target not in _VIEW_OPS, f"searchsorted on {seq.format_node()}"
