"""Single-process tests of the KV-transfer reference (torch_cam.kv_reference).

A "model" KV cache (per layer: [2, num_tokens, total_heads, head_dim], every element distinct) is
scattered into the source TP group's pools, moved with reference_transfer, and every destination
pool is then compared whole against a pool built independently here with per-token Python loops:
the written slots must hold the model values of that rank's heads, and every other element must be
unchanged (pools start from a distinct negative fill)."""
import math
import random

import pytest
import torch

from torch_cam import kv_reference as ref
from torch_cam.kv_reference import KVLayout

D = 3          # head_dim
L = 3          # layers


def layout(kind="mha", tp=1, heads=4, bs=4, nb=8, order="NHD", dtype=torch.float32, layers=L,
           head_dim=D):
    """Rank-0 layout of a TP group holding ``heads`` total KV heads."""
    if kind == "mla":
        return KVLayout("mla", layers, nb, bs, 1, head_dim, dtype, order, 0, tp)
    per = heads // tp if tp <= heads else 1
    return KVLayout("mha", layers, nb, bs, per, head_dim, dtype, order, 0, tp, heads)


def model_kv(lay, num_tokens):
    """Distinct exact values per layer: mha [2, T, H, D], mla [T, D]."""
    out = []
    for l in range(lay.num_layers):
        shape = ((num_tokens, lay.head_dim) if lay.kind == "mla"
                 else (2, num_tokens, lay.total_kv_heads, lay.head_dim))
        out.append((torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
                    + 1 + 1000 * l).to(lay.dtype))
    return out


def filled_pools(lay, seed):
    """Per-rank pools of a TP group, filled with distinct negative values (never model values)."""
    pools = []
    for r in range(lay.tp_size):
        layers = []
        for l in range(lay.num_layers):
            n = math.prod(lay.pool_shape())
            base = -(1 + seed * 100000 + r * 10000 + l * 1000)
            layers.append((base - torch.arange(n, dtype=torch.float32)).reshape(lay.pool_shape())
                          .to(lay.dtype))
        pools.append(layers)
    return pools


