"""cam on several ranks: run with `torchrun --nproc-per-node 4 examples/demo.py` (or `make demo`).

Every rank joins a cam group and a gloo group over the same processes, checks that broadcast,
all_to_all_single with uneven (MoE-style) splits, all_reduce (also on a heap-resident tensor),
all_gather_into_tensor, reduce_scatter_tensor, send/recv and barrier give the right values,
then times each op on both backends and prints the medians and the speedup."""
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import torch_cam  # noqa: F401  registers the "cam" backend

# torch 2.13 renames the *_tensor collectives (*_single); the demo keeps the long-standing names.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def timed(fn, group, iters, gloo, batch=5):
    # A sample is a batch of back-to-back ops after a barrier, so the skew of ranks leaving the
    # barrier is spread over the batch instead of landing on one op.
    samples = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(batch):
            fn(group)
        samples.append((time.perf_counter() - t0) / batch)
    # The slowest rank decides how long a collective took.
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return statistics.median(t.tolist())


def main():
    dist.init_process_group("cam")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"torch_cam demo: {world} ranks, backend '{dist.get_backend()}', "
        f"{torch_cam.get_cam_backend().heap_bytes / 2**20:.0f} MiB of symmetric heap mapped per rank")

    # broadcast
    x = torch.arange(8, dtype=torch.float32) * 1.5 if rank == 0 else torch.zeros(8)
    dist.broadcast(x, src=0)
    print(f"[rank {rank}] broadcast from rank 0 -> {x.tolist()}", flush=True)
    dist.barrier()

    # all_to_all_single with uneven splits: rank r sends (j + r) % 3 + 1 rows to rank j
    send_splits = [(j + rank) % 3 + 1 for j in range(world)]
    recv_splits = [(rank + j) % 3 + 1 for j in range(world)]
    inp = torch.cat([torch.full((n,), 100.0 * rank + j) for j, n in enumerate(send_splits)])
    out = torch.empty(sum(recv_splits))
    dist.all_to_all_single(out, inp, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    expected = torch.cat([torch.full((n,), 100.0 * j + rank) for j, n in enumerate(recv_splits)])
    assert torch.equal(out, expected)
    print(f"[rank {rank}] all_to_all_single got {out.tolist()}", flush=True)
    dist.barrier()

    # all_reduce: every rank ends with the same bits; a heap-resident tensor is read in place
    v = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    dist.all_reduce(v)
    h = torch_cam.zeros(1 << 20)  # 4 MiB in this rank's window of the symmetric heap
    h.fill_(rank + 1)
    dist.all_reduce(h)
    assert torch.equal(v, torch.tensor([1.0, 2.0, 3.0]) * (world * (world + 1) / 2))
    assert torch.all(h == world * (world + 1) / 2)
    print(f"[rank {rank}] all_reduce -> {v.tolist()}; heap-resident all_reduce of {h.numel()} floats "
          f"-> {h[0].item()} everywhere", flush=True)
    g = torch.empty(2 * world)
    dist.all_gather_into_tensor(g, torch.tensor([rank, 10.0 * rank]))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world))
    assert torch.equal(rs, torch.arange(2.0 * rank, 2.0 * rank + 2) * world)
    print(f"[rank {rank}] all_gather_into_tensor -> {g.tolist()}; reduce_scatter_tensor -> {rs.tolist()}",
          flush=True)
    dist.barrier()

    # ring send/recv
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(2, dtype=torch.int64)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([rank, rank * rank]), nxt),
                                   dist.P2POp(dist.irecv, got, prv)])
    for r in reqs:
        r.wait()
    assert got.tolist() == [prv, prv * prv]
    print(f"[rank {rank}] ring recv from rank {prv}: {got.tolist()}", flush=True)
    dist.barrier()

    # timings, cam vs gloo in the same run
    cam = dist.group.WORLD
    ping = torch.zeros(1, dtype=torch.float64)


    def round_trip(group):
        if rank == 0:
            dist.send(ping, 1, group=group)
            dist.recv(ping, 1, group=group)
        elif rank == 1:
            dist.recv(ping, 0, group=group)
            dist.send(ping, 0, group=group)


    say("\nop                        size      cam (median)   gloo (median)   gloo/cam")
    rows = [("send/recv round trip", 8, round_trip, 200)]
    for nbytes in (1 << 10, 1 << 20, 16 << 20):
        buf = torch.ones(nbytes // 4)
        outb = torch.empty_like(buf)
        rows.append(("broadcast", nbytes, lambda g, b=buf: dist.broadcast(b, src=0, group=g), 30 if nbytes < 1 << 24 else 8))
        rows.append(("all_to_all_single", nbytes,
                     lambda g, b=buf, o=outb: dist.all_to_all_single(o, b, group=g), 30 if nbytes < 1 << 24 else 8))
        rows.append(("all_reduce", nbytes, lambda g, b=buf: dist.all_reduce(b, group=g), 30 if nbytes < 1 << 24 else 8))
    for name, nbytes, fn, iters in rows:
        fn(cam), fn(gloo)  # warm up
        t_cam = timed(fn, cam, iters, gloo)
        t_gloo = timed(fn, gloo, iters, gloo)
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else (f"{nbytes >> 10} KiB" if nbytes >= 1024 else f"{nbytes} B")
        say(f"{name:24s} {size:>7s}   {t_cam * 1e6:10.1f} us   {t_gloo * 1e6:10.1f} us   {t_gloo / t_cam:7.1f}x")

    # Leave together: no rank tears its groups down while rank 0 is still printing over them.
    dist.barrier(group=gloo)
    dist.barrier()
    dist.destroy_process_group()
    # Returning drops the last references to the groups, so their worker threads are joined
    # here and not during interpreter shutdown: a gloo worker that releases a finished op's
    # Python-owned tensors after the interpreter began finalizing aborts the process.


if __name__ == "__main__":
    main()
