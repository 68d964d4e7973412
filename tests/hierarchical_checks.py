"""Checks of a cam group whose ranks span hosts, run by every rank of an initialized default
group: every collective and point-to-point op against a pure-PyTorch reference built from
inputs that every rank can recompute, and bit-identity of float results across ranks (read back
through a gloo group). Used by tests/test_hierarchical.py (hosts simulated with
TORCH_CAM_HOST_ID) and tests/multihost/ (hosts simulated with namespaces by multihost.sh)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

# Small, one element short of the rail threshold's multiple, and past it (rails when uniform).
SIZES = (1, 7, 16411, 1 << 17)


def ints(numel: int, rank: int, salt: int, dtype=torch.float32) -> torch.Tensor:
    """Small integers (exact under any summation order) that depend only on the arguments."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def floats(numel: int, rank: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + salt)
    return torch.randn(numel, generator=g)


def _same_everywhere(t: torch.Tensor, gloo) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t, group=gloo)
    return all(torch.equal(g.view(torch.int32), t.view(torch.int32)) for g in gathered)


def check_all(rank: int, world: int) -> list[str]:
    """Runs every op; returns what went wrong (empty when all matched)."""
    bad: list[str] = []

    def expect(name, got, want):
        if not torch.equal(got, want):
            diff = (got != want).nonzero()
            bad.append(f"{name}: {diff.numel()} elements differ, first at {diff[:1].tolist()}: "
                       f"got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")

    gloo = dist.new_group(backend="gloo")
    # all_to_all through the rank of the receiver's local index on the sender's host (the
    # group-wide option; direct where hosts differ in size or hold one rank each).
    two_hops = dist.new_group(backend="cam", pg_options={"all_to_all_hops": "two_hops"})
    for salt, n in enumerate(SIZES):
        everyone = [ints(n, r, salt) for r in range(world)]
        mine = everyone[rank]
        # all_reduce: SUM, MAX, AVG (floats), int64, a non-contiguous tensor
        t = mine.clone(); dist.all_reduce(t)
        expect(f"all_reduce sum n={n}", t, torch.stack(everyone).sum(0))
        t = mine.clone(); dist.all_reduce(t, op=dist.ReduceOp.MAX)
        expect(f"all_reduce max n={n}", t, torch.stack(everyone).amax(0))
        t = mine.clone(); dist.all_reduce(t, op=dist.ReduceOp.AVG)
        expect(f"all_reduce avg n={n}", t, torch.stack(everyone).sum(0) / world)
        t = mine.to(torch.int64); dist.all_reduce(t)
        expect(f"all_reduce int64 n={n}", t, torch.stack(everyone).sum(0).to(torch.int64))
        if n > 1:
            wide = torch.zeros(n, 2); wide[:, 0] = mine; col = wide[:, 0]
            dist.all_reduce(col)
            expect(f"all_reduce strided n={n}", wide[:, 0], torch.stack(everyone).sum(0))
        f = floats(n, rank, salt); dist.all_reduce(f)
        if not _same_everywhere(f, gloo):
            bad.append(f"all_reduce of floats n={n}: results differ between ranks")
        # reduce to a rank of the last host and to rank 0
        for root in (world - 1, 0):
            t = mine.clone(); dist.reduce(t, dst=root)
            if rank == root:
                expect(f"reduce root={root} n={n}", t, torch.stack(everyone).sum(0))
        # broadcast from every rank
        for root in range(world):
            t = mine.clone(); dist.broadcast(t, src=root)
            expect(f"broadcast root={root} n={n}", t, everyone[root])
        # all_gather (list and tensor)
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, mine)
        expect(f"all_gather n={n}", torch.stack(outs), torch.stack(everyone))
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, mine)
        expect(f"all_gather_into_tensor n={n}", out, torch.cat(everyone))
        # reduce_scatter (list and tensor): rank r gets the sum of everyone's row r
        rows = [ints(n, r, 100 + salt + j) for r in range(world) for j in range(world)]
        my_rows = rows[rank * world:(rank + 1) * world]
        want = torch.stack([rows[r * world + rank] for r in range(world)]).sum(0)
        out = torch.empty(n); dist.reduce_scatter(out, list(my_rows))
        expect(f"reduce_scatter n={n}", out, want)
        out = torch.empty(n); dist.reduce_scatter_tensor(out, torch.cat(my_rows))
        expect(f"reduce_scatter_tensor n={n}", out, want)
        out = torch.empty(n); dist.reduce_scatter_tensor(out, torch.cat(my_rows), op=dist.ReduceOp.AVG)
        expect(f"reduce_scatter_tensor avg n={n}", out, want / world)
        # uneven lists: rank r contributes n + 3r elements (all_gather), block d is n + 2d (reduce_scatter)
        own = lambda r: n + 3 * r  # noqa: E731
        outs = [torch.empty(own(r)) for r in range(world)]
        dist.all_gather(outs, ints(own(rank), rank, 500 + salt))
        expect(f"all_gather uneven n={n}", torch.cat(outs), torch.cat([ints(own(r), r, 500 + salt) for r in range(world)]))
        blocks = [ints(n + 2 * d, rank, 600 + salt + d) for d in range(world)]
        out = torch.empty(n + 2 * rank); dist.reduce_scatter(out, blocks)
        expect(f"reduce_scatter uneven n={n}", out,
               torch.stack([ints(n + 2 * rank, s, 600 + salt + rank) for s in range(world)]).sum(0))
        out = torch.empty(n + 2 * rank); dist.reduce_scatter(out, blocks, op=dist.ReduceOp.MAX)
        expect(f"reduce_scatter uneven max n={n}", out,
               torch.stack([ints(n + 2 * rank, s, 600 + salt + rank) for s in range(world)]).amax(0))
        # all_gather_coalesced: every rank's list of inputs of several shapes
        shapes = [(n,), (2, 3), (1,)]
        ins = [ints(int(torch.Size(sh).numel()), rank, 700 + salt + i).view(sh) for i, sh in enumerate(shapes)]
        outs = [[torch.empty(sh) for sh in shapes] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins)
        for r in range(world):
            for i, sh in enumerate(shapes):
                expect(f"all_gather_coalesced rank {r} input {i} n={n}", outs[r][i],
                       ints(int(torch.Size(sh).numel()), r, 700 + salt + i).view(sh))
        # gather / scatter to and from the last rank
        root = world - 1
        outs = [torch.empty(n) for _ in range(world)] if rank == root else None
        dist.gather(mine, outs, dst=root)
        if rank == root:
            expect(f"gather n={n}", torch.stack(outs), torch.stack(everyone))
        out = torch.empty(n)
        dist.scatter(out, [everyone[r] * 3 for r in range(world)] if rank == root else None, src=root)
        expect(f"scatter n={n}", out, everyone[rank] * 3)
        _check_all_to_all(rank, world, n, salt, None, "", expect)
        _check_all_to_all(rank, world, n, salt, two_hops, " (two hops)", expect)
        # point to point: a ring (neighbours on the same host and on the next), then pairs
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(n)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt), dist.P2POp(dist.irecv, got, prv)])
        for q in reqs:
            q.wait()
        expect(f"ring send/recv n={n}", got, everyone[prv])
        for peer in range(world):
            if peer == rank:
                continue
            if rank < peer:
                dist.send(mine * 2, peer, tag=peer)
                got = torch.empty(n); dist.recv(got, peer, tag=rank)
            else:
                got = torch.empty(n); dist.recv(got, peer, tag=rank)
                dist.send(mine * 2, peer, tag=peer)
            expect(f"send/recv {rank}<->{peer} n={n}", got, everyone[peer] * 2)
    bad += _check_queued_and_unwaited(rank, world, expect)
    bad += _check_recv_any_source(rank, world, expect)
    _check_coalescing_blocks(rank, world, expect)
    dist.barrier()
    import torch_cam
    torch_cam.monitored_barrier(wait_all_ranks=True)
    dist.monitored_barrier()
    dist.destroy_process_group(two_hops)
    dist.destroy_process_group(gloo)
    return bad


