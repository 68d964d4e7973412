"""The heap allocator mode (torch_cam.use_heap_allocator): ordinary CPU tensors of at least
min_bytes are born in the process heap, which every cam group of the host maps, so collectives
read them in place. Every test runs several processes on real shared memory and checks values
against references computed in plain PyTorch, and the path taken through cam's stats: bytes read
in place grow and nothing is staged where the in-place path applies. Each rank overwrites its
inputs as soon as an op returns, so a peer still reading them would get wrong bytes."""
import os
import subprocess
import sys
import unittest
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cam  # noqa: E402
from cam_testing import assert_all_ok, cam_segments, run_ranks  # noqa: E402

MIN = 64 << 10
N = 300_001  # float32 elements: above every one-shot limit, odd


def init(rank, world, init_file, **opts):
    torch.set_num_threads(1)
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60), pg_options=opts or None)


def data(seed, n=N, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3).to(dtype)


def collectives_in_place(rank, world, init_file, install_before):
    if install_before:
        torch_cam.use_heap_allocator(MIN)
    init(rank, world, init_file)
    if not install_before:
        torch_cam.use_heap_allocator(MIN)  # groups created earlier map the process heaps too
    s = torch_cam.heap_allocator_stats()
    assert (s["installed"], s["auto"], s["min_bytes"]) == (1, 0, MIN), f"an explicit call decides: {s}"
    be = torch_cam.get_cam_backend()
    assert be.process_heap_problem == "", be.process_heap_problem
    stats = be.stats
    xs = [data(100 + p) for p in range(world)]

    def check(name, run, path="reads"):
        # reads: this rank reads peers' tensors in place and stages nothing; source: peers read
        # this rank's tensor, it stages nothing (a broadcast root); staged: nothing in place.
        before = stats()
        run()
        after = stats()
        read = after["heap_read_bytes"] - before["heap_read_bytes"]
        staged = after["staged_bytes"] - before["staged_bytes"]
        if path == "staged":
            assert read == 0 and staged > 0, f"{name}: read in place {read} B, staged {staged} B"
        else:
            assert staged == 0 and (read > 0) == (path == "reads"), f"{name}: read in place {read} B, staged {staged} B"

    # all_to_all_single with uneven splits.
    splits = [(N // world) + (p if p < world - 1 else 0) for p in range(world)]
    splits[-1] = N - sum(splits[:-1])
    inp = xs[rank].clone()
    out = torch.empty(sum(splits[rank] for _ in range(world)))
    check("all_to_all_single", lambda: dist.all_to_all_single(out, inp, [splits[rank]] * world, splits))
    inp.fill_(float("nan"))
    want = torch.cat([xs[p].split(splits)[rank] for p in range(world)])
    assert torch.equal(out, want), "all_to_all_single values"

    # broadcast from every root.
    for root in range(world):
        t = xs[root].clone() if rank == root else torch.zeros(N)
        check(f"broadcast root {root}", lambda: dist.broadcast(t, root), "source" if rank == root else "reads")
        assert torch.equal(t, xs[root]), f"broadcast root {root} values"
        t.fill_(float("nan"))

    # all_gather_into_tensor.
    inp = xs[rank].clone()
    out = torch.empty(world * N)
    check("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, inp))
    inp.fill_(float("nan"))
    assert torch.equal(out, torch.cat(xs)), "all_gather values"

    # all_reduce (two-shot at this size: peers read every input in place), bf16 too.
    for dtype in (torch.float32, torch.bfloat16):
        ys = [x.to(dtype) for x in xs]
        t = ys[rank].clone()
        check(f"all_reduce {dtype}", lambda: dist.all_reduce(t))
        ref = ys[0].float()
        for y in ys[1:]:
            ref = ref + y.float()
        assert torch.equal(t, ref.to(dtype)), f"all_reduce {dtype} values"

    # reduce_scatter_tensor.
    m = N // world
    inp = torch.cat(xs)[: world * m].clone() * (rank + 1)
    out = torch.empty(m)
    check("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(out, inp))
    inp.fill_(float("nan"))
    base = torch.cat(xs)[rank * m:(rank + 1) * m]
    ref = base * 1
    for p in range(1, world):
        ref = ref + base * (p + 1)
    assert torch.equal(out, ref), "reduce_scatter values"

    # scatter and gather through root 1 (each block is its own tensor, born in the heap).
    m = N // world
    blocks = [xs[p][:m].clone() for p in range(world)] if rank == 1 else None
    out = torch.empty(m)
    check("scatter", lambda: dist.scatter(out, blocks, src=1), "source" if rank == 1 else "reads")
    assert torch.equal(out, xs[rank][:m]), "scatter values"
    inp = xs[rank].clone()
    gathered = [torch.empty(N) for _ in range(world)] if rank == 1 else None
    check("gather", lambda: dist.gather(inp, gathered, dst=1), "reads" if rank == 1 else "source")
    inp.fill_(float("nan"))
    if rank == 1:
        assert all(torch.equal(g, x) for g, x in zip(gathered, xs)), "gather values"

    # Below min_bytes tensors stay ordinary: staged, nothing read in place.
    small = torch.full((MIN // 8,), float(rank))
    check("small all_to_all_single", lambda: dist.all_to_all_single(torch.empty_like(small), small),
          "staged")
    s = torch_cam.heap_allocator_stats()
    assert s["installed"] == 1 and s["heap_tensors"] > 0, s
    dist.destroy_process_group()
    return s


def p2p_in_place(rank, world, init_file):
    # Heap-resident sends carry only a header; the receiver copies the payload out of the
    # sender's tensor, in order or out of order (a drained message), and the sender's wait
    # returns only once the copy is done (it then overwrites its tensor).
    torch_cam.use_heap_allocator(MIN)
    init(rank, world, init_file)
    be = torch_cam.get_cam_backend()
    peer = 1 - rank
    a, b = data(500 + rank), data(600 + rank, N // 3)
    before = be.stats()
    if rank == 0:
        works = [dist.isend(a, peer, tag=1), dist.isend(b, peer, tag=2)]
        for w in works:
            w.wait()
        a.fill_(float("nan"))
        b.fill_(float("nan"))
        heap = torch_cam.empty(N)
        heap.copy_(data(700))
        dist.send(heap, peer, tag=3)
        heap.fill_(float("nan"))
    else:
        got_b = torch.empty(N // 3)
        dist.recv(got_b, peer, tag=2)  # tag 1 arrived first: it is drained behind this recv
        got_a = torch.empty(N)
        dist.recv(got_a, peer, tag=1)
        assert torch.equal(got_a, data(500 + peer)) and torch.equal(got_b, data(600 + peer, N // 3)), "p2p values"
        got = torch.empty(N)
        dist.recv(got, peer, tag=3)
        assert torch.equal(got, data(700)), "torch_cam.empty send"
    after = be.stats()
    read = after["heap_read_bytes"] - before["heap_read_bytes"]
    staged = after["staged_bytes"] - before["staged_bytes"]
    assert staged == 0, f"{staged} B staged"
    assert (read == 4 * (N + N // 3 + N)) if rank == 1 else (read == 0), f"{read} B read in place"
    # A size mismatch still fails both ends at once.
    t = data(800) if rank == 0 else torch.empty(N + 1)
    try:
        (dist.send if rank == 0 else dist.recv)(t, peer, tag=4)
    except RuntimeError as e:
        assert "expects" in str(e), str(e)
    else:
        raise AssertionError("size mismatch not reported")
    dist.destroy_process_group()


def mixed(rank, world, init_file):
    # Only even ranks have the mode: every op still gives the reference result (rounds fall
    # back to staging, all_to_all reads the heap senders' blocks in place).
    torch_cam.use_heap_allocator(MIN if rank % 2 == 0 else None)
    init(rank, world, init_file)
    assert torch_cam.heap_allocator_stats()["installed"] == (rank % 2 == 0)
    n = N - N % world
    xs = [data(300 + p, n) for p in range(world)]
    inp = xs[rank].clone()
    out = torch.empty(n)
    dist.all_to_all_single(out, inp)
    inp.zero_()
    want = torch.cat([xs[p].tensor_split(world)[rank] for p in range(world)])
    assert torch.equal(out, want), "all_to_all_single"
    t = xs[rank].clone()
    dist.all_reduce(t)
    ref = xs[0].clone()
    for x in xs[1:]:
        ref = ref + x
    assert torch.equal(t, ref), "all_reduce"
    b = xs[1].clone() if rank == 1 else torch.zeros(n)
    dist.broadcast(b, 1)
    assert torch.equal(b, xs[1]), "broadcast"
    dist.destroy_process_group()


def ddp_step(rank, world, init_file):
    # One DDP step over cam, whose gradient buckets are born in the heap (the env knob installs
    # the mode at import), against the same step over gloo in the same processes.
    init(rank, world, init_file)
    gloo = dist.new_group(backend="gloo")
    grads = {}
    for name, group in (("cam", None), ("gloo", gloo)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1, process_group=group)
        g = torch.Generator().manual_seed(10 + rank)
        before = torch_cam.get_cam_backend().stats()["heap_read_bytes"]
        ddp(torch.randn(32, 256, generator=g)).square().sum().backward()
        if name == "cam":
            read = torch_cam.get_cam_backend().stats()["heap_read_bytes"] - before
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["cam"], grads["gloo"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    installed = torch_cam.heap_allocator_stats()["installed"]
    dist.destroy_process_group()
    return read, installed


def auto_mode(rank, world, init_file):
    # Unless the environment or a call decided, the first group of two or more ranks installs
    # the mode at 1 MiB; a group of one does not.
    decided = os.environ.get("TORCH_CAM_HEAP_ALLOCATOR")
    assert torch_cam.heap_allocator_stats()["installed"] == 0
    init(rank, world, init_file)
    s = torch_cam.heap_allocator_stats()
    on = world > 1 and decided is None
    want = (1, 1, 1 << 20) if on else (0, 0, 0)
    assert (s["installed"], s["auto"], s["min_bytes"]) == want, f"world {world}, env {decided}: {s}"
    if world > 1:
        be = torch_cam.get_cam_backend()
        n = world * (1 << 18)  # 1 MiB blocks, 4 MiB per rank at 4 ranks
        inp = data(900 + rank, n)
        out = torch.empty(n)
        before = be.stats()
        dist.all_to_all_single(out, inp)
        after = be.stats()
        inp.fill_(float("nan"))
        want = torch.cat([data(900 + p, n).tensor_split(world)[rank] for p in range(world)])
        assert torch.equal(out, want), "all_to_all_single values"
        read = after["heap_read_bytes"] - before["heap_read_bytes"]
        assert (read == (world - 1) * n // world * 4) if on else (read == 0), f"read in place {read} B"
        if on:
            torch_cam.use_heap_allocator(MIN)  # an explicit call after the group replaces the auto mode
            s = torch_cam.heap_allocator_stats()
            assert (s["installed"], s["auto"], s["min_bytes"]) == (1, 0, MIN), s
            sub = dist.new_group(list(range(world)))
            assert torch_cam.heap_allocator_stats()["min_bytes"] == MIN, "a later group overrode the call"
            dist.destroy_process_group(sub)
    dist.destroy_process_group()


class HeapAllocatorTest(unittest.TestCase):
    def test_auto_mode(self):
        for world, env in ((2, {}), (4, {}), (1, {}), (2, {"TORCH_CAM_HEAP_ALLOCATOR": "0"})):
            with self.subTest(world=world, env=env):
                assert_all_ok(self, run_ranks(auto_mode, world, env=env, deadline_s=120))

    def test_collectives_read_ordinary_tensors_in_place(self):
        for world, before in ((2, True), (4, False)):
            with self.subTest(world=world, installed_before_init=before):
                res = run_ranks(collectives_in_place, world, before, deadline_s=180)
                assert_all_ok(self, res)
        self.assertEqual(cam_segments(), [])

    def test_p2p_reads_heap_sends_in_place(self):
        assert_all_ok(self, run_ranks(p2p_in_place, 2, deadline_s=120))

    def test_ranks_without_the_mode(self):
        assert_all_ok(self, run_ranks(mixed, 3, deadline_s=120))

    def test_ddp_buckets_match_gloo(self):
        res = run_ranks(ddp_step, 2, env={"TORCH_CAM_HEAP_ALLOCATOR": str(MIN)}, deadline_s=120)
        assert_all_ok(self, res)
        for r in range(2):
            read, installed = res[r][1]
            self.assertEqual(installed, 1)
            self.assertGreater(read, 0, "DDP's buckets were not read in place")

    def test_local_behaviour(self):
        # One process: thresholds, the cache of freed blocks, restoring the previous allocator,
        # and a forked child that must neither hand out nor free the parent's blocks.
        code = r"""
import os, torch, torch_cam
torch.set_num_threads(1)  # no OpenMP pool to inherit across the fork
torch_cam.use_heap_allocator(1 << 20)
s0 = torch_cam.heap_allocator_stats()
a = torch.full((1 << 18,), 7.0)          # 1 MiB: born in the heap
b = torch.ones(1000)                      # small: ordinary
s1 = torch_cam.heap_allocator_stats()
assert s1["heap_tensors"] == s0["heap_tensors"] + 1 and s1["heap_bytes"] >= 1 << 20, s1
del b
c = torch.empty(1 << 18); del c           # freed: kept for the next tensor of its size
assert torch_cam.heap_allocator_stats()["cached_bytes"] >= 1 << 20
pid = os.fork()
if pid == 0:
    try:
        d = torch.full((1 << 18,), 3.0)   # the child's own: not from the parent's heap
        assert torch_cam.heap_allocator_stats()["heap_tensors"] == 1, torch_cam.heap_allocator_stats()
        a.fill_(1.0)                      # copy-on-write, as ordinary memory across fork
        del a                             # the child's copy of a parent tensor: pages stay
        os._exit(0 if float(d.sum()) == 3.0 * (1 << 18) else 3)
    except BaseException as e:
        print("child:", e, flush=True)
        os._exit(4)
_, st = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(st) == 0, st
assert float(a.sum()) == 7.0 * (1 << 18), "the child disturbed the parent's tensor"
torch_cam.use_heap_allocator(None)
e = torch.empty(1 << 20)
s2 = torch_cam.heap_allocator_stats()
assert s2["installed"] == 0 and s2["heap_tensors"] == 1 and s2["cached_bytes"] == 0, s2
del a
assert torch_cam.heap_allocator_stats()["heap_tensors"] == 0
for bad in (-1, 1.5, "x"):
    try:
        torch_cam.use_heap_allocator(bad)
    except ValueError as err:
        assert "min_bytes" in str(err)
    else:
        raise AssertionError(f"{bad!r} accepted")
print("ok")
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("ok", out.stdout)

    def test_aten_scratch_buffers(self):
        # ATen kernels take scratch memory through raw_allocate/raw_deallocate (gelu, sort,
        # matmul, ...), which the installed allocator must serve: from the heap above min_bytes,
        # from the previous allocator below. Values match the same ops with the mode off, and
        # every heap block comes back.
        code = r"""
import torch, torch.nn.functional as F, torch_cam
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
xs = [torch.randn(n, generator=g) for n in (10, 3000, 1 << 16, 1 << 20)]
m = torch.randn(300, 300, generator=g)
def ops():
    out = []
    for x in xs:
        out += [F.gelu(x), F.gelu(x, approximate="tanh"), torch.sort(x)[0], torch.softmax(x, 0),
                torch.cumsum(x, 0), torch.topk(x, min(5, x.numel()))[0], F.layer_norm(x, x.shape)]
    out += [m @ m, torch.linalg.solve(m, m[:, :3]), F.conv1d(m[:, None], m[:8, None, :5])]
    return out
want = ops()
for min_bytes in (1 << 20, 4096):
    torch_cam.use_heap_allocator(min_bytes)
    base = torch_cam.heap_allocator_stats()["heap_tensors"]
    got = ops()
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"values differ at min_bytes {min_bytes}"
    s = torch_cam.heap_allocator_stats()
    assert s["heap_tensors"] > base, s
    del got
    s = torch_cam.heap_allocator_stats()
    assert s["heap_tensors"] == base and s["cached_bytes"] > 0, s
    torch_cam.use_heap_allocator(None)
    assert torch_cam.heap_allocator_stats()["cached_bytes"] == 0
assert all(torch.equal(a, b) for a, b in zip(ops(), want)), "values differ after the mode is off"
print("ok")
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("ok", out.stdout)

    def test_heap_size_and_bad_environment_values(self):
        # A 4 MiB heap holds a 1 MiB tensor; an 8 MiB one comes from the previous allocator.
        code = r"""
import torch, torch_cam
a = torch.empty(1 << 18)
b = torch.empty(1 << 21)
s = torch_cam.heap_allocator_stats()
assert s["heap_tensors"] == 1 and s["fallbacks"] == 1, s
print("ok")
"""
        env = dict(os.environ, TORCH_CAM_HEAP_ALLOCATOR=str(1 << 20), TORCH_CAM_PROCESS_HEAP_BYTES=str(4 << 20))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        for name, value in (("TORCH_CAM_HEAP_ALLOCATOR", "lots"), ("TORCH_CAM_PROCESS_HEAP_BYTES", "-5")):
            env = dict(os.environ, TORCH_CAM_HEAP_ALLOCATOR="65536")
            env[name] = value
            out = subprocess.run([sys.executable, "-c", "import torch_cam"], capture_output=True, text=True,
                                 timeout=60, env=env)
            self.assertNotEqual(out.returncode, 0, name)
            self.assertIn(name, out.stderr)


if __name__ == "__main__":
    unittest.main()
