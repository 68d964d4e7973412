"""The native KV block copy (torch_cam.kv.copy_blocks, kernels/kv_copy.cpp) against the
pure-PyTorch reference, bit for bit: every TP ratio in {1, 2, 4}^2, NHD/HND on both sides,
block-size remaps, MLA replication, layer subsets; and its checks before any write."""
import itertools

import pytest
import torch

from torch_cam import _C
from torch_cam.kv import copy_blocks
from torch_cam.kv_reference import KVLayout, plan_kv_copy, reference_transfer


def pools_for(layout, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.pool_shape(), generator=g).to(layout.dtype) for _ in range(layout.num_layers)]


def run_both(src0, dst0, num_tokens, layers=None, seed=0):
    srcs = src0.tp_group()
    dsts = dst0.tp_group()
    src_pools = [pools_for(s, seed + i) for i, s in enumerate(srcs)]
    dst_init = [pools_for(d, seed + 100 + i) for i, d in enumerate(dsts)]
    g = torch.Generator().manual_seed(seed + 7)
    s_ids = torch.randperm(src0.num_blocks, generator=g)[: -(-num_tokens // src0.block_size)].tolist()
    d_ids = torch.randperm(dst0.num_blocks, generator=g)[: -(-num_tokens // dst0.block_size)].tolist()
    want = [[t.clone() for t in p] for p in dst_init]
    reference_transfer(src_pools, srcs, s_ids, want, dsts, d_ids, num_tokens, layers)
    got = [[t.clone() for t in p] for p in dst_init]
    for d, dl in enumerate(dsts):
        for s, sl in enumerate(srcs):
            copy_blocks(src_pools[s], sl, s_ids, got[d], dl, d_ids, num_tokens, layers)
    for d in range(len(dsts)):
        for l in range(dst0.num_layers):
            assert torch.equal(got[d][l], want[d][l]), (d, l)


def mha(tp, order, block_size=4, heads=4, blocks=12, layers=2, dtype=torch.bfloat16):
    if tp <= heads:
        return KVLayout("mha", layers, blocks, block_size, heads // tp, 8, dtype, order, 0, tp, heads)
    return KVLayout("mha", layers, blocks, block_size, 1, 8, dtype, order, 0, tp, heads)


@pytest.mark.parametrize("ts,td,so,do", list(itertools.product([1, 2, 4], [1, 2, 4], ["NHD", "HND"], ["NHD", "HND"])))
def test_tp_and_order(ts, td, so, do):
    run_both(mha(ts, so), mha(td, do), num_tokens=13, seed=ts * 10 + td)


@pytest.mark.parametrize("bs_src,bs_dst", [(4, 4), (4, 8), (8, 4), (4, 6), (6, 4), (1, 5)])
def test_block_size_remap(bs_src, bs_dst):
    run_both(mha(2, "NHD", bs_src, blocks=40), mha(1, "HND", bs_dst, blocks=40), num_tokens=29)
    run_both(mha(2, "HND", bs_src, blocks=40), mha(4, "HND", bs_dst, blocks=40), num_tokens=29, layers=[1])


@pytest.mark.parametrize("ts,td", [(1, 2), (2, 1), (4, 2), (2, 4)])
def test_mla(ts, td):
    s = KVLayout("mla", 2, 10, 4, 1, 16, torch.float16, "NHD", 0, ts)
    d = KVLayout("mla", 2, 10, 6, 1, 16, torch.float16, "NHD", 0, td)
    run_both(s, d, num_tokens=17)


def test_replicated_heads():
    run_both(mha(4, "NHD", heads=2), mha(2, "HND", heads=2), num_tokens=9)


def test_checks_before_any_write():
    s, d = mha(1, "NHD"), mha(1, "HND")
    src, dst = pools_for(s, 1), pools_for(d, 2)
    before = [t.clone() for t in dst]
    with pytest.raises(IndexError, match=r"dst_block_ids\[1\] = 99"):
        copy_blocks(src, s, [0, 1], dst, d, [0, 99], 6)
    with pytest.raises(IndexError, match="layer 5"):
        copy_blocks(src, s, [0, 1], dst, d, [0, 1], 6, layers=[0, 5])
    with pytest.raises(ValueError):
        copy_blocks(src, s, [0, 1], dst, d, [0], 6)  # too few destination blocks
    assert all(torch.equal(a, b) for a, b in zip(dst, before))
    with pytest.raises(ValueError, match="repeats block id 3"):
        copy_blocks(src, s, [0, 1], dst, d, [3, 3], 6)  # one destination block written twice
    with pytest.raises(ValueError, match="incompatible KV layouts: source head_dim=8, destination head_dim=16"):
        copy_blocks(src, s, [0], pools_for(mha(1, "NHD"), 3),
                    KVLayout("mha", 2, 12, 4, 4, 16, torch.bfloat16, "NHD"), [0], 4)
    with pytest.raises(ValueError, match="src_block_ids must hold ints"):
        copy_blocks(src, s, [0, 1.0], dst, d, [0, 1], 6)
    with pytest.raises(ValueError, match="dst_pools"):
        copy_blocks(src, s, [0, 1], dst[:1], d, [0, 1], 6)
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_block_ids_as_tensors_lists_and_tuples():
    """Ids come as lists, tuples, int32/int64 tensors, 0-dim tensors in a list: one result."""
    s, d = mha(1, "NHD"), mha(2, "HND")
    src = pools_for(s, 4)
    outs = []
    for s_ids, d_ids in (([5, 2, 7], [1, 0, 9]), ((5, 2, 7), (1, 0, 9)),
                         (torch.tensor([5, 2, 7], dtype=torch.int32), torch.tensor([1, 0, 9])),
                         ([torch.tensor(5), 2, 7], [1, torch.tensor(0), 9])):
        dst = [torch.zeros(d.pool_shape(), dtype=d.dtype) for _ in range(d.num_layers)]
        assert copy_blocks(src, s, s_ids, dst, d, d_ids, 10) == 2 * 2 * 10 * 2 * 8 * 2
        outs.append(dst)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def _native_pieces(src, dst):
    return [tuple(p) for p in _C.kv_plan_pieces(src, dst)]


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_native_plan_matches_reference(heads):
    """The native head plan (csrc/kv/kv_layout.cpp) is the reference's, restricted to one
    source rank, for every TP pair up to 8 (replicated heads included) and MLA."""
    sizes = [1, 2, 4, 8]
    for ts, td in itertools.product(sizes, sizes):
        for sr, dr in itertools.product(range(ts), range(td)):
            src, dst = mha(ts, "NHD", heads=heads).with_rank(sr), mha(td, "HND", heads=heads).with_rank(dr)
            want = [(p.src_head_lo, p.dst_head_lo, p.num_heads) for p in plan_kv_copy(src, dst).pieces
                    if p.src_tp_rank == sr]
            assert _native_pieces(src, dst) == want, (heads, ts, sr, td, dr)
            if heads == 1:
                ms = KVLayout("mla", 2, 10, 4, 1, 16, torch.float16, "NHD", sr, ts)
                md = KVLayout("mla", 2, 10, 4, 1, 16, torch.float16, "NHD", dr, td)
                want = [(p.src_head_lo, p.dst_head_lo, p.num_heads) for p in plan_kv_copy(ms, md).pieces
                        if p.src_tp_rank == sr]
                assert _native_pieces(ms, md) == want