def _check_queued_and_unwaited(rank, world, expect) -> list[str]:
    """Async ops queued, then a blocking op behind them (its waiter runs the queue up to it, in
    issue order); then ops waited only through their Future, which the group's worker alone
    runs: right after blocking ops (found by its polls) and after an idle spell (it is parked
    and rung)."""
    bad = []
    ts = [ints(5, rank, 900 + i) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    b = ints(5, rank, 903)
    dist.broadcast(b, src=world - 1)
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        expect(f"queued async all_reduce {i}", t, sum(ints(5, r, 900 + i) for r in range(world)))
    expect("broadcast behind queued async ops", b, ints(5, world - 1, 903))
    for idle_s in (0.0, 0.3):
        x = torch.ones(4)
        for _ in range(50):
            dist.all_reduce(x)
        time.sleep(idle_s)
        x.fill_(rank + 1)
        t0 = time.monotonic()
        fut = dist.all_reduce(x, async_op=True).get_future()
        while not fut.done() and time.monotonic() - t0 < 10:
            time.sleep(0.0005)  # polling done() drives nothing
        took = time.monotonic() - t0
        if not fut.done() or took > 2.0:
            bad.append(f"an all_reduce waited only through its Future (after {idle_s} s idle) took {took:.2f} s")
        else:
            expect(f"all_reduce waited through its Future after {idle_s} s idle", x,
                   torch.full((4,), float(world * (world + 1) // 2)))
    return bad


def _check_coalescing_blocks(rank, world, expect):
    """dist._coalescing_manager with a device, as DeepSpeed's ZeRO-3 uses it: blocks of
    all_reduce (small and rail-sized), all_gather_into_tensor and reduce_scatter_tensor, waited
    through the block's Work or at its end, and a block of isend / irecv around a ring."""
    cpu = torch.device("cpu")
    local = dist.group.WORLD._get_backend(cpu).local  # this host's cam group: counts its ops

    def block(op, calls):
        """Runs calls in one block; returns how many ops the host's cam group ran for it."""
        before = local._get_sequence_number_for_group()
        with dist._coalescing_manager(device=cpu, async_ops=True) as cm:
            for c in calls:
                op(*c)
        cm.wait()
        return local._get_sequence_number_for_group() - before

    # Small tensors of one dtype move as one op; an int64 one splits the run; one of 128 KiB
    # (past the fusion size) and AVG go through too.
    dtypes = (torch.float32, torch.float32, torch.int64, torch.float32, torch.float32, torch.float32)
    sizes = (3, 1 << 13, 7, 1 << 15, 5, 11)
    ts = [ints(n, rank, 960 + i, dt) for i, (n, dt) in enumerate(zip(sizes, dtypes))]
    ops_fused = block(dist.all_reduce, [(t,) for t in ts])
    for i, t in enumerate(ts):
        expect(f"coalesced all_reduce {i}", t, sum(ints(t.numel(), r, 960 + i, t.dtype) for r in range(world)))
    ops_one = block(dist.all_reduce, [(ints(3, rank, 0),)])
    avg = [floats(4, rank, 967), floats(6, rank, 968)]
    block(lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG), [(t,) for t in avg])
    for i, t in enumerate(avg):
        if not torch.allclose(t, sum(floats(t.numel(), r, 967 + i) for r in range(world)) / world, atol=1e-6):
            expect(f"coalesced all_reduce AVG {i}", t, sum(floats(t.numel(), r, 967 + i) for r in range(world)) / world)
    if ops_fused != 4 * ops_one and local.size() > 1:  # runs: [0, 1], [2], [3], [4, 5]
        expect(f"coalesced all_reduce of 6 tensors in 4 runs: host ops {ops_fused}, one op {ops_one}",
               torch.tensor(ops_fused), torch.tensor(4 * ops_one))
    sizes = (5, 3, 1 << 10)
    outs = [torch.empty(world * n) for n in sizes]
    strided = torch.empty(world * 3, 2)[:, 0]  # not contiguous: gathered on its own
    block(dist.all_gather_into_tensor, [(o, ints(n, rank, 962 + i)) for i, (o, n) in enumerate(zip(outs, sizes))]
          + [(strided, ints(3, rank, 969))])
    for i, (o, n) in enumerate(zip(outs, sizes)):
        expect(f"coalesced all_gather_into_tensor {i}", o, torch.cat([ints(n, r, 962 + i) for r in range(world)]))
    expect("coalesced all_gather_into_tensor, strided output", strided,
           torch.cat([ints(3, r, 969) for r in range(world)]))
    outs = [torch.empty(n) for n in sizes]
    block(dist.reduce_scatter_tensor, [(o, ints(world * n, rank, 964 + i)) for i, (o, n) in enumerate(zip(outs, sizes))])
    for i, (o, n) in enumerate(zip(outs, sizes)):
        want = sum(ints(world * n, r, 964 + i) for r in range(world))[rank * n:(rank + 1) * n]
        expect(f"coalesced reduce_scatter_tensor {i}", o, want)
    got = torch.empty(4)
    with dist._coalescing_manager(device=cpu, async_ops=True) as cm:
        dist.isend(ints(4, rank, 966), (rank + 1) % world)
        dist.irecv(got, (rank - 1) % world)
    cm.wait()
    expect("isend / irecv in a coalescing block", got, ints(4, (rank - 1) % world, 966))


def _check_recv_any_source(rank, world, expect) -> list[str]:
    """recv from any source on rank 0, its senders on its own host (cam) and on others (UCX):
    each message taken once, in order per sender, with its sender reported; a message of the
    wrong size raises naming both sizes and the group stays usable. Over the gloo fallback it
    raises at once naming UCX."""
    bad = []
    engine = dist.group.WORLD._get_backend(torch.device("cpu")).inter_host_engine
    if engine != "cam-ucx":
        if rank == 0:
            try:
                dist.recv(torch.empty(3), tag=5)
                bad.append(f"recv from any source over {engine} did not raise")
            except RuntimeError as e:
                if "needs UCX" not in str(e):
                    bad.append(f"recv from any source over {engine} raised: {e}")
        dist.barrier()
        return bad
    senders, each = range(1, world), 10
    if rank == 0:
        # The first posted before anything is sent (a barrier lets the senders go); then the
        # senders' messages, `each` per sender sent back to back, race between the engines;
        # then 256 KiB from the last sender (UCX's rendezvous between hosts).
        first = torch.empty(3)
        early = dist.irecv(first, tag=5)
        dist.barrier()
        got = {}
        for i in range(each * len(senders)):
            if i == 0:
                t = first
                early.wait()
                src = early._source_rank()
            else:
                t = torch.empty(3)
                src = dist.recv(t, tag=5)
            got.setdefault(src, []).append(t[2].item())
            expect(f"recv any source #{i} from rank {src}", t[:2], torch.tensor([src, 2.0 * src]))
        if sorted(got) != list(senders) or any(v != list(map(float, range(each))) for v in got.values()):
            bad.append(f"recv from any source: got (sender: sequence) {got}, want {each} from each of "
                       f"{list(senders)} in order")
        big = torch.empty(1 << 16)
        work = dist.irecv(big, tag=6)
        work.wait()
        if work._source_rank() != world - 1:
            bad.append(f"a 256 KiB any-source recv reports rank {work._source_rank()}, sent by {world - 1}")
        expect("256 KiB recv from any source", big, ints(1 << 16, world - 1, 950))
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(4), tag=7)
            bad.append("an any-source recv of a message shorter than its tensor did not raise")
        except RuntimeError as e:
            if f"rank {world - 1} sent 8 bytes, this rank expects 16" not in str(e) or time.monotonic() - t0 > 5:
                bad.append(f"an any-source recv of a short message raised after {time.monotonic() - t0:.1f} s: {e}")
    else:
        dist.barrier()
        for i in range(each):
            dist.send(torch.tensor([rank, 2.0 * rank, float(i)]), 0, tag=5)
        if rank == world - 1:
            dist.send(ints(1 << 16, rank, 950), 0, tag=6)
            dist.send(torch.ones(2), 0, tag=7)
    t = torch.ones(2)
    dist.all_reduce(t)  # still usable
    expect("all_reduce after recv from any source", t, torch.full((2,), float(world)))
    return bad


def _check_all_to_all(rank, world, n, salt, group, how, expect):
    """all_to_all_single with equal and uneven splits (rows of one and of three elements),
    all_to_all of lists, on `group` (None: the default group)."""
    out = torch.empty(world * n)
    dist.all_to_all_single(out, torch.cat([ints(n, rank, 200 + salt + d) for d in range(world)]), group=group)
    expect(f"all_to_all_single n={n}{how}", out, torch.cat([ints(n, s, 200 + salt + rank) for s in range(world)]))
    split = lambda s, d: (s + 2 * d) % 3 + (n % 5)  # noqa: E731 (rows rank s sends rank d)
    for width in (1, 3):
        send = torch.cat([ints(split(rank, d) * width, rank, 300 + d) for d in range(world)]).view(-1, width)
        out = torch.empty(sum(split(s, rank) for s in range(world)), width)
        dist.all_to_all_single(out, send, [split(s, rank) for s in range(world)],
                               [split(rank, d) for d in range(world)], group=group)
        expect(f"all_to_all_single uneven n={n} width={width}{how}", out,
               torch.cat([ints(split(s, rank) * width, s, 300 + rank) for s in range(world)]).view(-1, width))
    outs = [torch.empty(n) for _ in range(world)]
    dist.all_to_all(outs, [ints(n, rank, 400 + d) for d in range(world)], group=group)
    expect(f"all_to_all n={n}{how}", torch.stack(outs), torch.stack([ints(n, s, 400 + rank) for s in range(world)]))
