"""The reduction and gather families against references computed in plain PyTorch, at world
sizes 2, 3, 4 and 8 (8 ranks on this 2-core machine is the oversubscribed case) and with the
all_reduce algorithm forced to one-shot and to two-shot.

Every rank can rebuild every other rank's input from a seed, so each rank checks its own result
against a reference that reduces the ranks' inputs in rank order 0..N-1 (bf16/fp16 widened to
fp32 and rounded once), bit for bit. Gathers and scatter carry arbitrary bit patterns of every
dtype and are compared byte for byte. The window is shrunk to 1 MiB and the chunk to 64 KiB so
that multi-round pipelining and slot reuse run on modest sizes."""
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

R = dist.ReduceOp
WINDOW = 1 << 20
CHUNK = 64 << 10
ONE_SHOT_MAX = 256 << 10  # the default one_shot_max_bytes
EAGER_MAX = 64 << 10  # the default eager_max_bytes: inputs up to it ride in the eager area
# float32 elements: empty, tiny, odd, just past one chunk, exactly the one-shot limit, one past
# it, several windows.
SIZES = [0, 1, 7, 16_411, 65_536, 65_537, 300_001, 1_000_003]

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
COMPLEX = [torch.complex64, torch.complex128]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
REDUCIBLE = FLOATS + COMPLEX + INTS + [torch.bool]


def ops_for(dtype):
    """The reductions cam supports for dtype."""
    if dtype in FLOATS:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    if dtype in COMPLEX:
        return [R.SUM, R.AVG, R.PRODUCT]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]  # ints and bool


def rinput(shape, dtype, seed):
    """Deterministic reduction input: finite floats (no NaN, no zeros in practice, so MIN/MAX
    and signed zeros are unambiguous), complex with small integer parts (so PRODUCT is exact
    whatever the evaluation order inside one complex multiply), integers with arbitrary bits
    (so SUM and PRODUCT wrap)."""
    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return (torch.randn(shape, generator=g, dtype=wide) * 3).to(dtype)
    if dtype in COMPLEX:
        part = torch.float64 if dtype == torch.complex128 else torch.float32
        re = torch.randint(-3, 4, shape, generator=g).to(part)
        im = torch.randint(-3, 4, shape, generator=g).to(part)
        return torch.complex(re, im)
    return make(shape, dtype, seed)


def reference(xs, op, dtype=None):
    """xs[0] op xs[1] op ... in order; bf16/fp16 in fp32 rounded once; AVG = sum / N."""
    dtype = dtype or xs[0].dtype
    n = len(xs)
    if dtype == torch.bool:
        f = {R.SUM: torch.logical_or, R.MAX: torch.logical_or, R.BOR: torch.logical_or,
             R.PRODUCT: torch.logical_and, R.MIN: torch.logical_and, R.BAND: torch.logical_and,
             R.BXOR: torch.logical_xor}[op]
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = f(acc, x)
        return acc
    wide = dtype in (torch.bfloat16, torch.float16)
    f = {R.SUM: torch.add, R.AVG: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum,
         R.MAX: torch.maximum, R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or,
         R.BXOR: torch.bitwise_xor}[op]
    acc = xs[0].float() if wide else xs[0].clone()
    for x in xs[1:]:
        acc = f(acc, x.float() if wide else x)
    if op == R.AVG:
        if acc.is_complex():
            acc = torch.complex(acc.real / torch.full_like(acc.real, n), acc.imag / torch.full_like(acc.imag, n))
        else:
            acc = acc / torch.full_like(acc, n)
    return acc.to(dtype)


def opts_of(cls, op, root=None):
    o = cls()
    o.reduceOp = op
    if root is not None:
        o.rootRank = root
    return o