def block_ids(lay, num_tokens, seed):
    """A shuffled, non-contiguous list of the blocks covering num_tokens (plus one spare id)."""
    need = -(-num_tokens // lay.block_size)
    ids = list(range(lay.num_blocks))
    random.Random(seed).shuffle(ids)
    return ids[:min(need + 1, lay.num_blocks)]


def expected_pool(before, lay, ids, kv_local, num_tokens):
    """Independent model of a scatter: per-token loop with explicit physical indexing."""
    out = before.clone()
    for t in range(num_tokens):
        b, s = ids[t // lay.block_size], t % lay.block_size
        if lay.kind == "mla":
            out[b, s] = kv_local[t]
        elif lay.order == "NHD":
            out[:, b, s] = kv_local[:, t]
        else:
            out[:, b, :, s] = kv_local[:, t]
    return out


def local_heads(kv, lay):
    if lay.kind == "mla":
        return kv
    h = lay.heads()
    return kv[:, :, h.start:h.stop]


def setup_source(src, num_tokens, seed=1):
    gt = model_kv(src, num_tokens)
    ids = block_ids(src, num_tokens, seed)
    pools = filled_pools(src, seed)
    for r, lay in enumerate(src.tp_group()):
        ref.scatter_tokens(pools[r], lay, ids, [ref.shard_heads(t, lay) for t in gt])
    return gt, ids, pools


def snapshot(pools):
    return [None if p is None else [t.clone() for t in p] for p in pools]


def same(a, b):
    return all((x is None and y is None) or all(torch.equal(u, v) for u, v in zip(x, y))
               for x, y in zip(a, b))


def run_and_check(src, dst, num_tokens, layers=None, gt_dtype=None, **kw):
    gt, s_ids, s_pools = setup_source(src, num_tokens, seed=1)
    d_ids = block_ids(dst, num_tokens, seed=2)
    d_pools = filled_pools(dst, seed=2)
    before = snapshot(d_pools)
    s_before = snapshot(s_pools)
    plans = ref.reference_transfer(s_pools, src.tp_group(), s_ids, d_pools, dst.tp_group(), d_ids,
                                   num_tokens, layers, **kw)
    assert len(plans) == dst.tp_size
    written = set(range(dst.num_layers)) if layers is None else set(layers)
    for r, lay in enumerate(dst.tp_group()):
        for l in range(dst.num_layers):
            if l in written:
                want = expected_pool(before[r][l], lay, d_ids,
                                     local_heads(gt[l], lay).to(dst.dtype), num_tokens)
            else:
                want = before[r][l]
            assert torch.equal(d_pools[r][l], want), (r, l)
        got = ref.gather_tokens(d_pools[r], lay, d_ids, num_tokens, layers=sorted(written))
        for l, g in zip(sorted(written), got):
            assert torch.equal(g, local_heads(gt[l], lay).to(dst.dtype))
    assert same(s_pools, s_before), "source pools were modified"
    return plans


# ---------------------------------------------------------------------------------------------------
# KVLayout
# ---------------------------------------------------------------------------------------------------

def test_layout_shapes_bytes_heads():
    nhd = KVLayout("mha", 2, 10, 16, 2, 8, torch.float16, "NHD", 1, 4)
    assert nhd.total_kv_heads == 8 and nhd.heads() == range(2, 4)
    assert nhd.pool_shape() == (2, 10, 16, 2, 8)
    assert nhd.block_bytes() == 2 * 16 * 2 * 8 * 2
    hnd = dataclass_replace(nhd, order="HND")
    assert hnd.pool_shape() == (2, 10, 2, 16, 8) and hnd.block_bytes() == nhd.block_bytes()
    mla = KVLayout("mla", 2, 10, 16, 1, 576, torch.bfloat16, tp_rank=3, tp_size=4)
    assert mla.total_kv_heads == 1 and mla.heads() == range(0, 1) and mla.replication == 4
    assert mla.pool_shape() == (10, 16, 576) and mla.block_bytes() == 16 * 576 * 2
    pools = mla.allocate()
    assert len(pools) == 2 and all(p.shape == (10, 16, 576) and p.dtype == torch.bfloat16
                                   and not p.any() for p in pools)
    # vLLM example from the reference doc: 8 KV heads, bf16, head 128, block 16 -> 64 KiB at TP1
    assert KVLayout("mha", 1, 1, 16, 8, 128, torch.bfloat16).block_bytes() == 64 * 1024


def dataclass_replace(lay, **kw):
    import dataclasses
    return dataclasses.replace(lay, **kw)


def test_layout_replicated_heads():
    # 2 KV heads over TP 4: each head on 2 ranks
    lays = KVLayout("mha", 1, 4, 4, 1, D, torch.float32, tp_size=4, total_kv_heads=2).tp_group()
    assert [l.heads() for l in lays] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert lays[0].replication == 2


@pytest.mark.parametrize("kw, msg", [
    (dict(kind="gqa"), "kind"),
    (dict(order="NDH"), "order"),
    (dict(dtype="float32"), "dtype"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(block_size=True), "block_size"),
    (dict(tp_rank=2, tp_size=2, num_kv_heads=2), "tp_rank"),
    (dict(tp_size=3, total_kv_heads=4), "divisible"),
    (dict(tp_size=2, num_kv_heads=4, total_kv_heads=4), "num_kv_heads=4"),
    (dict(tp_size=8, num_kv_heads=1, total_kv_heads=3), "tp_size % total_kv_heads"),
    (dict(tp_size=8, num_kv_heads=2, total_kv_heads=4), "num_kv_heads must be 1"),
    (dict(kind="mla", num_kv_heads=2), "mla"),
    (dict(kind="mla", num_kv_heads=1, total_kv_heads=2), "mla"),
])
def test_layout_validation(kw, msg):
    args = dict(kind="mha", num_layers=1, num_blocks=4, block_size=4, num_kv_heads=4, head_dim=D,
                dtype=torch.float32)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        KVLayout(**args)


# ---------------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------------

def pieces(src, dst, rank):
    return [tuple(p) for p in ref.plan_kv_copy(src, dst.with_rank(rank)).pieces]


def test_plan_split_gather_and_replicas():
    assert pieces(layout(tp=1), layout(tp=2), 1) == [(0, 2, 4, 0)]
    assert pieces(layout(tp=2), layout(tp=4), 3) == [(1, 1, 2, 0)]
    assert pieces(layout(tp=4), layout(tp=1), 0) == [(0, 0, 1, 0), (1, 0, 1, 1), (2, 0, 1, 2),
                                                     (3, 0, 1, 3)]
    assert pieces(layout(tp=4), layout(tp=2), 1) == [(2, 0, 1, 0), (3, 0, 1, 1)]
    assert pieces(layout(tp=2), layout(tp=2), 1) == [(1, 0, 2, 0)]
    # replicated source (2 heads over TP 4): replica g*2 + dst_rank % 2
    assert pieces(layout(tp=4, heads=2), layout(tp=1, heads=2), 0) == [(0, 0, 1, 0), (2, 0, 1, 1)]
    assert pieces(layout(tp=4, heads=2), layout(tp=2, heads=2), 1) == [(3, 0, 1, 0)]
    # replicated destination: rank 3 of TP 4 holds head 1, rank 0 of a TP 1 source holds it at 1
    assert pieces(layout(tp=1, heads=2), layout(tp=4, heads=2), 3) == [(0, 1, 2, 0)]
    # MLA: source rank dst_rank % src_tp
    assert pieces(layout("mla", tp=4), layout("mla", tp=2), 1) == [(1, 0, 1, 0)]
    assert pieces(layout("mla", tp=2), layout("mla", tp=1), 0) == [(0, 0, 1, 0)]
    assert pieces(layout("mla", tp=1), layout("mla", tp=2), 1) == [(0, 0, 1, 0)]
    assert pieces(layout("mla", tp=2), layout("mla", tp=4), 3) == [(1, 0, 1, 0)]
    plan = ref.plan_kv_copy(layout(tp=4, order="HND", bs=4), layout(tp=1, bs=6))
    assert plan.src_ranks == (0, 1, 2, 3) and plan.needs_permute and not plan.needs_cast
    assert not plan.same_block_size


@pytest.mark.parametrize("dst_kw, msg", [
    (dict(kind="mla", tp=1), "kind"),
    (dict(head_dim=D + 1), "head_dim"),
    (dict(heads=8), "total_kv_heads"),
    (dict(layers=L + 1), "num_layers"),
    (dict(dtype=torch.float16), "dtype"),
])
def test_incompatible_layouts(dst_kw, msg):
    src = layout(tp=2)
    dst = layout(**{"tp": 2, **dst_kw})
    with pytest.raises(ValueError, match=msg):
        ref.plan_kv_copy(src, dst)
    gt, s_ids, s_pools = setup_source(src, 5)
    d_pools = [l.allocate() for l in dst.tp_group()]
    before = snapshot(d_pools)
    with pytest.raises(ValueError, match=msg):
        ref.reference_transfer(s_pools, src, s_ids, d_pools, dst, [0, 1], 5)
    assert same(d_pools, before)


def test_bad_pools_and_layout_lists():
    src, dst = layout(tp=2), layout(tp=1)
    gt, s_ids, s_pools = setup_source(src, 5)
    d_pools = filled_pools(dst, 2)
    wrong = [layout(tp=1, nb=9).allocate()]
    with pytest.raises(ValueError, match="shape"):
        ref.reference_transfer(s_pools, src, s_ids, wrong, dst, [0, 1], 5)
    with pytest.raises(ValueError, match="per-layer"):
        ref.reference_transfer(s_pools, src, s_ids, [d_pools[0][:2]], dst, [0, 1], 5)
    with pytest.raises(ValueError, match="tp_rank=1"):
        ref.reference_transfer(s_pools, [src, src], s_ids, d_pools, dst, [0, 1], 5)
    with pytest.raises(ValueError, match="TP group"):
        ref.reference_transfer(s_pools[:1], src, s_ids, d_pools, dst, [0, 1], 5)
    with pytest.raises(ValueError, match=r"src_pools\[1\] is None"):
        ref.reference_transfer([s_pools[0], None], src, s_ids, d_pools, dst, [0, 1], 5)
    with pytest.raises(ValueError, match="need 2"):
        ref.reference_transfer(s_pools, src, s_ids, d_pools, dst, [0], 5)
    with pytest.raises(ValueError, match="repeats"):
        ref.reference_transfer(s_pools, src, s_ids, d_pools, dst, [3, 3], 5)


# ---------------------------------------------------------------------------------------------------
# Transfers
# ---------------------------------------------------------------------------------------------------

ORDERS = [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD"), ("HND", "HND")]


@pytest.mark.parametrize("orders", ORDERS, ids=lambda o: f"{o[0]}-{o[1]}")
@pytest.mark.parametrize("dst_tp", [1, 2, 4])
@pytest.mark.parametrize("src_tp", [1, 2, 4])
def test_tp_matrix(src_tp, dst_tp, orders):
    src = layout(tp=src_tp, heads=4, bs=4, nb=6, order=orders[0])
    dst = layout(tp=dst_tp, heads=4, bs=4, nb=7, order=orders[1])
    run_and_check(src, dst, num_tokens=13)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("dst_tp", [1, 2, 4])
@pytest.mark.parametrize("src_tp", [1, 2, 4])
def test_tp_matrix_replicated_heads(src_tp, dst_tp, heads):
    src = layout(tp=src_tp, heads=heads, bs=4, nb=6, order="HND")
    dst = layout(tp=dst_tp, heads=heads, bs=4, nb=7, order="NHD")
    run_and_check(src, dst, num_tokens=11)


@pytest.mark.parametrize("bs", [(16, 16), (16, 32), (32, 16), (4, 6), (6, 4), (1, 5)],
                         ids=lambda b: f"{b[0]}to{b[1]}")
@pytest.mark.parametrize("tps, orders", [((1, 1), ("NHD", "NHD")), ((2, 4), ("HND", "NHD")),
                                         ((4, 2), ("NHD", "HND"))], ids=["1to1", "2to4", "4to2"])
def test_block_sizes(bs, tps, orders):
    num_tokens = 37
    src = layout(tp=tps[0], bs=bs[0], nb=-(-num_tokens // bs[0]) + 2, order=orders[0])
    dst = layout(tp=tps[1], bs=bs[1], nb=-(-num_tokens // bs[1]) + 3, order=orders[1])
    run_and_check(src, dst, num_tokens)


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (4, 2), (2, 4)], ids=lambda t: f"{t[0]}to{t[1]}")
@pytest.mark.parametrize("bs", [(4, 4), (4, 6)], ids=lambda b: f"{b[0]}to{b[1]}")
def test_mla(tps, bs):
    src = layout("mla", tp=tps[0], bs=bs[0], nb=6, head_dim=5)
    dst = layout("mla", tp=tps[1], bs=bs[1], nb=5, head_dim=5)
    plans = run_and_check(src, dst, num_tokens=15)
    assert [p.src_ranks for p in plans] == [(r % tps[0],) for r in range(tps[1])]


def test_mla_reads_only_planned_replica():
    # 4 -> 2: destination ranks read source ranks 0 and 1; ranks 2, 3 hold garbage or are absent
    src = layout("mla", tp=4, bs=4, nb=6)
    dst = layout("mla", tp=2, bs=8, nb=3)
    gt, s_ids, s_pools = setup_source(src, 10)
    s_pools[2] = [torch.full_like(t, -7.0) for t in s_pools[2]]
    s_pools[3] = None
    d_pools = [l.allocate() for l in dst.tp_group()]
    ref.reference_transfer(s_pools, src, s_ids, d_pools, dst, [2, 0], 10)
    for r, lay in enumerate(dst.tp_group()):
        got = ref.gather_tokens(d_pools[r], lay, [2, 0], 10)
        assert all(torch.equal(g, t) for g, t in zip(got, gt))


def test_layer_ranges():
    src = layout(tp=2, bs=4, nb=6, order="HND")
    dst = layout(tp=4, bs=6, nb=5, order="NHD")
    run_and_check(src, dst, 10, layers=range(1, 3))
    run_and_check(src, dst, 10, layers=[2, 0])
    run_and_check(src, dst, 10, layers=[])


def test_partial_last_block_untouched():
    src = layout(tp=1, bs=4, nb=3)
    dst = layout(tp=1, bs=8, nb=2, order="HND")
    gt, s_ids, s_pools = setup_source(src, 5)
    d_pools = [[torch.full(dst.pool_shape(), -5.0) for _ in range(L)]]
    ref.reference_transfer(s_pools, src, s_ids, d_pools, dst, [1], 5)
    for l in range(L):
        p = d_pools[0][l]
        assert torch.equal(p[:, 1, :, :5], gt[l].permute(0, 2, 1, 3))    # HND: [2, H, tok, D]
        assert (p[:, 1, :, 5:] == -5).all() and (p[:, 0] == -5).all()


def test_only_listed_destination_ranks_written():
    src, dst = layout(tp=1), layout(tp=4)
    gt, s_ids, s_pools = setup_source(src, 6)
    d_pools = filled_pools(dst, 3)
    before = snapshot(d_pools)
    d_pools[1] = None
    plans = ref.reference_transfer(s_pools, src, s_ids, d_pools, dst, [4, 5], 6)
    assert plans[1] is None and [p.src_ranks for p in plans if p] == [(0,)] * 3
    for r in (0, 2, 3):
        lay = dst.with_rank(r)
        got = ref.gather_tokens(d_pools[r], lay, [4, 5], 6)
        assert all(torch.equal(g, ref.shard_heads(t, lay)) for g, t in zip(got, gt))


def test_dtype_cast_opt_in():
    src = layout(tp=2, dtype=torch.float32)
    dst = layout(tp=1, dtype=torch.bfloat16, order="HND")
    with pytest.raises(ValueError, match="allow_dtype_cast"):
        ref.plan_kv_copy(src, dst)
    plans = run_and_check(src, dst, 9, allow_dtype_cast=True)
    assert plans[0].needs_cast


def test_tensor_block_ids_and_zero_tokens():
    src, dst = layout(tp=2, bs=4), layout(tp=2, bs=6, order="HND")
    gt, s_ids, s_pools = setup_source(src, 9)
    d_pools = filled_pools(dst, 2)
    before = snapshot(d_pools)
    ref.reference_transfer(s_pools, src, torch.tensor(s_ids), d_pools, dst, [3, 7], 0)
    assert same(d_pools, before)
    ref.reference_transfer(s_pools, src, torch.tensor(s_ids), d_pools, dst,
                           torch.tensor([3, 7], dtype=torch.int32), 9)
    for r, lay in enumerate(dst.tp_group()):
        got = ref.gather_tokens(d_pools[r], lay, [3, 7], 9)
        assert all(torch.equal(g, ref.shard_heads(t, lay)) for g, t in zip(got, gt))


@pytest.mark.parametrize("case, match", [
    ("src_id", "src_block_ids\\[2\\] = 6 "),
    ("dst_id", "dst_block_ids\\[1\\] = -1 "),
    ("dst_spare", "dst_block_ids\\[2\\] = 99 "),
    ("layer", "layer 3 "),
    ("neg_layer", "layer -1 "),
])
def test_out_of_range_raises_before_any_write(case, match):
    src = layout(tp=2, bs=4, nb=6)
    dst = layout(tp=1, bs=6, nb=5, order="HND")
    gt, s_ids, s_pools = setup_source(src, 10)
    s_ids = [1, 4, 0]
    d_ids, layers = [2, 3], None
    if case == "src_id":
        s_ids = [1, 4, 6]
    elif case == "dst_id":
        d_ids = [2, -1]
    elif case == "dst_spare":
        d_ids = [2, 3, 99]
    elif case == "layer":
        layers = [0, 1, 3]
    else:
        layers = [0, -1]
    d_pools = filled_pools(dst, 2)
    before, s_before = snapshot(d_pools), snapshot(s_pools)
    with pytest.raises(IndexError, match=match):
        ref.reference_transfer(s_pools, src, s_ids, d_pools, dst, d_ids, 10, layers)
    assert same(d_pools, before) and same(s_pools, s_before)


def test_scatter_gather_roundtrip_and_checks():
    lay = layout(tp=2, bs=3, nb=5, order="HND").with_rank(1)
    gt = model_kv(lay, 7)
    pools = filled_pools(lay, 4)[0]
    before = [t.clone() for t in pools]
    ref.scatter_tokens(pools, lay, [4, 0, 2], [ref.shard_heads(t, lay) for t in gt])
    for l in range(L):
        assert torch.equal(pools[l], expected_pool(before[l], lay, [4, 0, 2],
                                                   ref.shard_heads(gt[l], lay), 7))
    got = ref.gather_tokens(pools, lay, [4, 0, 2], 7, layers=[1])
    assert len(got) == 1 and torch.equal(got[0], ref.shard_heads(gt[1], lay))
    snap = [t.clone() for t in pools]
    with pytest.raises(IndexError, match="block_ids\\[2\\] = 5 "):
        ref.scatter_tokens(pools, lay, [4, 0, 5], [ref.shard_heads(t, lay) for t in gt])
    with pytest.raises(ValueError, match="shape"):
        ref.scatter_tokens(pools, lay, [4, 0, 2], gt)           # all heads, not this rank's
    assert all(torch.equal(a, b) for a, b in zip(pools, snap))
    with pytest.raises(IndexError, match="block_ids\\[0\\] = 9 "):
        ref.gather_tokens(pools, lay, [9], 2)


def test_token_runs():
    runs = ref.token_runs([7, 3, 5], 4, [2, 9], 6, 10)
    assert runs == [(7, 0, 2, 0, 4), (3, 0, 2, 4, 2), (3, 2, 9, 0, 2), (5, 0, 9, 2, 2)]
    assert sum(r[4] for r in runs) == 10
    blk, off = ref.token_slots([7, 3, 5], 4, 10)
    assert blk.tolist() == [7] * 4 + [3] * 4 + [5] * 2 and off.tolist() == [0, 1, 2, 3] * 2 + [0, 1]
