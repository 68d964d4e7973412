"""MoE dispatch / combine across hosts (torch_cam.moe_hosts.HostsMoe, the algorithm a group that
spans hosts runs) over the in-process test transport: ranks as threads of this process, each
with a process group whose backend is the one-sided engine over LoopbackTransport. The public
ops run the single-host suite's cases (tests/test_moe.py), checked against
torch_cam.moe_reference bit for bit; then injected faults: a rank that dies mid-dispatch and a
put that fails make the ranks involved raise, naming the op, within the fabric's deadline."""
import itertools
import os
import sys
import unittest

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_cam  # noqa: E402
from test_moe import MoeCases, routing, tokens  # noqa: E402
from test_one_sided import run_threads  # noqa: E402

TIMEOUT_S = 5.0
CASES = ("test_dispatch_combine_basic", "test_int8_quant", "test_masks", "test_shared_expert_ranks",
         "test_v2_assist_info_and_special_experts", "test_invalid_inputs_fail_everywhere")
_fabrics = itertools.count()


def run_ranks(world, fn, timeout_s=TIMEOUT_S, join_s=120.0):
    """fn(rank, pg, fabric) on `world` threads, each pg a process group over the rank's one-sided
    backend on one loopback fabric -> (results, errors, seconds per rank)."""
    store = dist.HashStore()
    tag = next(_fabrics)

    def group(backend, r):
        pg = ProcessGroup(store, r, world)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
        pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
        pg._set_group_name(f"loopback{tag}.{r}")
        return pg

    return run_threads(world, fn, timeout_s, join_s, make=group)


def case_on(group, name):
    """MoeCases.<name> as a plain call on `group` (this thread's rank)."""

    class OnLoopback(MoeCases, unittest.TestCase):
        world_size = group.size()
        rank = group.rank()

        @property
        def pg(self):
            return self._pg

        def runTest(self):  # noqa: N802 (unittest's name)
            pass

    case = OnLoopback()
    case._pg = group
    return getattr(case, name)


class HostsMoeOverLoopbackTest(unittest.TestCase):
    def test_suite_cases_match_the_reference(self):
        for world in (2, 4):
            for name in CASES:
                def fn(r, pg, _):
                    assert isinstance(torch_cam.moe_hosts.moe_backend(pg), torch_cam.moe_hosts.HostsMoe)
                    case_on(pg, name)()
                _, errors, _ = run_ranks(world, fn)
                self.assertEqual(errors, [None] * world, f"{name} at {world} ranks")

    def test_a_rank_that_dies_fails_the_others_naming_the_op(self):
        world = 3

        def fn(r, pg, fabric):
            x = tokens(6, torch.bfloat16, r)
            ids = routing(6, 2, 2 * world, 10 + r)
            out = torch_cam.moe_distribute_dispatch(x, ids, pg, world, r, 2 * world)  # all alive
            if r == 1:
                fabric.mark_dead(1)
                return "dead"
            torch_cam.moe_distribute_combine(out[0], ids, out[2], out[4], None, pg, world, r, 2 * world)

        results, errors, took = run_ranks(world, fn)
        self.assertEqual(results[1], "dead")
        for r in (0, 2):
            self.assertIsNotNone(errors[r], f"rank {r} returned")
            self.assertIn(f"cam moe_combine on rank {r}", errors[r])
            self.assertIn("rank 1 is gone", errors[r])
            self.assertLess(took[r], TIMEOUT_S, f"rank {r} took {took[r]:.2f} s")

    def test_a_failed_put_raises_on_the_sender(self):
        world = 2

        def fn(r, pg, fabric):
            x = tokens(4, torch.bfloat16, r)
            ids = routing(4, 2, 2 * world, 20 + r)
            if r == 0:
                fabric.fail_posts_to(1)
            torch_cam.moe_distribute_dispatch(x, ids, pg, world, r, 2 * world)

        _, errors, took = run_ranks(world, fn)
        self.assertIsNotNone(errors[0])
        self.assertIn("cam moe_dispatch on rank 0", errors[0])
        self.assertIsNotNone(errors[1], "rank 1 returned without rank 0's rows")
        self.assertLess(max(took), TIMEOUT_S + 3.0)


if __name__ == "__main__":
    unittest.main()
