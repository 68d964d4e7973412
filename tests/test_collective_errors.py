"""Errors of the reduction and gather families: ranks that disagree on size, dtype, reduce op,
root, algorithm or the collective itself fail on every rank with a message naming the op, its
sequence number, this rank and the other rank, and the group stays usable; unsupported dtype/op
combinations and malformed arguments fail each rank's own checks (tests/test_fuzz_args.py covers
one bad rank among good ones); a monitored_barrier or collective that a peer never joins times out naming the missing ranks."""
import datetime
import os
import sys
import time
import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cam  # noqa: F401,E402
from cam_testing import CamProcessGroupCase, run_ranks  # noqa: E402

R = dist.ReduceOp


class CamCollectiveErrorsTest(CamProcessGroupCase, MultiProcContinuousTest):
    world_size = 3
    timeout = timedelta(seconds=60)
    cam_options = {"window_bytes": 1 << 20, "chunk_bytes": 64 << 10}

    def assert_group_usable(self, group=None):
        w = dist.get_world_size(group)
        me = dist.get_rank(group)
        # An all_reduce large enough for two-shot under auto, then an all_gather.
        t = torch.full((100_000,), float(me + 1))
        dist.all_reduce(t, group=group)
        self.assertTrue(torch.all(t == w * (w + 1) / 2))
        out = torch.empty(w * 10, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.full((10,), me, dtype=torch.int64), group=group)
        self.assertEqual(out.view(w, 10)[:, 0].tolist(), list(range(w)))

    def prefix(self, op):
        return r"cam %s \(seq \d+\) on rank %d: " % (op, self.rank)

    # ---------------------------------------------------------------- mismatches across ranks
    def test_all_reduce_size_mismatch(self):
        n = 12 if self.rank == 2 else 10
        other = (r"rank 2 contributes 48 bytes of Float while this rank contributes 40 bytes of Float"
                 if self.rank != 2 else
                 r"rank 0 contributes 40 bytes of Float while this rank contributes 48 bytes of Float")
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_reduce") + other +
                                    r"; every rank must pass the same dtype and size"):
            dist.all_reduce(torch.ones(n))
        self.assert_group_usable()

    def test_all_reduce_dtype_mismatch(self):
        t = torch.ones(4, dtype=torch.float64 if self.rank == 1 else torch.float32)
        other = (r"rank 1 contributes 32 bytes of Double while this rank contributes 16 bytes of Float"
                 if self.rank != 1 else r"rank 0 contributes 16 bytes of Float while this rank contributes 32 bytes of Double")
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_reduce") + other):
            dist.all_reduce(t)
        self.assert_group_usable()

    def test_all_reduce_op_mismatch(self):
        op = R.MAX if self.rank == 0 else R.SUM
        other = (r"rank 0 reduces with MAX while this rank reduces with SUM" if self.rank != 0
                 else r"rank 1 reduces with SUM while this rank reduces with MAX")
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_reduce") + other):
            dist.all_reduce(torch.ones(300_000), op=op)  # two-shot: refused before any data moves
        self.assert_group_usable()

    def test_all_reduce_algorithm_mismatch(self):
        # Options that choose an op's algorithm are group-wide: a group whose ranks force
        # different all_reduce algorithms, or split one-shot from two-shot at different sizes,
        # is refused at init on every rank, naming the option, the peer and both values (the
        # per-op descriptor check behind it is never reached from Python), and the default
        # group stays usable.
        for option, mine, odd in (("allreduce_algo", "two_shot", "one_shot"),
                                  ("one_shot_max_bytes", 4096, 8192)):
            value = odd if self.rank == 2 else mine
            peer, theirs = (0, mine) if self.rank == 2 else (2, odd)
            with self.assertRaisesRegex(RuntimeError, r"cam init of group .* on rank %d: rank %d has %s=%s but this "
                                                      r"rank has %s=%s; .*must be equal on every rank of a group"
                                        % (self.rank, peer, option, theirs, option, value)):
                dist.new_group([0, 1, 2], backend="cam", pg_options={option: value})
            self.assert_group_usable()
        # Forced alike on every rank, each algorithm gives the reference sum at sizes on both
        # sides of the automatic limit.
        for algo in ("one_shot", "two_shot"):
            g = dist.new_group([0, 1, 2], backend="cam", pg_options={"allreduce_algo": algo})
            for n in (5, 1500, 300_000):
                t = torch.arange(n, dtype=torch.float32) + self.rank
                dist.all_reduce(t, group=g)
                self.assertEqual(t, 3 * torch.arange(n, dtype=torch.float32) + 3, msg=f"{algo}, {n} elements")
            dist.destroy_process_group(g)
        self.assert_group_usable()

    def test_reduce_root_mismatch(self):
        root = 1 if self.rank == 0 else 0
        other = (r"rank 1 uses root 0 while this rank uses root 1" if self.rank == 0
                 else r"rank 0 uses root 1 while this rank uses root 0")
        with self.assertRaisesRegex(RuntimeError, self.prefix("reduce") + other):
            dist.reduce(torch.ones(10), dst=root)
        self.assert_group_usable()

    def test_reduce_size_and_op_mismatch(self):
        with self.assertRaisesRegex(RuntimeError, self.prefix("reduce") + r"(rank 1 contributes 8 bytes of Float|rank \d contributes 12 bytes of Float "
                                                                          r"while this rank contributes 8 bytes)"):
            dist.reduce(torch.ones(2 if self.rank == 1 else 3), dst=2)
        with self.assertRaisesRegex(RuntimeError, self.prefix("reduce") + r"rank \d reduces with (MIN|PRODUCT) while "
                                                                          r"this rank reduces with (MIN|PRODUCT)"):
            dist.reduce(torch.ones(3), dst=0, op=R.MIN if self.rank == 2 else R.PRODUCT)
        self.assert_group_usable()

    def test_reduce_scatter_size_mismatch(self):
        n = 4 if self.rank == 1 else 5
        other = (r"rank 1 contributes 48 bytes of Float while this rank contributes 60 bytes of Float" if self.rank != 1
                 else r"rank 0 contributes 60 bytes of Float while this rank contributes 48 bytes of Float")
        with self.assertRaisesRegex(RuntimeError, self.prefix("reduce_scatter_tensor") + other):
            dist.reduce_scatter_tensor(torch.empty(n), torch.ones(3 * n))
        with self.assertRaisesRegex(RuntimeError, self.prefix("reduce_scatter") + r"rank \d (contributes|reduces)"):
            outs = torch.empty(2, dtype=torch.int32 if self.rank == 0 else torch.int64)
            dist.reduce_scatter(outs, [torch.ones_like(outs)] * 3)
        self.assert_group_usable()

    def test_all_gather_size_and_dtype_mismatch(self):
        n = 6 if self.rank == 0 else 5
        other = (r"rank 0 contributes 24 bytes of Float while this rank contributes 20 bytes of Float" if self.rank != 0
                 else r"rank 1 contributes 20 bytes of Float while this rank contributes 24 bytes of Float")
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_gather_into_tensor") + other):
            dist.all_gather_into_tensor(torch.empty(3 * n), torch.ones(n))
        dtype = torch.int16 if self.rank == 2 else torch.bfloat16
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_gather") + r"rank \d contributes 8 bytes of (Short|BFloat16) "
                                                                              r"while this rank contributes 8 bytes of (Short|BFloat16)"):
            dist.all_gather([torch.empty(4, dtype=dtype) for _ in range(3)], torch.ones(4, dtype=dtype))
        self.assert_group_usable()

    def test_gather_root_and_size_mismatch(self):
        root = 2 if self.rank == 2 else 0
        outs = [torch.empty(3) for _ in range(3)] if self.rank == root else None
        with self.assertRaisesRegex(RuntimeError, self.prefix("gather") + r"rank \d uses root \d while this rank uses root \d"):
            dist.gather(torch.ones(3), outs, dst=root)
        outs = [torch.empty(3) for _ in range(3)] if self.rank == 1 else None
        n = 4 if self.rank == 0 else 3
        with self.assertRaisesRegex(RuntimeError, self.prefix("gather") + r"(rank 0 contributes 16 bytes of Float|rank 1 "
                                                                          r"contributes 12 bytes of Float)"):
            if self.rank == 1:
                dist.gather(torch.ones(3), outs, dst=1)
            else:
                dist.gather(torch.ones(n), None, dst=1)
        self.assert_group_usable()

    def test_scatter_root_and_size_mismatch(self):
        # scatter runs on the all-to-all channels: a disagreement shows as send/expect sizes.
        root = 1 if self.rank == 1 else 0
        ins = [torch.ones(2) for _ in range(3)] if self.rank == root else None
        with self.assertRaisesRegex(RuntimeError, self.prefix("scatter") + r"(this rank|rank \d) sends \d+ bytes of Float to "
                                                                           r"(this rank|rank \d) but (this rank|rank \d) expects"):
            dist.scatter(torch.empty(2), ins, src=root)
        ins = [torch.ones(2) for _ in range(3)] if self.rank == 0 else None
        with self.assertRaisesRegex(RuntimeError, self.prefix("scatter") + r"(this rank|rank 0) sends 8 bytes of Float to (this rank|rank 2) "
                                                                           r"but (this rank|rank 2) expects 12 bytes"):
            dist.scatter(torch.empty(3 if self.rank == 2 else 2), ins, src=0)
        self.assert_group_usable()

    def test_collective_kind_mismatch(self):
        with self.assertRaisesRegex(RuntimeError, r"cam (all_reduce|all_gather_into_tensor|reduce_scatter_tensor) "
                                                  r"\(seq \d+\) on rank %d: rank \d issued (all_reduce|all_gather|reduce_scatter) "
                                                  r"as its collective #\d+ while this rank issued (all_reduce|all_gather|reduce_scatter)"
                                                  % self.rank):
            if self.rank == 0:
                dist.all_reduce(torch.ones(3))
            elif self.rank == 1:
                dist.all_gather_into_tensor(torch.empty(9), torch.ones(3))
            else:
                dist.reduce_scatter_tensor(torch.empty(1), torch.ones(3))
        self.assert_group_usable()

    def test_uneven_all_gather_disagreement(self):
        # Rank 2 contributes 5 elements; rank 0 expects 4 from everyone (so it takes the even
        # path) while ranks 1 and 2 expect 5 from rank 2 (the uneven path): refused everywhere.
        n = 5 if self.rank == 2 else 4
        sizes = [4, 4, 4] if self.rank == 0 else [4, 4, 5]
        # Each side names the other and what it did.
        want = (r"rank [12] passes output tensors whose sizes differ per rank \(uneven all_gather\)"
                if self.rank == 0 else
                r"rank 0 passes output tensors that all have its input's size, while this rank's "
                r"output sizes differ per rank")
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_gather") + want):
            dist.all_gather([torch.empty(s) for s in sizes], torch.ones(n))
        # Uneven, agreed: rank 1 expects 3 from rank 0, which sends 2.
        sizes = [3, 3, 4] if self.rank == 1 else [2, 3, 4]
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_gather") + r"(this rank|rank 0) sends 8 bytes of Float to "
                                                                              r"(this rank|rank 1) but (this rank|rank 1) expects 12 bytes"):
            dist.all_gather([torch.empty(s) for s in sizes], torch.ones(2 + self.rank))
        self.assert_group_usable()

    def test_uneven_reduce_scatter_disagreement(self):
        # Same total (9 elements) but rank 0 splits it [2, 3, 4] and the others [3, 3, 3]...
        # except that each rank's own block must be its output: rank 0 keeps 2 of its own.
        split = [2, 3, 4] if self.rank == 0 else [3, 3, 3]
        out = torch.empty(split[self.rank])
        other = (r"rank 1 gives rank 0 a block of 12 bytes of Float while this rank gives it 8 bytes of Float"
                 if self.rank == 0 else
                 r"rank 0 gives rank 0 a block of 8 bytes of Float while this rank gives it 12 bytes of Float")
        with self.assertRaisesRegex(RuntimeError, self.prefix("reduce_scatter") + other +
                                    r"; every rank must split its input the same way"):
            dist.reduce_scatter(out, [torch.ones(k) for k in split])
        self.assert_group_usable()

    def test_refused_async_op_then_queued_op_succeeds(self):
        n = 7 if self.rank == 1 else 8
        bad = dist.all_reduce(torch.ones(n), async_op=True)
        t = torch.full((1000,), float(self.rank))
        good = dist.all_reduce(t, async_op=True)
        with self.assertRaisesRegex(RuntimeError, self.prefix("all_reduce") + r"rank \d contributes"):
            bad.wait()
        good.wait()
        self.assertTrue(torch.all(t == 3.0))
        self.assert_group_usable()

    # ---------------------------------------------------------------- local argument errors
    def test_unsupported_dtype_and_op(self):
        # Every rank's own checks refuse these alike; each still takes part as a refusal.
        be = torch_cam.get_cam_backend()
        cases = [
            (torch.uint16, R.SUM, r"cannot reduce UInt16 tensors with SUM"),
            (torch.uint32, R.MAX, r"cannot reduce UInt32 tensors with MAX"),
            (torch.uint64, R.SUM, r"cannot reduce UInt64 tensors with SUM"),
            (torch.float8_e4m3fn, R.SUM, r"cannot reduce Float8_e4m3fn tensors with SUM"),
            (torch.float32, R.BAND, r"cannot reduce Float tensors with BAND: bitwise reductions are defined for integer and bool"),
            (torch.bfloat16, R.BXOR, r"cannot reduce BFloat16 tensors with BXOR"),
            (torch.int32, R.AVG, r"cannot reduce Int tensors with AVG: AVG is defined for floating-point and complex"),
            (torch.bool, R.AVG, r"cannot reduce Bool tensors with AVG"),
            (torch.complex64, R.MIN, r"cannot reduce ComplexFloat tensors with MIN: complex tensors support SUM, AVG and PRODUCT only"),
            (torch.complex128, R.BOR, r"cannot reduce ComplexDouble tensors with BOR"),
        ]
        for dtype, op, msg in cases:
            t = torch.zeros(4, dtype=dtype)
            o = dist.AllreduceOptions()
            o.reduceOp = op
            with self.assertRaisesRegex(RuntimeError, r"cam all_reduce \(seq \d+\) on rank %d: %s" % (self.rank, msg)):
                be.allreduce([t], o)
            ro = dist.ReduceOptions()
            ro.reduceOp = op
            with self.assertRaisesRegex(RuntimeError, r"cam reduce \(seq \d+\) on rank %d: %s" % (self.rank, msg)):
                be.reduce([t], ro)
            so = dist.ReduceScatterOptions()
            so.reduceOp = op
            with self.assertRaisesRegex(RuntimeError, r"cam reduce_scatter_tensor \(seq \d+\) on rank %d: %s" % (self.rank, msg)):
                be._reduce_scatter_base(torch.zeros(1, dtype=dtype), torch.zeros(3, dtype=dtype), so)
        # Through torch.distributed too.
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce \(seq \d+\) on rank %d: cannot reduce Long tensors with AVG" % self.rank):
            dist.all_reduce(torch.zeros(3, dtype=torch.int64), op=R.AVG)
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce \(seq \d+\) on rank %d: cannot reduce UInt16" % self.rank):
            dist.all_reduce(torch.zeros(3, dtype=torch.uint16))
        premul = dist._make_nccl_premul_sum(2.0)
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce \(seq \d+\) on rank %d: reduce op \d+ \(PREMUL_SUM\) is not supported" % self.rank):
            dist.all_reduce(torch.zeros(3), op=premul)
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce_coalesced \(seq \d+\) on rank %d: cannot reduce Float tensors with BOR" % self.rank):
            dist.all_reduce_coalesced([torch.zeros(3), torch.zeros(2)], op=R.BOR)
        self.assert_group_usable()

    def test_malformed_arguments(self):
        be = torch_cam.get_cam_backend()
        r = self.rank
        ag = dist.distributed_c10d.AllgatherOptions()
        with self.assertRaisesRegex(RuntimeError, r"cam all_gather_into_tensor \(seq \d+\) on rank %d: the output tensor \(3 x the "
                                                  r"input's 4\) has 11 elements, expected 12" % r):
            be._allgather_base(torch.empty(11), torch.ones(4), ag)
        with self.assertRaisesRegex(RuntimeError, r"cam all_gather_into_tensor \(seq \d+\) on rank %d: input is Float but output is Int" % r):
            be._allgather_base(torch.empty(12, dtype=torch.int32), torch.ones(4), ag)
        with self.assertRaisesRegex(RuntimeError, r"cam all_gather \(seq \d+\) on rank %d: expected one list of 3 output tensors" % r):
            be.allgather([[torch.empty(4), torch.empty(4)]], [torch.ones(4)], ag)
        outs = [torch.empty(4) for _ in range(3)]
        outs[r] = torch.empty(5)  # only this rank's own slot is known locally (others may differ)
        with self.assertRaisesRegex(RuntimeError, r"cam all_gather \(seq \d+\) on rank %d: output tensor %d \(this rank's\) has 5 "
                                                  r"elements, expected 4" % (r, r)):
            be.allgather([outs], [torch.ones(4)], ag)
        ins = [torch.ones(2) for _ in range(3)]
        ins[r] = torch.ones(3)
        with self.assertRaisesRegex(RuntimeError, r"cam reduce_scatter \(seq \d+\) on rank %d: input tensor %d \(this rank's block\) "
                                                  r"has 3 elements, expected 2" % (r, r)):
            be.reduce_scatter([torch.empty(2)], [ins], dist.ReduceScatterOptions())
        with self.assertRaisesRegex(RuntimeError, r"cam reduce_scatter_tensor \(seq \d+\) on rank %d: the input tensor \(3 x the "
                                                  r"output's 2\) has 7 elements, expected 6" % r):
            be._reduce_scatter_base(torch.empty(2), torch.ones(7), dist.ReduceScatterOptions())
        with self.assertRaisesRegex(RuntimeError, r"cam all_gather_into_tensor_coalesced \(seq \d+\) on rank %d: output 0 must be contiguous" % r):
            self.pg.allgather_into_tensor_coalesced([torch.empty(3, 4).t()], [torch.ones(4)], ag)
        with self.assertRaisesRegex(RuntimeError, r"cam reduce_scatter_tensor_coalesced \(seq \d+\) on rank %d: every input tensor must be "
                                                  r"Float but input tensor 1 is Double" % r):
            self.pg.reduce_scatter_tensor_coalesced([torch.empty(1), torch.empty(1)], [torch.ones(3), torch.ones(3, dtype=torch.double)],
                                               dist.ReduceScatterOptions())
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce_coalesced \(seq \d+\) on rank %d: every tensor must be Float but "
                                                  r"tensor 1 is Int" % r):
            self.pg.allreduce_coalesced([torch.ones(3), torch.ones(3, dtype=torch.int32)], dist.AllreduceCoalescedOptions())
        go = dist.GatherOptions()
        go.rootRank = 7
        with self.assertRaisesRegex(RuntimeError, r"cam gather \(seq \d+\) on rank %d: root rank 7 is out of range" % r):
            be.gather([], [torch.ones(2)], go)
        go.rootRank = (r + 1) % 3
        with self.assertRaisesRegex(RuntimeError, r"cam gather \(seq \d+\) on rank %d: only the root rank %d passes output tensors" % (r, (r + 1) % 3)):
            be.gather([[torch.empty(2)] * 3], [torch.ones(2)], go)
        so = dist.ScatterOptions()
        so.rootRank = (r + 1) % 3
        with self.assertRaisesRegex(RuntimeError, r"cam scatter \(seq \d+\) on rank %d: only the root rank %d passes input tensors" % (r, (r + 1) % 3)):
            be.scatter([torch.empty(2)], [[torch.ones(2)] * 3], so)
        ro = dist.ReduceOptions()
        ro.rootRank = -1
        with self.assertRaisesRegex(RuntimeError, r"cam reduce \(seq \d+\) on rank %d: root rank -1 is out of range" % r):
            be.reduce([torch.ones(2)], ro)
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce \(seq \d+\) on rank %d: expected a CPU tensor" % r):
            be.allreduce([torch.ones(2, device="meta")], dist.AllreduceOptions())
        self.assert_group_usable()


