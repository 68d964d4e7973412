"""torch.compile over the extension ops: a MoE layer (dispatch, experts, combine) compiled with
fullgraph=True gives the eager result bit for bit at 2 and 3 ranks, in v1 and v2 forms, with
and without int8 quantization; the ops' fake kernels give the real outputs' shapes and dtypes;
a compiled KV push lands in the peer's pools."""
import datetime
import os
import sys
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import assert_all_ok, run_ranks  # noqa: E402

H, BS, K = 32, 6, 2


def _init(rank, world_size, init_file):
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))


def _moe_layer(v2: bool, quant: int, experts_per_rank: int):
    import torch_cam
    W, rank = dist.get_world_size(), dist.get_rank()
    M = experts_per_rank * W
    group = dist.group.WORLD
    dispatch = torch_cam.moe_distribute_dispatch_v2 if v2 else torch_cam.moe_distribute_dispatch
    combine = torch_cam.moe_distribute_combine_v2 if v2 else torch_cam.moe_distribute_combine

    def layer(x, ids, w, w1, w2):
        expand_x, dyn, idx, tokens, ep_counts, tp_counts, _ = dispatch(
            x, ids, group, W, rank, M, expert_scales=w, quant_mode=quant)
        h = expand_x.to(torch.float32)
        if quant == 2:
            h = h * dyn.unsqueeze(1)
        # Matmuls and relu only: inductor calls ATen's mm, so compiled and eager round alike.
        y = (torch.relu(h @ w1) @ w2).to(x.dtype)
        return combine(y, ids, idx, ep_counts, w, group, W, rank, M)

    return layer


def _inputs(rank, M, dtype, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BS, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(BS)]).to(torch.int32)
    w = torch.rand(BS, K, generator=g)
    return x, ids, w


def _compiled_equals_eager(rank, world_size, init_file, v2, quant, dtype_name):
    _init(rank, world_size, init_file)
    dtype = getattr(torch, dtype_name)
    torch._dynamo.reset()
    layer = _moe_layer(v2, quant, experts_per_rank=2)
    M = 2 * world_size
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(H, 2 * H, generator=g), torch.randn(2 * H, H, generator=g)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for step in range(3):
        x, ids, w = _inputs(rank, M, dtype, step)
        eager = layer(x, ids, w, w1, w2)
        got = compiled(x, ids, w, w1, w2)
        assert got.shape == eager.shape == (BS, H) and got.dtype == eager.dtype == dtype, (got.shape, got.dtype)
        assert torch.equal(got.view(torch.uint8), eager.view(torch.uint8)), \
            f"step {step}: max |compiled - eager| = {(got.float() - eager.float()).abs().max()}"
    dist.barrier()
    dist.destroy_process_group()


def _fake_shapes_match(rank, world_size, init_file):
    """The fake kernels' outputs against the real ones, for every output of dispatch and combine."""
    _init(rank, world_size, init_file)
    import torch_cam
    from torch._subclasses.fake_tensor import FakeTensorMode
    W = world_size
    M = 2 * W
    name = dist.group.WORLD.group_name
    x, ids, w = _inputs(rank, M, torch.bfloat16, 0)
    for quant in (0, 2):
        args = (name, W, rank, M, None, None, w, "", 0, 0, 0, 1, 0, quant, 0, 1)
        real = torch.ops.torch_cam.moe_distribute_dispatch(x, ids, *args)
        with FakeTensorMode() as mode:
            fake = torch.ops.torch_cam.moe_distribute_dispatch(mode.from_tensor(x), mode.from_tensor(ids),
                                                               *args[:6], mode.from_tensor(w), *args[7:])
        for i, (r, f) in enumerate(zip(real, fake)):
            assert tuple(r.shape) == tuple(f.shape) and r.dtype == f.dtype, (quant, i, r.shape, f.shape, r.dtype, f.dtype)
        expand_x, _, idx, _, counts, _, _ = real
        y = torch.zeros(expand_x.shape, dtype=torch.bfloat16)
        out = torch.ops.torch_cam.moe_distribute_combine(y, ids, idx, counts, w, name, W, rank, M, None, None, None,
                                                         "", 0, 0, 0, 1, 0, 0, 0)
        with FakeTensorMode() as mode:
            f = torch.ops.torch_cam.moe_distribute_combine(
                mode.from_tensor(y), mode.from_tensor(ids), mode.from_tensor(idx), mode.from_tensor(counts),
                mode.from_tensor(w), name, W, rank, M, None, None, None, "", 0, 0, 0, 1, 0, 0, 0)
        assert tuple(out.shape) == tuple(f.shape) and out.dtype == f.dtype
        # The eager public call (which skips the op) and the op give the same bytes.
        eager = torch_cam.moe_distribute_combine(y, ids, idx, counts, w, name, W, rank, M)
        assert torch.equal(eager.view(torch.uint8), out.view(torch.uint8)), (quant, (eager - out).abs().max())
    dist.barrier()
    dist.destroy_process_group()


def _compiled_kv_push(rank, world_size, init_file):
    _init(rank, world_size, init_file)
    from torch_cam.kv import KVLayout, KVTransfer
    layout = KVLayout(kind="mla", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8,
                      dtype=torch.float16)
    t = KVTransfer()
    pools = t.allocate(layout)
    for li, p in enumerate(pools):
        p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape).to(torch.float16) + 100 * li + rank)
    t.register(pools, layout)
    dist.barrier()
    peer = 1 - rank
    t.version(peer)

    def push(src):
        t.push(peer, src, [5, 6], 8, request_id=b"req")
        return src + 1

    if rank == 0:
        out = torch.compile(push, fullgraph=True)(torch.tensor([1, 2]))
        assert out.tolist() == [2, 3]
    else:
        n = t.wait_notification(b"req", peer=0, timeout_s=30)
        assert n.peer == 0, n
        for li, p in enumerate(pools):
            ref = (torch.arange(p.numel(), dtype=torch.float32).view(p.shape).to(torch.float16) + 100 * li)
            assert torch.equal(p[5], ref[1]) and torch.equal(p[6], ref[2]), f"layer {li}"
    dist.barrier()
    dist.destroy_process_group()


class CompileTest(unittest.TestCase):
    def test_moe_layer_compiled_equals_eager(self):
        for world_size, v2, quant, dtype in [(2, False, 0, "bfloat16"), (2, True, 2, "bfloat16"),
                                             (3, False, 2, "float16"), (3, True, 0, "float32")]:
            with self.subTest(world_size=world_size, v2=v2, quant=quant, dtype=dtype):
                assert_all_ok(self, run_ranks(_compiled_equals_eager, world_size, v2, quant, dtype,
                                              deadline_s=300))

    def test_fake_kernels_give_real_shapes(self):
        assert_all_ok(self, run_ranks(_fake_shapes_match, 2, deadline_s=120))

    def test_compiled_kv_push(self):
        assert_all_ok(self, run_ranks(_compiled_kv_push, 2, deadline_s=300))


if __name__ == "__main__":
    unittest.main()
