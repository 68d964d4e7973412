"""The inter-host engine's algorithms (OneSidedBackend: the exchange and every collective built
on it) run over LoopbackTransport, ranks as threads of this process: values checked against
plain PyTorch, bit-identical results on every rank, and injected faults (a rank that stops, a
rank that dies, a put that fails, splits that disagree) raising on the ranks involved within the
fabric's deadline. Every rank's thread is joined with a deadline; the loopback's waits carry the
fabric's timeout, so no thread outlives a test."""
import threading
import time
import unittest

import torch
import torch.distributed as dist

import torch_cam
from torch._C._distributed_c10d import AllgatherOptions

TIMEOUT_S = 3.0


def run_threads(world, fn, timeout_s=TIMEOUT_S, join_s=30.0, make=None):
    """fn(rank, backend, fabric) on `world` threads over one fabric -> (results, errors,
    seconds); make(backend, rank), if given, makes what fn gets from the rank's backend."""
    fabric = torch_cam._C.LoopbackFabric(world, timeout_s)
    backends = [torch_cam._C.OneSidedBackend.over_loopback(fabric, r) for r in range(world)]
    if make is not None:
        backends = [make(b, r) for r, b in enumerate(backends)]
    results, errors, took = [None] * world, [None] * world, [None] * world

    def body(r):
        start = time.monotonic()
        try:
            results[r] = fn(r, backends[r], fabric)
        except Exception as e:  # noqa: BLE001 - reported per rank
            errors[r] = str(e) if make is None else f"{type(e).__name__}: {e}"
        took[r] = time.monotonic() - start

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    end = time.monotonic() + join_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        raise AssertionError(f"ranks {alive} still running after {join_s} s")
    return results, errors, took


def reduce_opts(op, root=None):
    o = dist.ReduceOptions() if root is not None else dist.AllreduceOptions()
    o.reduceOp = op
    if root is not None:
        o.rootRank = root
    return o


