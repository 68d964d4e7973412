"""DistributedDataParallel on cam: parameters after several training steps equal the same run
on gloo, with DDP's built-in all-reduce and with a communication hook that works through
``Work.get_future()``.

At 2 ranks the two backends add the same two numbers per element, so parameters must match
bit for bit; at 3 ranks gloo sums in another order, so the comparison allows rounding.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from cam_testing import run_ranks  # noqa: E402

STEPS = 6


def _scaled_allreduce_hook(state, bucket):
    """A hook in the style of DDP's own: async all_reduce, then divide through the future."""
    import torch.distributed as dist

    buf = bucket.buffer()
    fut = dist.all_reduce(buf, group=state, async_op=True).get_future()
    world = dist.get_world_size(state)
    return fut.then(lambda f: f.value()[0].div_(world))


def _train(rank, world_size, init_file, backend, hook, bucket_mb, hosts=None):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    if hosts:  # simulated hosts: a cam group across them (cam inside a host, gloo between)
        os.environ["TORCH_CAM_HOST_ID"] = f"simhost{hosts[rank]}"
    if backend == "cam":
        import torch_cam  # noqa: F401
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    # Ranks start from different weights: DDP's initial broadcast must make them equal.
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if hook:
        ddp.register_comm_hook(dist.group.WORLD, _scaled_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.tolist() for k, v in ddp.module.named_parameters()}
    # Buffers (BatchNorm running stats) are rank-local after the last step; DDP synced them
    # from rank 0 at the start of each forward.
    state.update({"buffer:" + k: v.tolist() for k, v in ddp.module.named_buffers()})
    dist.destroy_process_group()
    return losses, state


def _compare(testcase, world_size, hook, exact, bucket_mb=0.0005, hosts=None):
    runs = {}
    for backend in ("gloo", "cam"):
        out = run_ranks(_train, world_size, backend, hook, bucket_mb, hosts, deadline_s=180)
        errors = {r: v for r, (s, v) in out.items() if s != "ok"}
        testcase.assertFalse(errors, f"{backend}: {errors}")
        runs[backend] = {r: v for r, (_, v) in out.items()}
    for r in range(world_size):
        (gl, gs), (cl, cs) = runs["gloo"][r], runs["cam"][r]
        for k in gs:
            g, c = torch.tensor(gs[k]), torch.tensor(cs[k])
            if exact:
                testcase.assertTrue(torch.equal(g, c), f"rank {r} {k}: cam differs from gloo")
            else:
                torch.testing.assert_close(c, g, rtol=1e-5, atol=1e-6, msg=f"rank {r} {k}")
        if exact:
            testcase.assertEqual(gl, cl)
    # DDP kept the replicas identical on cam too.
    for r in range(1, world_size):
        for k in (k for k in runs["cam"][0][1] if not k.startswith("buffer:")):
            testcase.assertEqual(runs["cam"][0][1][k], runs["cam"][r][1][k], k)


import unittest  # noqa: E402


class DDPMatchesGloo(unittest.TestCase):
    def test_builtin_allreduce_two_ranks_bit_exact(self):
        _compare(self, 2, hook=False, exact=True)

    def test_future_comm_hook_two_ranks_bit_exact(self):
        _compare(self, 2, hook=True, exact=True)

    def test_future_comm_hook_three_ranks(self):
        _compare(self, 3, hook=True, exact=False)

    def test_across_two_hosts(self):
        _compare(self, 4, hook=False, exact=False, hosts=[0, 0, 1, 1])


if __name__ == "__main__":
    unittest.main()