def _init(rank, world_size, init_file, timeout_s):
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _monitored_barrier_missing(rank, world_size, init_file):
    _init(rank, world_size, init_file, 30)
    dist.barrier()
    pg = dist.distributed_c10d._get_default_group()
    if rank == 0:
        start = time.monotonic()
        try:
            pg.monitored_barrier(timedelta(seconds=2), wait_all_ranks=True)
        except RuntimeError as e:
            return str(e), time.monotonic() - start
        return "no error", 0.0
    time.sleep(4)  # never joins
    return "", 0.0


def _monitored_barrier_first_missing(rank, world_size, init_file):
    _init(rank, world_size, init_file, 30)
    dist.barrier()
    if rank == 2:
        time.sleep(4)  # never joins
        return "", 0.0
    start = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=2))  # wait_all_ranks=False
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def _all_reduce_missing(rank, world_size, init_file):
    _init(rank, world_size, init_file, 2)
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(100_000))
        except RuntimeError as e:
            return str(e), time.monotonic() - start
        return "no error", 0.0
    time.sleep(4)
    return "", 0.0


class CollectiveTimeoutTest(unittest.TestCase):
    def test_monitored_barrier_names_every_missing_rank(self):
        results = run_ranks(_monitored_barrier_missing, 3, deadline_s=60)
        msg, elapsed = results[0][1]
        self.assertRegex(msg, r"cam monitored_barrier \(seq \d+\) on rank 0: timeout after 2000 ms waiting for "
                              r"ranks \[1, 2\] to reach the barrier \(2 ranks have not arrived\)")
        self.assertGreaterEqual(elapsed, 1.9)
        self.assertLess(elapsed, 10)

    def test_monitored_barrier_fails_on_the_first_missing_rank(self):
        # As gloo: rank 0 names the first rank that did not arrive; the others say rank 0 failed.
        results = run_ranks(_monitored_barrier_first_missing, 3, deadline_s=60)
        msg, elapsed = results[0][1]
        self.assertRegex(msg, r"cam monitored_barrier \(seq \d+\) on rank 0: timeout after 2000 ms waiting for "
                              r"rank 2 to reach the barrier: Rank 2 failed to pass monitoredBarrier in 2000 ms")
        self.assertLess(elapsed, 10)
        msg, elapsed = results[1][1]
        self.assertIn("Rank 1 successfully reached monitoredBarrier, but received errors while waiting for "
                      "send/recv from rank 0", msg)
        self.assertLess(elapsed, 10)

    def test_all_reduce_timeout_names_op_and_peer(self):
        results = run_ranks(_all_reduce_missing, 2, deadline_s=60)
        msg, elapsed = results[0][1]
        self.assertRegex(msg, r"cam all_reduce \(seq 1\) on rank 0: timeout after 2000 ms waiting for the "
                              r"collective descriptor from rank 1")
        self.assertGreaterEqual(elapsed, 1.9)
        self.assertLess(elapsed, 10)


if __name__ == "__main__":
    run_tests()