def bcast_opts(root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    return o


def inputs(rank, n, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def reference(world, n, dtype, op):
    """Rank order, accumulated as cam's kernels do (bf16 in fp32, rounded once)."""
    xs = [inputs(r, n, dtype) for r in range(world)]
    acc_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    acc = xs[0].to(acc_dtype)
    for x in xs[1:]:
        x = x.to(acc_dtype)
        if op == dist.ReduceOp.SUM:
            acc = acc + x
        elif op == dist.ReduceOp.MAX:
            acc = torch.maximum(acc, x)
        elif op == dist.ReduceOp.MIN:
            acc = torch.minimum(acc, x)
        else:
            acc = acc * x
    return acc.to(dtype)


class OneSidedAlgorithmsTest(unittest.TestCase):
    def assert_ok(self, errors):
        self.assertEqual(errors, [None] * len(errors), errors)

    def test_all_reduce(self):
        # 1 and 7: one eager exchange; 4096 (16 KiB): the eager limit; 16411 and 100003: registered
        # memory read with get, reduce-scatter then all-gather with uneven shards.
        for world in (2, 3, 4):
            for n in (1, 7, 4096, 16411, 100003):
                for dtype, op in ((torch.float32, dist.ReduceOp.SUM), (torch.bfloat16, dist.ReduceOp.SUM),
                                  (torch.int64, dist.ReduceOp.MAX), (torch.float32, dist.ReduceOp.MIN),
                                  (torch.float64, dist.ReduceOp.PRODUCT)):
                    def fn(r, b, _):
                        t = inputs(r, n, dtype)
                        b.allreduce([t], reduce_opts(op)).wait()
                        return t
                    results, errors, _ = run_threads(world, fn)
                    self.assert_ok(errors)
                    want = reference(world, n, dtype, op)
                    for r in range(world):
                        self.assertTrue(torch.equal(results[r], want), f"world {world} n {n} {dtype} {op} rank {r}")

    def test_small_exchanges_back_to_back(self):
        # Two ranks skip done for inline blocks, so one may post its next descriptor before the
        # other has read the last (the second slot); with three, done keeps them in step. Ranks
        # of varying speed, several hundred ops, every result checked.
        for world in (2, 3):
            def fn(r, b, _):
                got = []
                for i in range(300):
                    t = torch.full((3,), float(r * 1000 + i))
                    b.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()
                    got.append(t[0].item())
                    if (i + r) % 7 == 0:
                        time.sleep(0.0002 * (r + 1))
                return got
            results, errors, _ = run_threads(world, fn)
            self.assert_ok(errors)
            want = [float(sum(q * 1000 + i for q in range(world))) for i in range(300)]
            for r in range(world):
                self.assertEqual(results[r], want, f"world {world} rank {r}")

    def test_a_size_mismatch_fails_every_rank_in_that_op(self):
        # Small blocks skip done only where every rank sees every mismatch: between two ranks
        # alone, and in uniform exchanges (every rank's partner, one block size), where any rank
        # of another size differs from every other. Elsewhere (all_to_all with splits) done
        # keeps the ranks whose own blocks matched waiting, to fail with the others.
        def uniform(r, b, _):
            b.allreduce([torch.ones(4 if r == 2 else 3)], reduce_opts(dist.ReduceOp.SUM)).wait()

        def split(r, b, _):
            out_splits = [2 if r == 1 and s == 0 else 1 for s in range(3)]
            b.alltoall_base(torch.empty(sum(out_splits)), torch.ones(3), out_splits, [1] * 3,
                            dist.AllToAllOptions()).wait()

        for fn, culprit in ((uniform, "rank 2 sends 16 bytes, this rank expects 12"),
                            (split, "rank 0 sends 4 bytes, this rank expects 8")):
            _, errors, took = run_threads(3, fn)
            for r in range(3):
                self.assertIsNotNone(errors[r], f"{fn.__name__}: rank {r} returned")
                self.assertLess(took[r], TIMEOUT_S + 2, f"{fn.__name__}: rank {r} took {took[r]:.1f} s")
            self.assertTrue(any(culprit in e for e in errors), errors)

    def test_same_bytes_of_another_dtype_or_reduction_fail_every_rank(self):
        # Inputs of equal bytes but another dtype, or another reduction, would be read as this
        # rank's own: the descriptors name both, and every rank raises in that op (eager blocks,
        # blocks put, and an exchange that keeps done).
        int32_on_2 = lambda r, n: torch.ones(n, dtype=torch.int32 if r == 2 else torch.float32)  # noqa: E731
        cases = {
            "all_reduce dtype": (lambda r, b: b.allreduce([int32_on_2(r, 3)], reduce_opts(dist.ReduceOp.SUM)).wait(),
                                 "rank 2 passes Int tensors reduced with SUM, this rank Float tensors reduced with SUM"),
            "all_reduce op": (lambda r, b: b.allreduce([torch.ones(3)], reduce_opts(
                dist.ReduceOp.MAX if r == 1 else dist.ReduceOp.SUM)).wait(),
                              "rank 1 passes Float tensors reduced with MAX, this rank Float tensors reduced with SUM"),
            "large all_reduce dtype": (lambda r, b: b.allreduce([int32_on_2(r, 20011)],
                                                                reduce_opts(dist.ReduceOp.SUM)).wait(),
                                       "rank 2 passes Int tensors reduced with SUM"),
            "all_gather dtype": (lambda r, b: b._allgather_base(torch.empty(9, dtype=int32_on_2(r, 1).dtype),
                                                                int32_on_2(r, 3), AllgatherOptions()).wait(),
                                 "rank 2 passes Int tensors, this rank Float tensors"),
            "broadcast dtype": (lambda r, b: b.broadcast([int32_on_2(r, 3)], bcast_opts(0)).wait(),
                                "passes Int tensors"),
        }
        for name, (fn, culprit) in cases.items():
            _, errors, took = run_threads(3, lambda r, b, _: fn(r, b))
            for r in range(3):
                self.assertIsNotNone(errors[r], f"{name}: rank {r} returned")
                self.assertLess(took[r], TIMEOUT_S + 2, f"{name}: rank {r} took {took[r]:.1f} s")
            self.assertTrue(any(culprit in e for e in errors), (name, errors))

    def test_all_gather_and_reduce_scatter(self):
        # 3 elements per rank: eager blocks; 20011: read with get. reduce_scatter's block r is
        # reduced in rank order, as all_reduce's shards are: bit-identical to the reference.
        for world in (2, 3, 4):
            for n in (3, 20011):
                def fn(r, b, _):
                    x = inputs(r, n, torch.float32)
                    gathered = torch.empty(world * n)
                    b._allgather_base(gathered, x, AllgatherOptions()).wait()
                    in_place = torch.empty(world * n)
                    in_place[r * n:(r + 1) * n] = x  # the input is this rank's row of the output
                    b._allgather_base(in_place, in_place[r * n:(r + 1) * n], AllgatherOptions()).wait()
                    self.assertTrue(torch.equal(in_place, gathered), f"in-place all_gather rank {r}")
                    y = inputs(r, world * n, torch.bfloat16)
                    mine = torch.empty(n, dtype=torch.bfloat16)
                    o = dist.ReduceScatterOptions()
                    o.reduceOp = dist.ReduceOp.SUM
                    b._reduce_scatter_base(mine, y, o).wait()
                    return gathered, mine
                results, errors, _ = run_threads(world, fn)
                self.assert_ok(errors)
                want_gather = torch.cat([inputs(r, n, torch.float32) for r in range(world)])
                want_sum = reference(world, world * n, torch.bfloat16, dist.ReduceOp.SUM).view(world, n)
                for r in range(world):
                    self.assertTrue(torch.equal(results[r][0], want_gather), f"all_gather world {world} n {n} rank {r}")
                    self.assertTrue(torch.equal(results[r][1], want_sum[r]), f"reduce_scatter world {world} n {n} rank {r}")

    def test_all_gather_of_the_wrong_size_raises_before_any_byte_moves(self):
        # Rank 1 refuses its own output; rank 0, left waiting, raises at the fabric's deadline
        # (the hierarchical backend checks shapes on every rank before this engine runs).
        def fn(r, b, _):
            out = torch.empty(2 * 5 + (1 if r == 1 else 0))
            b._allgather_base(out, torch.ones(5), AllgatherOptions()).wait()
        _, errors, took = run_threads(2, fn)
        self.assertIn("the output holds 11 elements of Float, expected 10 (2 x 5)", errors[1])
        self.assertIsNotNone(errors[0])
        self.assertLess(took[0], TIMEOUT_S + 5)

    def test_reduce_to_each_root(self):
        world, n = 3, 20000
        for root in range(world):
            def fn(r, b, _):
                t = inputs(r, n, torch.float32)
                b.reduce([t], reduce_opts(dist.ReduceOp.SUM, root)).wait()
                return t
            results, errors, _ = run_threads(world, fn)
            self.assert_ok(errors)
            self.assertTrue(torch.equal(results[root], reference(world, n, torch.float32, dist.ReduceOp.SUM)))

    def test_all_to_all_single_uneven(self):
        world = 4
        # rank s sends (s + d) % 3 * 5000 + 1 elements to rank d: small (eager) and large blocks.
        size = [[(s + d) % 3 * 5000 + 1 for d in range(world)] for s in range(world)]

        def fn(r, b, _):
            send = torch.cat([torch.full((size[r][d],), float(r * 100 + d)) for d in range(world)])
            out_splits = [size[s][r] for s in range(world)]
            out = torch.empty(sum(out_splits))
            b.alltoall_base(out, send, out_splits, size[r], dist.AllToAllOptions()).wait()
            return out, out_splits

        results, errors, _ = run_threads(world, fn)
        self.assert_ok(errors)
        for r in range(world):
            out, splits = results[r]
            want = torch.cat([torch.full((splits[s],), float(s * 100 + r)) for s in range(world)])
            self.assertTrue(torch.equal(out, want), f"rank {r}")

    def test_all_to_all_list_broadcast_gather_scatter_barrier(self):
        world = 3

        def fn(r, b, _):
            got = {}
            ins = [torch.arange(4 + d, dtype=torch.float32) + 10 * r for d in range(world)]
            outs = [torch.empty(4 + r) for _ in range(world)]
            b.alltoall(outs, ins, dist.AllToAllOptions()).wait()
            got["a2a"] = outs
            for root in range(world):
                t = torch.full((30000,), float(r))  # above the eager limit: read with get
                o = dist.BroadcastOptions()
                o.rootRank = root
                b.broadcast([t], o).wait()
                got[f"bcast{root}"] = t
            g = dist.GatherOptions()
            g.rootRank = 1
            gout = [[torch.empty(5) for _ in range(world)]] if r == 1 else []
            b.gather(gout, [torch.full((5,), float(r))], g).wait()
            got["gather"] = gout
            s = dist.ScatterOptions()
            s.rootRank = 2
            sin = [[torch.full((6,), float(d)) for d in range(world)]] if r == 2 else []
            sout = [torch.empty(6)]
            b.scatter(sout, sin, s).wait()
            got["scatter"] = sout[0]
            b.barrier(dist.BarrierOptions()).wait()
            return got

        results, errors, _ = run_threads(world, fn)
        self.assert_ok(errors)
        for r in range(world):
            got = results[r]
            for s in range(world):
                self.assertTrue(torch.equal(got["a2a"][s], torch.arange(4 + r, dtype=torch.float32) + 10 * s))
            for root in range(world):
                self.assertTrue(torch.equal(got[f"bcast{root}"], torch.full((30000,), float(root))))
            self.assertTrue(torch.equal(got["scatter"], torch.full((6,), float(r))))
        for s in range(world):
            self.assertTrue(torch.equal(results[1]["gather"][0][s], torch.full((5,), float(s))))

    def test_bad_arguments_raise_before_any_byte_moves(self):
        # Checked on the calling rank before anything is posted (in a spanning group the failure
        # key then fails its peers); none may read or write outside the tensors.
        fabric = torch_cam._C.LoopbackFabric(2, TIMEOUT_S)
        b = torch_cam._C.OneSidedBackend.over_loopback(fabric, 0)
        x, out = torch.ones(4), torch.empty(4)
        for splits, why in (([3, 3], "Split sizes"), ([5, -1], "negative"), ([4], "Number of tensor splits")):
            with self.assertRaisesRegex(RuntimeError, why):
                b.alltoall_base(out, x, [2, 2], splits, dist.AllToAllOptions())
        o = dist.BroadcastOptions()
        o.rootRank = 2
        with self.assertRaisesRegex(RuntimeError, "root 2 is not a rank of the group"):
            b.broadcast([x], o)
        r = dist.ReduceOptions()
        r.rootRank = -1
        with self.assertRaisesRegex(RuntimeError, "root -1 is not a rank of the group"):
            b.reduce([x], r)

    # ---- faults ----

    def test_a_rank_that_stops_makes_the_others_raise_at_the_deadline(self):
        def fn(r, b, _):
            t = torch.ones(100)
            b.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()
            if r == 2:
                return "stopped"  # takes no part in the next op
            b.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()

        results, errors, took = run_threads(3, fn)
        self.assertEqual(results[2], "stopped")
        for r in (0, 1):
            self.assertIsNotNone(errors[r], f"rank {r} returned")
            self.assertIn("timeout after 3000 ms", errors[r])
            self.assertLess(took[r], TIMEOUT_S + 3.0)

    def test_a_rank_that_dies_is_reported_at_once(self):
        def fn(r, b, fabric):
            t = torch.ones(100000)
            if r == 1:
                time.sleep(0.3)
                fabric.mark_dead(1)
                return "dead"
            b.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()

        results, errors, took = run_threads(3, fn)
        for r in (0, 2):
            self.assertIsNotNone(errors[r], f"rank {r} returned")
            self.assertIn("rank 1 is gone", errors[r])
            self.assertLess(took[r], 1.5, f"rank {r} took {took[r]:.2f} s")

    def test_a_failed_put_raises_on_the_sender(self):
        def fn(r, b, fabric):
            if r == 0:
                fabric.fail_posts_to(2)
            time.sleep(0.1)
            t = torch.ones(10)
            b.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()

        results, errors, took = run_threads(3, fn)
        for r in (0, 1):
            self.assertIsNotNone(errors[r], f"rank {r} returned")
            self.assertIn("the put to rank 2 failed (injected fault)", errors[r])
            self.assertLess(took[r], 1.0)
        # Rank 2 heard from nobody: it raises at the deadline.
        self.assertIn("timeout after", errors[2])

    def test_disagreeing_splits_name_both_lengths(self):
        def fn(r, b, _):
            out_splits = [2 if r == 1 and s == 0 else 1 for s in range(2)]
            out = torch.empty(sum(out_splits))
            b.alltoall_base(out, torch.ones(2), out_splits, [1, 1], dist.AllToAllOptions()).wait()

        results, errors, took = run_threads(2, fn)
        # Each side reads the other's descriptor before any data moves: both name the mismatch.
        self.assertIn("rank 0 sends 4 bytes, this rank expects 8", errors[1])
        self.assertIn("rank 1 expects 8 bytes, this rank sends 4", errors[0])
        self.assertLess(max(took), 1.0)


if __name__ == "__main__":
    unittest.main()