class CamCollectivesCases(CamProcessGroupCase):
    """The cases; one MultiProcContinuousTest class per configuration below (the harness keeps
    per-class state, so each must be its own direct subclass)."""

    timeout = timedelta(seconds=120)
    cam_options = {"window_bytes": WINDOW, "chunk_bytes": CHUNK}
    algo = "auto"  # the all_reduce algorithm the class's group uses

    @classmethod
    def opts(cls, high_priority_stream=False):
        return {**super().opts(), "allreduce_algo": cls.algo}

    @property
    def light(self):
        return self.world_size > 4

    def sizes(self):
        # Oversubscribed runs keep the boundary and multi-window sizes but drop the others.
        return SIZES if not self.light else [0, 7, 65_537, 1_000_003]

    def staged(self):
        return torch_cam.get_cam_backend().stats()["staged_bytes"]

    def expected_staged(self, nbytes, elem, w=None, me=None):
        """Bytes this rank stages for an all_reduce of nbytes under the class's algorithm:
        one-shot stages the whole input; two-shot every piece but its own."""
        w = self.world_size if w is None else w
        me = self.rank if me is None else me
        if w == 1 or nbytes == 0:
            return 0
        two = self.algo == "two_shot" or (self.algo == "auto" and nbytes > ONE_SHOT_MAX)
        if not two:
            return nbytes
        if born_in_heap(nbytes):
            return 0  # every rank's input is heap-resident: two-shot reads them in place
        numel = nbytes // elem
        per = (numel + w - 1) // w
        own = min(numel, (me + 1) * per) - min(numel, me * per)
        return nbytes - own * elem

    def inputs(self, shape, dtype, seed):
        """Every rank's input, in rank order."""
        return [rinput(shape, dtype, seed * 1000 + i) for i in range(self.world_size)]

    # ---------------------------------------------------------------- all_reduce
    def test_all_reduce_sizes_and_algorithm(self):
        for n in self.sizes():
            xs = self.inputs(n, torch.float32, seed=n)
            for op in (R.SUM, R.AVG, R.MAX):
                t = xs[self.rank].clone()
                before = self.staged()
                dist.all_reduce(t, op=op)
                staged = self.staged() - before
                self.assertTrue(same_bytes(t, reference(xs, op)), f"n {n} op {op}")
                self.assertEqual(staged, self.expected_staged(4 * n, 4), f"algorithm for n {n} ({self.algo})")

    def test_all_reduce_every_dtype_and_op(self):
        # Through ProcessGroup.allreduce: dist.all_reduce would turn complex into real pairs.
        for i, dtype in enumerate(REDUCIBLE):
            elem = torch.empty((), dtype=dtype).element_size()
            # Tails shorter than a vector; and (where not light) a size over the one-shot limit.
            sizes = [1031] if self.light else [1031, ONE_SHOT_MAX // elem + 13]
            for n in sizes:
                xs = self.inputs(n, dtype, seed=100 + i * 7 + n)
                for op in ops_for(dtype):
                    t = xs[self.rank].clone()
                    self.pg.allreduce([t], opts_of(dist.AllreduceOptions, op)).wait()
                    self.assertTrue(same_bytes(t, reference(xs, op)), f"{dtype} {op} n {n}")

    def test_direct_all_reduce(self):
        # torch_cam.all_reduce_ skips torch.distributed's Python layer: same results, same errors.
        for n, dtype, op in ((7, torch.float32, R.SUM), (70_001, torch.bfloat16, R.AVG), (1031, torch.int32, R.MAX)):
            xs = self.inputs(n, dtype, seed=n)
            t = xs[self.rank].clone()
            self.assertIs(torch_cam.all_reduce_(t, op), t)
            self.assertTrue(same_bytes(t, reference(xs, op)), f"{dtype} {op} n {n}")
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce \(seq \d+\) on rank \d+: cannot reduce Float tensors with BAND"):
            torch_cam.all_reduce_(torch.ones(3), R.BAND)
        t = torch.ones(5 if self.rank == 0 else 6)
        with self.assertRaisesRegex(RuntimeError, r"cam all_reduce \(seq \d+\) on rank \d+: .*contributes"):
            torch_cam.all_reduce_(t)
        t = torch.ones(4)
        torch_cam.all_reduce_(t)  # the group is still usable
        self.assertTrue(torch.all(t == self.world_size))

    def test_all_reduce_complex_through_dist(self):
        xs = self.inputs((33, 5), torch.complex64, seed=5)
        t = xs[self.rank].clone()
        dist.all_reduce(t)  # sent as a float32 real view
        self.assertTrue(same_bytes(t, reference(xs, R.SUM)))

    def test_all_reduce_results_identical_on_every_rank(self):
        w = self.world_size
        for dtype, op, n in ((torch.bfloat16, R.AVG, 300_001), (torch.float32, R.SUM, 70_001)):
            t = rinput(n, dtype, seed=self.rank)
            dist.all_reduce(t, op=op)
            raw = t.view(torch.uint8)
            got = torch.empty(w * raw.numel(), dtype=torch.uint8)
            dist.all_gather_into_tensor(got, raw)
            for p in range(w):
                self.assertTrue(torch.equal(got[p * raw.numel():(p + 1) * raw.numel()], raw), f"rank {p} {dtype}")

    def test_all_reduce_noncontiguous(self):
        r = self.rank
        # Every other column, small and then over the window.
        for rows, cols in ((64, 3001), (300, 1100)):
            xs = self.inputs((rows, cols), torch.float64, seed=rows)
            base = torch.full((rows, 2 * cols), -7.0, dtype=torch.float64)
            t = base[:, ::2]
            t.copy_(xs[r])
            self.assertFalse(t.is_contiguous())
            dist.all_reduce(t, op=R.SUM)
            self.assertTrue(same_bytes(t, reference(xs, R.SUM)))
            self.assertTrue(torch.all(base[:, 1::2] == -7.0))  # the gaps were not written
        # Transposed int32 (column-major), MIN.
        xs = [x.t() for x in self.inputs((500, 301), torch.int32, seed=9)]
        t = xs[r].clone()  # keeps the transposed strides
        self.assertFalse(t.is_contiguous())
        dist.all_reduce(t, op=R.MIN)
        self.assertTrue(same_bytes(t, reference(xs, R.MIN)))

    def test_all_reduce_view_into_larger_buffer(self):
        # A contiguous view at an offset: only its elements change.
        xs = self.inputs(5000, torch.bfloat16, seed=3)
        buf = torch.full((7000,), 2.0, dtype=torch.bfloat16)
        t = buf[1000:6000]
        t.copy_(xs[self.rank])
        dist.all_reduce(t, op=R.SUM)
        self.assertTrue(same_bytes(t, reference(xs, R.SUM)))
        self.assertTrue(torch.all(buf[:1000] == 2.0) and torch.all(buf[6000:] == 2.0))

    def test_all_reduce_async_work_and_future(self):
        n = 200_000
        xs = {op: self.inputs(n, torch.float32, seed=int(op)) for op in (R.SUM, R.MIN, R.PRODUCT)}
        ts = {op: x[self.rank].clone() for op, x in xs.items()}
        # Several outstanding at once, then waited in a different order.
        works = {op: dist.all_reduce(ts[op], op=op, async_op=True) for op in ts}
        for op in (R.PRODUCT, R.SUM, R.MIN):
            work = works[op]
            self.assertTrue(work.wait())
            self.assertTrue(work.is_completed())
            self.assertTrue(work.is_success())
            val = work.get_future().value()
            self.assertEqual(len(val), 1)
            self.assertTrue(same_bytes(val[0], reference(xs[op], op)), str(op))
            self.assertTrue(same_bytes(ts[op], reference(xs[op], op)), str(op))
        # Future wait without Work.wait, and a chained callback (as DDP comm hooks use).
        t = xs[R.SUM][self.rank].clone()
        fut = dist.all_reduce(t, async_op=True).get_future()
        chained = fut.then(lambda f: f.value()[0] * 2)
        self.assertTrue(same_bytes(fut.wait()[0], reference(xs[R.SUM], R.SUM)))
        self.assertTrue(same_bytes(chained.wait(), reference(xs[R.SUM], R.SUM) * 2))

    def test_all_reduce_coalesced(self):
        r = self.rank
        shapes = [(3, 5), (0,), (1,), (40_000,), (7, 11, 13)]
        if not self.light:
            shapes.append((300_000,))  # the flattened whole spans several windows
        for k, op in enumerate((R.SUM, R.MAX)):
            xs = [self.inputs(s, torch.float32, seed=50 + 10 * k + j) for j, s in enumerate(shapes)]
            # The deprecated list API.
            ts = [x[r].clone() for x in xs]
            dist.all_reduce_coalesced(ts, op=op)
            for j, t in enumerate(ts):
                self.assertTrue(same_bytes(t, reference(xs[j], op)), f"list {shapes[j]} {op}")
            # The coalescing manager (sync), with a non-contiguous member.
            ts = [x[r].clone() for x in xs]
            base = torch.zeros(7, 11, 26)
            base[..., ::2] = ts[4]
            ts[4] = base[..., ::2]
            with dist._coalescing_manager():
                for t in ts:
                    dist.all_reduce(t, op=op)
            for j, t in enumerate(ts):
                self.assertTrue(same_bytes(t, reference(xs[j], op)), f"manager {shapes[j]} {op}")
            self.assertTrue(torch.all(base[..., 1::2] == 0))
        # Async coalescing manager, int64 BXOR.
        xs = [self.inputs(s, torch.int64, seed=90 + j) for j, s in enumerate(shapes[:4])]
        ts = [x[r].clone() for x in xs]
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, op=R.BXOR)
        cm.wait()
        for j, t in enumerate(ts):
            self.assertTrue(same_bytes(t, reference(xs[j], R.BXOR)), f"async {shapes[j]}")

    def test_all_reduce_small_pieces_and_thresholds(self):
        # Groups over all ranks with other algorithm options: two-shot with fewer elements than
        # ranks (empty pieces) and the smallest chunk; one_shot_max_bytes=0 (two-shot for
        # anything non-empty) and a limit between two sizes.
        w, r = self.world_size, self.rank
        for opts, sizes in (({"allreduce_algo": "two_shot", "chunk_bytes": 4096}, [1, w - 1, w, w + 1, 2 * w + 3, 5000]),
                            ({"one_shot_max_bytes": 0}, [0, 1, 3]),
                            ({"one_shot_max_bytes": 4000}, [1000, 1001])):
            g = dist.new_group(list(range(w)), backend="cam", pg_options={"window_bytes": WINDOW, **opts})
            be = torch_cam.get_cam_backend(g)
            for n in sizes:
                for dtype, op in ((torch.float64, R.SUM), (torch.float16, R.AVG), (torch.uint8, R.PRODUCT)):
                    xs = self.inputs(n, dtype, seed=2100 + n)
                    t = xs[r].clone()
                    before = be.stats()["staged_bytes"]
                    dist.all_reduce(t, op=op, group=g)
                    staged = be.stats()["staged_bytes"] - before
                    self.assertTrue(same_bytes(t, reference(xs, op)), f"{opts} n {n} {dtype}")
                    nbytes = t.nbytes
                    two = opts.get("allreduce_algo") == "two_shot" or nbytes > opts.get("one_shot_max_bytes", ONE_SHOT_MAX)
                    elem = t.element_size()
                    per = (n + w - 1) // w
                    own = (min(n, (r + 1) * per) - min(n, r * per)) * elem
                    self.assertEqual(staged, (nbytes - own if two else nbytes) if n else 0, f"{opts} n {n} {dtype}")
            dist.destroy_process_group(g)

    def test_all_reduce_bool_and_wraparound(self):
        # bool SUM is OR, PRODUCT is AND (as torch's own bool reductions); int8 SUM wraps.
        w, r = self.world_size, self.rank
        t = torch.tensor([r == 0, False, True, r == w - 1])
        dist.all_reduce(t, op=R.SUM)
        self.assertEqual(t.tolist(), [True, False, True, True])
        t = torch.tensor([r == 0, False, True, r == w - 1])
        dist.all_reduce(t, op=R.PRODUCT)
        self.assertEqual(t.tolist(), [w == 1, False, True, w == 1])
        t = torch.full((5,), 100, dtype=torch.int8)
        dist.all_reduce(t)
        self.assertEqual(t.tolist(), [(100 * w + 128) % 256 - 128] * 5)
        # A 0-d tensor.
        t = torch.tensor(float(r + 1), dtype=torch.float64)
        dist.all_reduce(t, op=R.PRODUCT)
        self.assertEqual(t.shape, ())
        self.assertEqual(t.item(), float(torch.arange(1, w + 1).prod()))

    # ---------------------------------------------------------------- reduce
    def test_reduce_every_root_and_size(self):
        sizes = [0, 7, 65_537, 300_001] if not self.light else [7, 300_001]
        for n in sizes:
            xs = self.inputs(n, torch.float32, seed=200 + n)
            want = reference(xs, R.SUM)
            for root in range(self.world_size):
                t = xs[self.rank].clone()
                dist.reduce(t, dst=root, op=R.SUM)
                if self.rank == root:
                    self.assertTrue(same_bytes(t, want), f"root {root} n {n}")
                else:  # a non-root's tensor is only read
                    self.assertTrue(same_bytes(t, xs[self.rank]), f"non-root changed, root {root} n {n}")

    def test_reduce_every_dtype_and_op(self):
        for i, dtype in enumerate(REDUCIBLE):
            root = i % self.world_size
            xs = self.inputs(517, dtype, seed=300 + i)
            for op in ops_for(dtype):
                t = xs[self.rank].clone()
                self.pg.reduce([t], opts_of(dist.ReduceOptions, op, root)).wait()
                if self.rank == root:
                    self.assertTrue(same_bytes(t, reference(xs, op)), f"{dtype} {op}")

    def test_reduce_noncontiguous_and_async(self):
        w, r = self.world_size, self.rank
        root = w - 1
        xs = self.inputs((200, 301), torch.float16, seed=11)
        base = torch.zeros(200, 602, dtype=torch.float16)
        t = base[:, 1::2]
        t.copy_(xs[r])
        work = dist.reduce(t, dst=root, op=R.MAX, async_op=True)
        work.wait()
        if r == root:
            self.assertTrue(same_bytes(t, reference(xs, R.MAX)))
            self.assertTrue(same_bytes(work.get_future().value()[0], reference(xs, R.MAX)))
        else:
            self.assertTrue(same_bytes(t, xs[r]))
        self.assertTrue(torch.all(base[:, ::2] == 0))

    # ---------------------------------------------------------------- reduce_scatter
    def _rs_inputs(self, n, dtype, seed):
        """Rank i's input is w blocks of n; block j (for rank j) from seed (i, j), so a rank
        builds only the blocks it reduces. Returns (this rank's full input, the others'
        blocks for this rank in rank order)."""
        w, r = self.world_size, self.rank
        block = lambda i, j: rinput(n, dtype, seed * 10_000 + i * 100 + j)  # noqa: E731
        mine = torch.cat([block(r, j) for j in range(w)]) if n else torch.empty(0, dtype=dtype)
        return mine, [block(i, r) for i in range(w)]

    def test_reduce_scatter_tensor_sizes(self):
        sizes = [0, 1, 7, 16_411, 300_001] if not self.light else [0, 7, 65_537]
        for n in sizes:
            for op in (R.SUM, R.AVG):
                inp, blocks = self._rs_inputs(n, torch.float32, seed=n + int(op))
                out = torch.full((n,), -1.0)
                dist.reduce_scatter_tensor(out, inp, op=op)
                self.assertTrue(same_bytes(out, reference(blocks, op)), f"n {n} {op}")

    def test_reduce_scatter_every_dtype_and_op(self):
        w = self.world_size
        for i, dtype in enumerate(REDUCIBLE):
            inp, blocks = self._rs_inputs(257, dtype, seed=400 + i)
            for op in ops_for(dtype):
                out = torch.empty(257, dtype=dtype)
                self.pg._reduce_scatter_base(out, inp, opts_of(dist.ReduceScatterOptions, op)).wait()
                self.assertTrue(same_bytes(out, reference(blocks, op)), f"{dtype} {op}")
                # The list form, same bytes.
                out2 = torch.empty(257, dtype=dtype)
                self.pg.reduce_scatter([out2], [list(inp.chunk(w))], opts_of(dist.ReduceScatterOptions, op)).wait()
                self.assertTrue(same_bytes(out2, out), f"list {dtype} {op}")

    def test_reduce_scatter_list_noncontiguous(self):
        w, r = self.world_size, self.rank
        shape = (60, 45)
        g = lambda i, j: rinput(shape, torch.float32, 500 + i * 100 + j)  # noqa: E731
        # Inputs transposed (column-major), output every other column.
        inputs = [g(r, j).t().contiguous().t() for j in range(w)]
        self.assertFalse(inputs[0].is_contiguous())
        base = torch.full((60, 90), 5.0)
        out = base[:, ::2]
        dist.reduce_scatter(out, inputs, op=R.MIN)
        self.assertTrue(same_bytes(out, reference([g(i, r) for i in range(w)], R.MIN)))
        self.assertTrue(torch.all(base[:, 1::2] == 5.0))
        # Large blocks (several windows over all ranks), async.
        n = 250_000 if not self.light else 70_000
        inp, blocks = self._rs_inputs(n, torch.bfloat16, seed=77)
        out = torch.empty(n, dtype=torch.bfloat16)
        work = dist.reduce_scatter(out, list(inp.chunk(w)), op=R.SUM, async_op=True)
        work.wait()
        self.assertTrue(same_bytes(out, reference(blocks, R.SUM)))
        self.assertTrue(same_bytes(work.get_future().value()[0], out))

    def test_reduce_scatter_tensor_in_place(self):
        # FSDP style: the output is this rank's block of the input.
        r = self.rank
        n = 40_001
        inp, blocks = self._rs_inputs(n, torch.float32, seed=33)
        out = inp[r * n:(r + 1) * n]
        dist.reduce_scatter_tensor(out, inp, op=R.SUM)
        self.assertTrue(same_bytes(out, reference(blocks, R.SUM)))

    def test_reduce_scatter_tensor_coalesced(self):
        w = self.world_size
        ns = [5, 0, 3000, 1] + ([100_000] if not self.light else [])
        made = [self._rs_inputs(n, torch.float32, seed=600 + j) for j, n in enumerate(ns)]
        outs = [torch.empty(n) for n in ns]
        with dist._coalescing_manager():
            for (inp, _), out in zip(made, outs):
                dist.reduce_scatter_tensor(out, inp, op=R.SUM)
        for j, ((_, blocks), out) in enumerate(zip(made, outs)):
            self.assertTrue(same_bytes(out, reference(blocks, R.SUM)), f"manager n {ns[j]}")
        # The ProcessGroup method, int32 BAND, 2-d outputs.
        made = [self._rs_inputs(n, torch.int32, seed=700 + j) for j, n in enumerate((12, 30))]
        ins = [m[0].view(w, 3, -1) for m in made]
        outs = [torch.empty(3, 4, dtype=torch.int32), torch.empty(3, 10, dtype=torch.int32)]
        self.pg.reduce_scatter_tensor_coalesced(outs, ins, opts_of(dist.ReduceScatterOptions, R.BAND)).wait()
        for (_, blocks), out in zip(made, outs):
            self.assertTrue(same_bytes(out.reshape(-1), reference(blocks, R.BAND)))

    # ---------------------------------------------------------------- all_gather
    def test_all_gather_into_tensor_sizes(self):
        w, r = self.world_size, self.rank
        for n in self.sizes():
            if n > 300_001 and w > 3:
                n = 300_001 if w == 4 else n // 8  # bounded output per rank
            out = torch.empty(w * n)
            dist.all_gather_into_tensor(out, make(n, torch.float32, seed=r * 7 + n))
            want = torch.cat([make(n, torch.float32, seed=p * 7 + n) for p in range(w)])
            self.assertTrue(same_bytes(out, want), f"n {n}")

    def test_all_gather_every_dtype(self):
        w, r = self.world_size, self.rank
        for i, dtype in enumerate(ALL_DTYPES):
            shape = (3, 5, 7)
            want = [make(shape, dtype, seed=i * 100 + p) for p in range(w)]
            outs = [torch.empty(shape, dtype=dtype) for _ in range(w)]
            dist.all_gather(outs, want[r])
            for p in range(w):
                self.assertTrue(same_bytes(outs[p], want[p]), f"list {dtype} from {p}")
            out = torch.empty((w * 3, 5, 7), dtype=dtype)
            dist.all_gather_into_tensor(out, want[r])
            self.assertTrue(same_bytes(out, torch.cat(want)), f"tensor {dtype}")
            out = torch.empty((w, 3, 5, 7), dtype=dtype)  # stacked rather than concatenated
            dist.all_gather_into_tensor(out, want[r])
            self.assertTrue(same_bytes(out, torch.stack(want)), f"stacked {dtype}")

    def test_all_gather_noncontiguous(self):
        w, r = self.world_size, self.rank
        want = [make((50, 40), torch.float64, seed=800 + p) for p in range(w)]
        inp = want[r].t().contiguous().t()
        self.assertFalse(inp.is_contiguous())
        bases = [torch.zeros(50, 80, dtype=torch.float64) for _ in range(w)]
        outs = [b[:, ::2] for b in bases]
        dist.all_gather(outs, inp)
        for p in range(w):
            self.assertTrue(same_bytes(outs[p], want[p]), f"list from {p}")
            self.assertTrue(torch.all(bases[p][:, 1::2] == 0))
        # into_tensor with a strided output: (w*50, 40) as every other column of a wider buffer.
        base = torch.zeros(w * 50, 80, dtype=torch.float64)
        out = base[:, 1::2]
        dist.all_gather_into_tensor(out, inp)
        self.assertTrue(same_bytes(out, torch.cat(want)))
        self.assertTrue(torch.all(base[:, ::2] == 0))

    def test_all_gather_into_tensor_in_place(self):
        # FSDP style: the input is this rank's block of the output.
        w, r = self.world_size, self.rank
        n = 100_003 if not self.light else 20_011
        want = torch.cat([make(n, torch.int16, seed=900 + p) for p in range(w)])
        out = torch.zeros(w * n, dtype=torch.int16)
        out[r * n:(r + 1) * n] = want[r * n:(r + 1) * n]
        dist.all_gather_into_tensor(out, out[r * n:(r + 1) * n])
        self.assertTrue(same_bytes(out, want))

    def test_all_gather_async(self):
        w, r = self.world_size, self.rank
        want = [make(70_001, torch.uint8, seed=p) for p in range(w)]
        outs = [torch.empty(70_001, dtype=torch.uint8) for _ in range(w)]
        work = dist.all_gather(outs, want[r], async_op=True)
        out = torch.empty(w * 70_001, dtype=torch.uint8)
        work2 = dist.all_gather_into_tensor(out, want[r], async_op=True)
        work2.wait()
        work.wait()
        val = work.get_future().value()
        self.assertEqual(len(val), w)
        for p in range(w):
            self.assertTrue(same_bytes(val[p], want[p]))
            self.assertTrue(same_bytes(outs[p], want[p]))
        self.assertTrue(same_bytes(work2.get_future().value()[0], torch.cat(want)))

    def test_all_gather_coalesced(self):
        w, r = self.world_size, self.rank
        shapes = [(2, 3), (0,), (10_007,), (1,), (4, 4, 4)]
        want = [[make(s, torch.bfloat16, seed=1000 + 10 * p + j) for j, s in enumerate(shapes)] for p in range(w)]
        # The list-of-lists API.
        outs = [[torch.empty(s, dtype=torch.bfloat16) for s in shapes] for _ in range(w)]
        dist.all_gather_coalesced(outs, want[r])
        for p in range(w):
            for j in range(len(shapes)):
                self.assertTrue(same_bytes(outs[p][j], want[p][j]), f"list rank {p} tensor {j}")
        # The coalescing manager over all_gather_into_tensor (output i rank-major).
        flat = [[t.reshape(-1) for t in row] for row in want]
        outs = [torch.empty(w * flat[r][j].numel(), dtype=torch.bfloat16) for j in range(len(shapes))]
        with dist._coalescing_manager():
            for j, out in enumerate(outs):
                dist.all_gather_into_tensor(out, flat[r][j])
        for j, out in enumerate(outs):
            self.assertTrue(same_bytes(out, torch.cat([flat[p][j] for p in range(w)])), f"manager tensor {j}")
        # The ProcessGroup method, async.
        outs = [torch.empty(w * flat[r][j].numel(), dtype=torch.bfloat16) for j in range(len(shapes))]
        work = self.pg.allgather_into_tensor_coalesced(outs, [f for f in flat[r]], dist.distributed_c10d.AllgatherOptions())
        work.wait()
        for j, out in enumerate(outs):
            self.assertTrue(same_bytes(out, torch.cat([flat[p][j] for p in range(w)])), f"method tensor {j}")

    def test_all_gather_uneven_list(self):
        # Ranks contribute different sizes (Megatron's expert-parallel dispatcher does this).
        w, r = self.world_size, self.rank
        big = 300_001 if not self.light else 70_001
        size = lambda p: [0, 7, 4097, big][p % 4] + p  # noqa: E731
        want = [make(size(p), torch.float16, seed=1050 + p) for p in range(w)]
        outs = [torch.empty(size(p), dtype=torch.float16) for p in range(w)]
        base = torch.zeros(2 * size(w - 1), dtype=torch.float16)
        outs[w - 1] = base[::2]  # a strided output
        dist.all_gather(outs, want[r])
        for p in range(w):
            self.assertTrue(same_bytes(outs[p], want[p]), f"from {p}")
        self.assertTrue(torch.all(base[1::2] == 0))

    def test_reduce_scatter_uneven_list(self):
        # Rank j receives a block of its own size; every rank splits its input the same way.
        w, r = self.world_size, self.rank
        big = 200_001 if not self.light else 30_001
        size = lambda j: [5, 0, big, 1000][j % 4] + j  # noqa: E731
        for dtype, op in ((torch.float32, R.SUM), (torch.bfloat16, R.MAX), (torch.int32, R.BXOR)):
            block = lambda i, j: rinput(size(j), dtype, 1070 + 100 * i + j)  # noqa: E731
            out = torch.empty(size(r), dtype=dtype)
            dist.reduce_scatter(out, [block(r, j) for j in range(w)], op=op)
            self.assertTrue(same_bytes(out, reference([block(i, r) for i in range(w)], op)), f"{dtype} {op}")

    # ---------------------------------------------------------------- gather / scatter
    def test_gather_every_root_and_size(self):
        w, r = self.world_size, self.rank
        sizes = [0, 7, 70_001, 300_001] if not self.light else [7, 70_001]
        for n in sizes:
            for root in range(w):
                inp = make(n, torch.float32, seed=1100 + r * 7 + n)
                outs = [torch.empty(n) for _ in range(w)] if r == root else None
                dist.gather(inp, outs, dst=root)
                if r == root:
                    for p in range(w):
                        self.assertTrue(same_bytes(outs[p], make(n, torch.float32, seed=1100 + p * 7 + n)),
                                        f"n {n} root {root} from {p}")

    def test_gather_every_dtype_and_noncontiguous(self):
        w, r = self.world_size, self.rank
        for i, dtype in enumerate(ALL_DTYPES):
            root = i % w
            want = [make((6, 9), dtype, seed=1200 + 17 * i + p) for p in range(w)]
            inp = want[r].t().contiguous().t()  # column-major input
            bases = [torch.zeros(6, 18, dtype=dtype) for _ in range(w)]
            outs = [b[:, ::2] for b in bases] if r == root else None
            dist.gather(inp, outs, dst=root)
            if r == root:
                for p in range(w):
                    self.assertTrue(same_bytes(outs[p], want[p]), f"{dtype} from {p}")
                    self.assertTrue(same_bytes(bases[p][:, 1::2], torch.zeros(6, 9, dtype=dtype)))

    def test_scatter_every_root_and_size(self):
        w, r = self.world_size, self.rank
        sizes = [0, 7, 70_001, 300_001] if not self.light else [7, 70_001]
        for n in sizes:
            for root in range(w):
                ins = [make(n, torch.float32, seed=1300 + 7 * p + n) for p in range(w)] if r == root else None
                out = torch.full((n,), -1.0)
                dist.scatter(out, ins, src=root)
                self.assertTrue(same_bytes(out, make(n, torch.float32, seed=1300 + 7 * r + n)), f"n {n} root {root}")

    def test_scatter_every_dtype_noncontiguous_async(self):
        w, r = self.world_size, self.rank
        for i, dtype in enumerate(ALL_DTYPES):
            root = (i + 1) % w
            want = [make((8, 5), dtype, seed=1400 + 17 * i + p) for p in range(w)]
            ins = [x.t().contiguous().t() for x in want] if r == root else None
            base = torch.zeros(8, 10, dtype=dtype)
            out = base[:, 1::2]
            work = dist.scatter(out, ins, src=root, async_op=True)
            work.wait()
            self.assertTrue(same_bytes(out, want[r]), str(dtype))
            self.assertTrue(same_bytes(base[:, ::2], torch.zeros(8, 5, dtype=dtype)), str(dtype))

    # ---------------------------------------------------------------- heap-resident inputs
    def test_heap_resident_inputs(self):
        # With every input a torch_cam.empty tensor, two-shot all_reduce, reduce_scatter,
        # all_gather and gather read peers' tensors in place (nothing staged); each rank
        # overwrites its tensors as soon as the op returns, so a peer still reading them
        # would get wrong bytes. The tensors sit at different arena offsets on every rank.
        be = torch_cam.get_cam_backend()
        w, r = self.world_size, self.rank
        pad = torch_cam.empty(4096 * (r + 1) + 64 * r, dtype=torch.uint8)  # noqa: F841
        n = 300_001 if not self.light else 70_001
        for k, (dtype, op) in enumerate(((torch.float32, R.SUM), (torch.bfloat16, R.AVG), (torch.int64, R.MAX))):
            xs = self.inputs(n, dtype, seed=2500 + k)
            t = torch_cam.empty(n, dtype=dtype)
            self.assertTrue(torch_cam.is_heap_tensor(t))
            t.copy_(xs[r])
            before = be.stats()
            dist.all_reduce(t, op=op)
            after = be.stats()
            self.assertTrue(same_bytes(t, reference(xs, op)), f"all_reduce {dtype}")
            t.zero_()
            nbytes = t.nbytes
            if self.algo == "one_shot" or (self.algo == "auto" and nbytes <= ONE_SHOT_MAX):
                self.assertEqual(after["staged_bytes"] - before["staged_bytes"], nbytes)
            else:
                self.assertEqual(after["staged_bytes"] - before["staged_bytes"], 0, f"{dtype} staged")
                self.assertGreater(after["heap_read_bytes"] - before["heap_read_bytes"], 0)
        # reduce_scatter_tensor from a heap view at a rank-dependent offset.
        m = n // w + 1
        buf = torch_cam.empty(w * m + 16 * r)
        inp = buf[16 * r:]
        blocks = [rinput(w * m, torch.float32, 2600 + i) for i in range(w)]
        inp.copy_(blocks[r])
        out = torch.empty(m)
        before = be.stats()
        dist.reduce_scatter_tensor(out, inp)
        self.assertEqual(be.stats()["staged_bytes"] - before["staged_bytes"], 0)
        inp.fill_(float("nan"))
        self.assertTrue(same_bytes(out, reference([b[r * m:(r + 1) * m] for b in blocks], R.SUM)))
        # all_gather_into_tensor in place in a heap output, then gather.
        out = torch_cam.empty(w * m, dtype=torch.int16)
        out[r * m:(r + 1) * m] = make(m, torch.int16, seed=2700 + r)
        dist.all_gather_into_tensor(out, out[r * m:(r + 1) * m])
        want = torch.cat([make(m, torch.int16, seed=2700 + p) for p in range(w)])
        self.assertTrue(same_bytes(out, want))
        src = out[r * m:(r + 1) * m]
        outs = [torch.empty(m, dtype=torch.int16) for _ in range(w)] if r == 0 else None
        dist.gather(src, outs, dst=0)
        src.fill_(-1)
        if r == 0:
            self.assertTrue(same_bytes(torch.cat(outs), want))
        # Mixed: only some ranks' inputs in the heap -> staged, same result.
        xs = self.inputs(n, torch.float32, seed=2800)
        t = torch_cam.empty(n) if r % 2 == 0 else torch.empty(n)
        t.copy_(xs[r])
        dist.all_reduce(t)
        self.assertTrue(same_bytes(t, reference(xs, R.SUM)))

    # ---------------------------------------------------------------- misc
    def test_monitored_barrier(self):
        for wait_all in (False, True, False):
            self.pg.monitored_barrier(timedelta(seconds=60), wait_all_ranks=wait_all)
            t = torch.full((3,), float(self.rank))
            dist.all_reduce(t)
            self.assertEqual(t.tolist(), [float(sum(range(self.world_size)))] * 3)

    def test_subgroups(self):
        # torch orders a group's ranks by global rank; group rank k reduces in that order.
        w, r = self.world_size, self.rank
        tail = list(range(1, w))  # a single rank at world size 2
        evens = list(range(0, w, 2))
        g_tail = dist.new_group(ranks=tail, backend="cam", pg_options=self.opts())
        g_even = dist.new_group(ranks=evens, backend="cam", pg_options=self.opts())
        if r in tail:
            self.assertEqual(dist.get_process_group_ranks(g_tail), tail)
            gr = tail.index(r)
            xs = self.inputs(70_001, torch.float32, seed=1500)
            t = xs[r].clone()
            before = self.staged()
            dist.all_reduce(t, group=g_tail)
            self.assertEqual(self.staged() - before, 0)  # the world group's heap did nothing
            self.assertTrue(same_bytes(t, reference([xs[g] for g in tail], R.SUM)))
            blocks = lambda g, k: rinput(1000, torch.float32, 1600 + 100 * g + k)  # noqa: E731
            inp = torch.cat([blocks(r, k) for k in range(len(tail))])
            out = torch.empty(1000)
            dist.reduce_scatter_tensor(out, inp, op=R.AVG, group=g_tail)
            self.assertTrue(same_bytes(out, reference([blocks(g, gr) for g in tail], R.AVG)))
            out = torch.empty(len(tail) * 10, dtype=torch.int64)
            dist.all_gather_into_tensor(out, torch.full((10,), r, dtype=torch.int64), group=g_tail)
            self.assertEqual(out.view(len(tail), 10)[:, 0].tolist(), tail)
        if r in evens:
            self.assertEqual(dist.get_backend(g_even), "cam")
            xs = self.inputs(300_001, torch.bfloat16, seed=1700)
            t = xs[r].clone()
            dist.all_reduce(t, op=R.AVG, group=g_even)
            self.assertTrue(same_bytes(t, reference([xs[g] for g in evens], R.AVG)))
            root = evens[-1]  # global rank
            t = xs[r].clone()
            dist.reduce(t, dst=root, op=R.MAX, group=g_even)
            if r == root:
                self.assertTrue(same_bytes(t, reference([xs[g] for g in evens], R.MAX)))
            outs = [torch.empty(5, dtype=torch.int64) for _ in evens] if r == root else None
            dist.gather(torch.full((5,), r, dtype=torch.int64), outs, dst=root, group=g_even)
            if r == root:
                self.assertEqual([o[0].item() for o in outs], evens)
            out = torch.empty(3, dtype=torch.int64)
            ins = [torch.full((3,), g, dtype=torch.int64) for g in evens] if r == root else None
            dist.scatter(out, ins, src=root, group=g_even)
            self.assertEqual(out.tolist(), [r] * 3)
            dist.destroy_process_group(g_even)
        if r in tail:
            dist.destroy_process_group(g_tail)
        # The world group is unaffected.
        t = torch.full((4,), 1.0 + r)
        dist.all_reduce(t)
        self.assertEqual(t.tolist(), [float(sum(range(1, w + 1)))] * 4)

    def test_interleaved_with_p2p(self):
        # Pending isends (larger than the outbox) must not block collectives, and collectives
        # must not consume p2p data.
        w, r = self.world_size, self.rank
        nxt, prv = (r + 1) % w, (r - 1) % w
        big = make(400_000, torch.float32, seed=r)
        s = dist.isend(big, nxt, tag=9)
        xs = self.inputs(300_001, torch.float32, seed=1800)  # two-shot under auto
        t = xs[r].clone()
        dist.all_reduce(t)
        self.assertTrue(same_bytes(t, reference(xs, R.SUM)))
        s2 = dist.isend(make(1000, torch.int32, seed=r), prv, tag=10)
        inp, blocks = self._rs_inputs(5000, torch.float64, seed=19)
        out = torch.empty(5000, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, inp)
        self.assertTrue(same_bytes(out, reference(blocks, R.SUM)))
        got2 = torch.empty(1000, dtype=torch.int32)
        dist.recv(got2, nxt, tag=10)
        outs = torch.empty(w * 333, dtype=torch.int8)
        dist.all_gather_into_tensor(outs, make(333, torch.int8, seed=r))
        self.assertTrue(same_bytes(outs, torch.cat([make(333, torch.int8, seed=p) for p in range(w)])))
        got = torch.empty(400_000)
        dist.recv(got, prv, tag=9)
        s.wait()
        s2.wait()
        self.assertTrue(same_bytes(got, make(400_000, torch.float32, seed=prv)))
        self.assertTrue(same_bytes(got2, make(1000, torch.int32, seed=nxt)))

    def test_eager_boundary_and_path(self):
        # Up to eager_max_bytes an input rides in the eager area whatever its memory: staged
        # once by its owner, nothing read in place. One element more takes the other paths
        # (heap tensors: read in place). Values checked on both sides of the boundary.
        w, r = self.world_size, self.rank
        be = torch_cam.get_cam_backend()
        fits = EAGER_MAX // 4
        for n in (fits, fits + 1):
            eager = n == fits
            xs = self.inputs(n, torch.float32, seed=4100 + n)
            for root in range(w):
                t = torch_cam.empty(n)
                t.copy_(xs[root] if r == root else torch.zeros(n))
                before = be.stats()
                dist.broadcast(t, root)
                after = be.stats()
                self.assertTrue(same_bytes(t, xs[root]), f"broadcast n {n} root {root}")
                staged = after["staged_bytes"] - before["staged_bytes"]
                read = after["heap_read_bytes"] - before["heap_read_bytes"]
                if eager:
                    self.assertEqual((staged, read), (4 * n if r == root and w > 1 else 0, 0), f"broadcast n {n}")
                elif w > 1:
                    self.assertEqual((staged, read > 0), (0, r != root), f"broadcast n {n}")
            inp = torch_cam.empty(n)
            inp.copy_(xs[r])
            out = torch.empty(w * n)
            before = be.stats()
            dist.all_gather_into_tensor(out, inp)
            after = be.stats()
            self.assertTrue(same_bytes(out, torch.cat(xs)), f"all_gather n {n}")
            staged = after["staged_bytes"] - before["staged_bytes"]
            read = after["heap_read_bytes"] - before["heap_read_bytes"]
            if w > 1:
                self.assertEqual((staged, read > 0), (4 * n, False) if eager else (0, True), f"all_gather n {n}")
            m = n // w
            blocks = [x[: w * m] for x in xs]
            rs_in = blocks[r].clone()
            rs_out = torch.full((m,), -1.0)
            dist.reduce_scatter_tensor(rs_out, rs_in)
            want = reference([b[r * m:(r + 1) * m] for b in blocks], R.SUM)
            self.assertTrue(same_bytes(rs_out, want), f"reduce_scatter n {n}")
            red = xs[r].clone()
            dist.reduce(red, dst=w - 1)
            if r == w - 1:
                self.assertTrue(same_bytes(red, reference(xs, R.SUM)), f"reduce n {n}")

    def test_all_to_all_eager_and_staged_senders(self):
        # Each sender goes eager when its blocks for its peers fit the eager area together;
        # here odd ranks send small blocks (eager) and even ranks large ones (staged), so
        # every receiver mixes both kinds, with uneven splits.
        w, r = self.world_size, self.rank
        small, large = 3, EAGER_MAX // 4 // max(1, w - 1) + 5

        def split(s, d):
            return (small if s % 2 else large) + d

        def data(s):
            return make(sum(split(s, d) for d in range(w)), torch.float32, seed=4200 + s)

        out = torch.empty(sum(split(s, r) for s in range(w)))
        dist.all_to_all_single(out, data(r), [split(s, r) for s in range(w)], [split(r, d) for d in range(w)])
        want = torch.cat([data(s).split([split(s, d) for d in range(w)])[r] for s in range(w)])
        self.assertTrue(same_bytes(out, want))

    def test_eager_sequence_alternates_halves(self):
        # Back-to-back eager collectives of every kind, async so each is queued behind the
        # previous, through the eager area's two halves; every result checked.
        w, r = self.world_size, self.rank
        pending = []
        for k in range(12):
            n = (k * 37) % 200 + 1
            xs = self.inputs(n, torch.float32, seed=4300 + k)
            root = k % w
            t = xs[root].clone() if r == root else torch.zeros(n)
            pending.append((dist.broadcast(t, root, async_op=True), t, xs[root], f"broadcast {k}"))
            g = torch.empty(w * n)
            src = xs[r].clone()
            pending.append((dist.all_gather_into_tensor(g, src, async_op=True), g, torch.cat(xs), f"all_gather {k}"))
            a = torch.empty(w * n)
            a_in = torch.cat([xs[r]] * w)
            pending.append((dist.all_to_all_single(a, a_in, async_op=True), a, torch.cat(xs), f"all_to_all {k}"))
            s = xs[r].clone()
            pending.append((dist.all_reduce(s, async_op=True), s, reference(xs, R.SUM), f"all_reduce {k}"))
            pending.append((None, src, xs[r], f"all_gather input {k}"))
        for work, t, want, what in pending:
            if work is not None:
                work.wait()
            self.assertTrue(same_bytes(t, want), what)

    def test_mixed_sequence_reuses_staging(self):
        # Back-to-back collectives of different shapes and algorithms through the same slots;
        # async so that each is queued behind the previous.
        w, r = self.world_size, self.rank
        plan = [(n, op) for n in (7, 90_001, 3, 260_000, 16_411, 1) for op in (R.SUM, R.MIN)]
        if self.light:
            plan = plan[:6]
        pending = []
        for k, (n, op) in enumerate(plan):
            xs = self.inputs(n, torch.float32, seed=2000 + k)
            t = xs[r].clone()
            pending.append((dist.all_reduce(t, op=op, async_op=True), t, reference(xs, op), f"all_reduce {k}"))
            g = torch.empty(w * (n % 1000 + 1), dtype=torch.int16)
            src = make(n % 1000 + 1, torch.int16, seed=3000 + 10 * k + r)
            want = torch.cat([make(n % 1000 + 1, torch.int16, seed=3000 + 10 * k + p) for p in range(w)])
            pending.append((dist.all_gather_into_tensor(g, src, async_op=True), g, want, f"all_gather {k}"))
        for work, t, want, what in pending:
            work.wait()
            self.assertTrue(same_bytes(t, want), what)


class CamCollectives2(CamCollectivesCases, MultiProcContinuousTest):
    world_size = 2


class CamCollectives3(CamCollectivesCases, MultiProcContinuousTest):
    world_size = 3


class CamCollectives4(CamCollectivesCases, MultiProcContinuousTest):
    world_size = 4


class CamCollectives8(CamCollectivesCases, MultiProcContinuousTest):
    world_size = 8


class CamCollectives3OneShot(CamCollectivesCases, MultiProcContinuousTest):
    """all_reduce forced one-shot at every size (each rank reduces all N inputs)."""

    world_size = 3
    algo = "one_shot"


class CamCollectives3TwoShot(CamCollectivesCases, MultiProcContinuousTest):
    """all_reduce forced two-shot (reduce-scatter + all-gather) at every size, including ones
    with fewer elements than ranks (empty pieces)."""

    world_size = 3
    algo = "two_shot"


if __name__ == "__main__":
    run_tests()
