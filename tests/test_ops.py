"""Every cam op against expected values at world sizes 2, 3, 4 and 8 (8 ranks on this 2-core
machine is the oversubscribed case), from 0 bytes to several times the window, every dtype,
non-contiguous tensors, async Work objects and subgroups. The window is shrunk to 1 MiB so that
chunking, ring wrap-around and pipelining run on modest sizes."""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cam  # noqa: F401,E402  registers "cam"
from cam_testing import ALL_DTYPES, CamProcessGroupCase, born_in_heap, make, same_bytes  # noqa: E402

WINDOW = 1 << 20
# 0 bytes, tiny, odd, one chunk, several windows (float32 elements).
SIZES = [0, 1, 7, 4097, 300_001, 1_000_003]


class CamOpsCases(CamProcessGroupCase):
    """The cases; one MultiProcContinuousTest class per world size below (the harness keeps
    per-class state, so each size must be its own direct subclass)."""

    timeout = timedelta(seconds=90)
    cam_options = {"window_bytes": WINDOW, "chunk_bytes": 64 << 10}

    def sizes(self):
        # Oversubscribed runs keep the multi-window sizes but drop the middle ones.
        return SIZES if self.world_size <= 4 else [0, 7, 300_001]

    # ---------------------------------------------------------------- broadcast
    def test_broadcast_sizes_and_roots(self):
        for root in range(self.world_size):
            for n in self.sizes():
                want = make(n, torch.float32, seed=1000 * root + n)
                t = want.clone() if self.rank == root else torch.full((n,), -1.0)
                dist.broadcast(t, src=root)
                self.assertTrue(same_bytes(t, want), f"root {root} n {n}")

    def test_broadcast_every_dtype(self):
        for i, dtype in enumerate(ALL_DTYPES):
            want = make((3, 5, 7), dtype, seed=i)
            t = want.clone() if self.rank == i % self.world_size else torch.zeros_like(want)
            dist.broadcast(t, src=i % self.world_size)
            self.assertTrue(same_bytes(t, want), str(dtype))

    def test_broadcast_noncontiguous(self):
        want = make((64, 3000), torch.float64, seed=7)
        base = want.clone() if self.rank == 0 else torch.zeros(64, 3000 * 2, dtype=torch.float64)
        t = base if self.rank == 0 else base[:, ::2]
        self.assertFalse(self.rank != 0 and t.is_contiguous())
        dist.broadcast(t, src=0)
        self.assertTrue(same_bytes(t, want))
        if self.rank != 0:
            self.assertTrue(torch.all(base[:, 1::2] == 0))  # the gaps were not written
        src = make((4000, 6), torch.int32, seed=8)
        t = src.t() if self.rank == 1 else torch.zeros(6, 4000, dtype=torch.int32)
        dist.broadcast(t, src=1)
        self.assertTrue(same_bytes(t, src.t()))

    def test_broadcast_async_work_and_future(self):
        want = make(200_000, torch.float32, seed=3)
        t = want.clone() if self.rank == 0 else torch.zeros(200_000)
        work = dist.broadcast(t, src=0, async_op=True)
        fut = work.get_future()
        self.assertTrue(work.wait())
        self.assertTrue(work.is_completed())
        self.assertTrue(work.is_success())
        self.assertTrue(same_bytes(fut.wait()[0], want))
        self.assertTrue(same_bytes(t, want))

    # ---------------------------------------------------------------- all_to_all
    def _splits(self, seed):
        # splits[i][j]: rows rank i sends to rank j; deterministic, with empty blocks.
        w = self.world_size
        return [[(i * 7 + j * 3 + seed) % 5 * (seed + 1) for j in range(w)] for i in range(w)]

    def _check_all_to_all_single(self, splits, row_shape, dtype, seed, equal=False):
        w, r = self.world_size, self.rank
        inputs = [make((sum(splits[i]),) + row_shape, dtype, seed=seed * 100 + i) for i in range(w)]
        recv_rows = [splits[j][r] for j in range(w)]
        expected = torch.cat([inputs[j][sum(splits[j][:r]):sum(splits[j][:r + 1])] for j in range(w)])
        out = torch.empty((sum(recv_rows),) + row_shape, dtype=dtype)
        if equal:
            dist.all_to_all_single(out, inputs[r])
        else:
            dist.all_to_all_single(out, inputs[r], output_split_sizes=recv_rows,
                                   input_split_sizes=splits[r])
        self.assertTrue(same_bytes(out, expected), f"splits {splits} dtype {dtype}")

    def test_all_to_all_single_equal(self):
        w = self.world_size
        for n in self.sizes():
            rows = max(n // 64, 0)
            self._check_all_to_all_single([[rows] * w] * w, (16,), torch.float32, seed=n, equal=True)

    def test_all_to_all_single_uneven(self):
        for seed in range(3):
            self._check_all_to_all_single(self._splits(seed), (3,), torch.int64, seed=seed)
        # Uneven and larger than the window per peer.
        big = [[(40_000 + 1000 * i - 700 * j) for j in range(self.world_size)] for i in range(self.world_size)]
        self._check_all_to_all_single(big, (4,), torch.float32, seed=9)

    def test_all_to_all_single_every_dtype(self):
        for i, dtype in enumerate(ALL_DTYPES):
            self._check_all_to_all_single(self._splits(1), (5,), dtype, seed=50 + i)

    def test_all_to_all_single_noncontiguous(self):
        w, r = self.world_size, self.rank
        full = [make((4 * w, 10), torch.float32, seed=70 + i) for i in range(w)]
        inp = full[r].t().contiguous().t()  # same values, column-major
        self.assertFalse(inp.is_contiguous())
        out_base = torch.zeros(10, 4 * w)
        out = out_base.t()
        dist.all_to_all_single(out, inp)
        expected = torch.cat([full[j][4 * r:4 * r + 4] for j in range(w)])
        self.assertTrue(same_bytes(out, expected))

    def test_all_to_all_single_rows_of_other_widths(self):
        # Input rows of 6 elements, output rows of 3: what must agree is each block's bytes (as
        # with gloo), not the row width. Rank i sends 2 input rows to every peer.
        w, r = self.world_size, self.rank
        inputs = [make((2 * w, 6), torch.float32, seed=80 + i) for i in range(w)]
        out = torch.empty(4 * w, 3)
        dist.all_to_all_single(out, inputs[r])
        expected = torch.cat([inputs[j][2 * r:2 * r + 2].reshape(4, 3) for j in range(w)])
        self.assertTrue(same_bytes(out, expected))

    def test_all_to_all_list(self):
        w, r = self.world_size, self.rank
        sizes = lambda i, j: (i + 2 * j) % 4 * 1000 + (7 if (i + j) % 2 else 0)  # noqa: E731
        inputs = [make(sizes(r, j), torch.float16, seed=r * 31 + j) for j in range(w)]
        outputs = [torch.empty(sizes(j, r), dtype=torch.float16) for j in range(w)]
        dist.all_to_all(outputs, inputs)
        for j in range(w):
            self.assertTrue(same_bytes(outputs[j], make(sizes(j, r), torch.float16, seed=j * 31 + r)))

    def test_all_to_all_path_by_size(self):
        # With the single-copy path on, large blocks are read straight from the sender's tensor
        # (this machine allows it); otherwise they are staged: either way the bytes travel by
        # exactly one path, and arrive intact.
        be = torch_cam.get_cam_backend()
        single_copy = "single_copy_bytes=0" not in be.config
        if single_copy:
            self.assertTrue(be.direct_read_available, "process_vm_readv probe failed on this machine")
        w, r = self.world_size, self.rank
        rows = 80_000  # 320 KB blocks: above the 256 KiB threshold of the single-copy class
        inp = make((rows * w,), torch.float32, seed=r)
        out = torch.empty_like(inp)
        before = be.stats()
        dist.all_to_all_single(out, inp)
        after = be.stats()
        peer_bytes = (w - 1) * rows * 4
        direct = after["direct_read_bytes"] - before["direct_read_bytes"]
        staged = after["staged_bytes"] - before["staged_bytes"]
        heap = after["heap_read_bytes"] - before["heap_read_bytes"]
        if born_in_heap(inp.nbytes):  # heap-resident senders are read in place, whatever the size
            self.assertEqual((direct, staged, heap), (0, 0, peer_bytes))
        else:
            self.assertEqual((direct, staged), (peer_bytes, 0) if single_copy else (0, peer_bytes))
        expected = torch.cat([make((rows * w,), torch.float32, seed=j)[r * rows:(r + 1) * rows] for j in range(w)])
        self.assertTrue(same_bytes(out, expected))

    def test_all_to_all_async(self):
        w, r = self.world_size, self.rank
        inp = make((w * 1000,), torch.int32, seed=r)
        out = torch.empty_like(inp)
        work = dist.all_to_all_single(out, inp, async_op=True)
        work.wait()
        expected = torch.cat([make((w * 1000,), torch.int32, seed=j)[r * 1000:(r + 1) * 1000] for j in range(w)])
        self.assertTrue(same_bytes(work.get_future().value()[0], expected))

    # ---------------------------------------------------------------- profiler
    def test_profiler_names_ops_with_their_shapes(self):
        # The Work hands its title and inputs to the profiler only while one listens.
        w, r = self.world_size, self.rank
        x = torch.full((3, 5), float(r))
        y = torch.zeros(7)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            dist.all_reduce(x)
            s = dist.isend(torch.full((7,), float(r)), (r + 1) % w)
            dist.recv(y, (r - 1) % w)
            s.wait()
        self.assertTrue(torch.equal(x, torch.full((3, 5), float(w * (w - 1) // 2))))
        self.assertTrue(torch.equal(y, torch.full((7,), float((r - 1) % w))))
        shapes = {e.name: e.input_shapes for e in prof.events() if e.name.startswith("cam:")}
        self.assertEqual(shapes.get("cam:all_reduce"), [[3, 5]], shapes)
        self.assertEqual(shapes.get("cam:send"), [[7]], shapes)
        self.assertEqual(shapes.get("cam:recv"), [[7]], shapes)

    # ---------------------------------------------------------------- p2p
    def test_send_recv_ring_nonblocking(self):
        # isend returns at once even for messages many times the outbox: a ring of blocking
        # sends would deadlock here.
        w, r = self.world_size, self.rank
        for n in self.sizes():
            send = make(n, torch.float32, seed=r * 7 + n)
            recv = torch.empty(n)
            s = dist.isend(send, (r + 1) % w)
            q = dist.irecv(recv, (r - 1) % w)
            q.wait()
            s.wait()
            self.assertTrue(same_bytes(recv, make(n, torch.float32, seed=((r - 1) % w) * 7 + n)))

    def test_batch_isend_irecv_all_pairs(self):
        w, r = self.world_size, self.rank
        ops, recvs = [], {}
        for p in range(w):
            if p == r:
                continue
            recvs[p] = torch.empty(1000 + p * 13 + r, dtype=torch.int16)
            ops.append(dist.P2POp(dist.irecv, recvs[p], p))
            ops.append(dist.P2POp(dist.isend, make(1000 + r * 13 + p, torch.int16, seed=r * 10 + p), p))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for p, t in recvs.items():
            self.assertTrue(same_bytes(t, make(1000 + p * 13 + r, torch.int16, seed=p * 10 + r)))

    def test_tags_out_of_order(self):
        # Rank 0 sends tags 1, 2, 3 to rank 1 (one message larger than the outbox); rank 1
        # receives 3, 1, 2: per (peer, tag) FIFO, earlier messages get buffered.
        sizes = {1: 300_000, 2: 17, 3: 5}
        if self.rank == 0:
            works = [dist.isend(make(sizes[t], torch.float32, seed=t), 1, tag=t) for t in (1, 2, 3)]
            works.append(dist.isend(make(9, torch.float32, seed=4), 1, tag=1))  # second on tag 1
            for wk in works:
                wk.wait()
        elif self.rank == 1:
            got = {}
            for t in (3, 1, 2):
                got[t] = torch.empty(sizes[t])
                dist.recv(got[t], 0, tag=t)
            again = torch.empty(9)
            dist.recv(again, 0, tag=1)
            for t in (1, 2, 3):
                self.assertTrue(same_bytes(got[t], make(sizes[t], torch.float32, seed=t)), f"tag {t}")
            self.assertTrue(same_bytes(again, make(9, torch.float32, seed=4)))
        dist.barrier()

    def test_recv_any_source(self):
        w, r = self.world_size, self.rank
        if r == 0:
            seen = []
            for _ in range(w - 1):
                t = torch.empty(3, dtype=torch.int64)
                src = dist.recv(t, tag=5)
                self.assertEqual(t.tolist(), [src, src * 2, src * 3])
                seen.append(src)
            self.assertEqual(sorted(seen), list(range(1, w)))
            # any-source irecv reports the source through the Work
            if w > 1:
                t = torch.empty(1, dtype=torch.int64)
                work = dist.irecv(t, tag=6)
                work.wait()
                self.assertEqual(work._source_rank(), 1)
                self.assertEqual(t.item(), 42)
        else:
            dist.send(torch.tensor([r, r * 2, r * 3]), 0, tag=5)
            if r == 1:
                dist.send(torch.tensor([42]), 0, tag=6)
        dist.barrier()

    def test_send_recv_every_dtype_and_noncontiguous(self):
        w, r = self.world_size, self.rank
        if w < 2 or r > 1:
            dist.barrier()
            return
        for i, dtype in enumerate(ALL_DTYPES):
            want = make((40, 30), dtype, seed=i)
            if r == 0:
                dist.send(want.t(), 1, tag=i)
            else:
                out = torch.zeros(30, 80, dtype=dtype)[:, ::2]
                dist.recv(out, 0, tag=i)
                self.assertTrue(same_bytes(out, want.t()), str(dtype))
        dist.barrier()

    # ---------------------------------------------------------------- misc
    def test_barrier_and_backend_name(self):
        self.assertEqual(dist.get_backend(), "cam")
        for _ in range(20):
            dist.barrier()
        work = dist.barrier(async_op=True)
        work.wait()
        self.assertTrue(work.is_completed())

    def test_subgroups_have_own_heap(self):
        w, r = self.world_size, self.rank
        evens = list(range(0, w, 2))
        g_even = dist.new_group(evens)
        g_rev = dist.new_group(list(reversed(range(w))))
        if r in evens:
            self.assertEqual(dist.get_backend(g_even), "cam")
            want = make(5000, torch.float32, seed=11)
            t = want.clone() if r == evens[-1] else torch.zeros(5000)
            dist.broadcast(t, src=evens[-1], group=g_even)
            self.assertTrue(same_bytes(t, want))
            be = torch_cam.get_cam_backend(g_even)
            self.assertNotEqual(be.group_id, torch_cam.get_cam_backend().group_id)
        inp = torch.full((w,), float(r))
        out = torch.empty(w)
        dist.all_to_all_single(out, inp, group=g_rev)
        self.assertEqual(out.tolist(), [float(j) for j in range(w)])
        if r in evens:
            dist.destroy_process_group(g_even)
        dist.barrier()

    def test_interleaved_collectives_and_p2p(self):
        # A pending isend must not block collectives, and collectives must not consume p2p data.
        w, r = self.world_size, self.rank
        big = make(400_000, torch.float32, seed=r)
        s = dist.isend(big, (r + 1) % w, tag=9)
        t = make(1000, torch.float32, seed=5) if r == 0 else torch.zeros(1000)
        dist.broadcast(t, src=0)
        self.assertTrue(same_bytes(t, make(1000, torch.float32, seed=5)))
        got = torch.empty(400_000)
        dist.recv(got, (r - 1) % w, tag=9)
        s.wait()
        self.assertTrue(same_bytes(got, make(400_000, torch.float32, seed=(r - 1) % w)))


class CamOps2(CamOpsCases, MultiProcContinuousTest):
    world_size = 2


class CamOps3(CamOpsCases, MultiProcContinuousTest):
    world_size = 3


class CamOps4(CamOpsCases, MultiProcContinuousTest):
    world_size = 4


class CamOps8(CamOpsCases, MultiProcContinuousTest):
    world_size = 8


class CamOps3SingleCopy(CamOpsCases, MultiProcContinuousTest):
    """The single-copy path on (blocks from 256 KiB read straight from the sender's tensor),
    so every case also runs with large blocks taking it and small ones staged."""

    world_size = 3
    cam_options = {**CamOpsCases.cam_options, "single_copy_bytes": 256 << 10}


if __name__ == "__main__":
    run_tests()
