"""KV-cache transfer on cam (torch_cam.kv.KVTransfer.push) against gloo send/recv of the same
blocks and the memcpy bound, on 2 ranks in one run.

    .venv/bin/python benchmarks/bench_kv.py [--quick] [--out FILE]

A "block" here is one paged-KV block of one layer (K and V, 8 heads x 128 bf16 per token, so a
block of B bytes holds B / 4 KiB tokens). For each block size and blocks-per-request count, rank
0 moves one request's blocks into rank 1:
- cam: ``push`` from rank 0's heap pool into rank 1's (same layout, block ids as a Python list),
  timed two ways: until push() returns on rank 0 (the notification is posted inside it), and
  until rank 1's ``wait_notification`` returns (one clock for both processes: CLOCK_MONOTONIC);
- gloo: ``isend`` of every block (rank 1 ``irecv`` into its pool blocks), waited;
- memcpy bound: rank 0 copying the request's bytes as one contiguous memcpy within its memory.
Medians of samples; GB/s = request bytes / time; "per block" = seen time / blocks; "overhead"
= push time - memcpy bound (what the request costs beyond moving its bytes).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KiB, MiB = 1 << 10, 1 << 20
TOKEN_BYTES = 2 * 8 * 128 * 2


def cells(quick):
    sizes = [16 * KiB, 64 * KiB, 1 * MiB, 4 * MiB]
    counts = [1, 16, 128, 1024] if not quick else [1, 128, 1024]
    return [(b, n) for b in sizes for n in counts if b * n <= 256 * MiB]


def worker(rank, init_file, quick, out_q):
    import torch_cam
    from torch_cam.kv import KVTransfer
    from torch_cam.kv_reference import KVLayout
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=2)
    gloo = dist.new_group([0, 1], backend="gloo")
    rows = []
    for block_bytes, nblocks in cells(quick):
        bs = block_bytes // TOKEN_BYTES
        lay = KVLayout("mha", 1, nblocks, bs, 8, 128, torch.bfloat16, "NHD")
        pool = torch_cam.zeros(*lay.pool_shape(), dtype=torch.bfloat16)
        kv = KVTransfer()
        kv.register([pool], lay)
        ids = list(range(nblocks))
        tokens = nblocks * bs
        samples = 5 if quick else 11
        # blocks as separate tensors for gloo (K and V planes of each block)
        blocks = [pool[c, b] for b in ids for c in range(2)]
        scratch = torch.empty_like(pool)
        flat_src = pool.view(-1)[:2 * nblocks * bs * 8 * 128]
        flat_dst = scratch.view(-1)[:flat_src.numel()]
        t_cam, t_seen, t_gloo, t_copy = [], [], [], []
        for i in range(samples + 1):
            dist.barrier(group=gloo)
            rid = f"r{i}".encode()
            if rank == 0:
                time.sleep(0.0005)  # rank 1 is inside wait_notification (its yield tier)
                t0 = time.perf_counter()
                kv.push(1, ids, ids, tokens, request_id=rid)
                t_cam.append(time.perf_counter() - t0)
                seen = torch.zeros(1, dtype=torch.float64)
                dist.recv(seen, 1, group=gloo)
                t_seen.append(float(seen) - t0)
            else:
                kv.wait_notification(rid, peer=0, timeout_s=120)
                dist.send(torch.tensor([time.perf_counter()], dtype=torch.float64), 0, group=gloo)
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            if rank == 0:
                works = [dist.isend(b.contiguous() if not b.is_contiguous() else b, 1, group=gloo) for b in blocks]
            else:
                works = [dist.irecv(b, 0, group=gloo) for b in blocks]
            for w in works:
                w.wait()
            t_gloo.append(time.perf_counter() - t0)
            if rank == 0:
                t0 = time.perf_counter()
                flat_dst.copy_(flat_src)
                t_copy.append(time.perf_counter() - t0)
        if rank == 0:
            med = lambda xs: statistics.median(xs[1:])  # noqa: E731  (first sample is a warmup)
            total = 2 * nblocks * bs * 8 * 128 * 2
            rows.append((block_bytes, nblocks, total, med(t_cam), med(t_seen), med(t_gloo), med(t_copy)))
        del kv
    latency = back_to_back(rank, gloo, quick)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    if rank == 0:
        out_q.put((rows, latency))


def back_to_back(rank, gloo, quick):
    """Requests issued back to back (warm caches, the peer waiting in wait_notification and
    acknowledging each request with an empty push): push time, the time until the peer saw the
    notification (one clock), and a local memcpy of the same bytes. The last rows move 32 bytes
    per block with scattered ids (2 copies per block, no merging): the request path's own cost."""
    import torch_cam
    from torch_cam.kv import KVTransfer
    from torch_cam.kv_reference import KVLayout
    out = []
    n = 300 if quick else 2000
    g = torch.Generator().manual_seed(0)
    for label, heads, dim, bs, nblocks, pool_blocks in (
            ("1 x 16 KiB", 8, 128, 4, 1, 64), ("1 x 64 KiB", 8, 128, 16, 1, 64), ("16 x 64 KiB", 8, 128, 16, 16, 64),
            ("1 x 1 MiB", 8, 128, 256, 1, 4), ("1 x 32 B", 1, 8, 1, 1, 4096), ("1024 x 32 B", 1, 8, 1, 1024, 4096)):
        lay = KVLayout("mha", 1, pool_blocks, bs, heads, dim, torch.bfloat16, "NHD")
        pool = torch_cam.zeros(*lay.pool_shape(), dtype=torch.bfloat16)
        kv = KVTransfer()
        kv.register([pool], lay)
        ids = torch.randperm(pool_blocks, generator=g)[:nblocks].tolist()
        dist.barrier(group=gloo)
        t_push, t_sent, t_seen = [], [], []
        for i in range(n):
            rid = f"b{i}".encode()
            if rank == 0:
                t0 = time.perf_counter()
                kv.push(1, ids, ids, nblocks * bs, request_id=rid)
                t1 = time.perf_counter()
                t_sent.append(t0)
                t_push.append(t1 - t0)
                kv.wait_notification(b"ack", peer=1)
            else:
                kv.wait_notification(rid, peer=0)
                t_seen.append(time.perf_counter())
                kv.push(0, [], [], 0, request_id=b"ack")
        if rank == 0:
            seen = torch.zeros(n, dtype=torch.float64)
            dist.recv(seen, 1, group=gloo)
            nbytes = 2 * nblocks * bs * heads * dim * 2
            src = pool.view(-1)[: nbytes // 2]
            dst = torch.empty_like(src)
            t_copy = []
            for _ in range(n):
                t0 = time.perf_counter()
                dst.copy_(src)
                t_copy.append(time.perf_counter() - t0)
            med = statistics.median
            out.append((label, nbytes, med(t_push[n // 10:]),
                        med([s - t for s, t in zip(seen.tolist(), t_sent)][n // 10:]), med(t_copy[n // 10:])))
        else:
            dist.send(torch.tensor(t_seen, dtype=torch.float64), 0, group=gloo)
        del kv
    return out


def fmt_bytes(n):
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    fd, init_file = tempfile.mkstemp(prefix="cam_kv_bench_")
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, init_file, args.quick, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rows, latency = q.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    lines = ["| block | blocks | request | cam push | peer saw it | cam GB/s | per block (seen) | push - bound | "
             "gloo GB/s | gloo/cam | memcpy GB/s | cam / memcpy bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for block, n, total, tc, ts, tg, tm in rows:
        lines.append(f"| {fmt_bytes(block)} | {n} | {fmt_bytes(total)} | {tc * 1e6:,.1f} us | {ts * 1e6:,.1f} us | "
                     f"{total / tc / 1e9:.1f} | {ts / n * 1e6:.1f} us | {(tc - tm) * 1e6:,.1f} us | "
                     f"{total / tg / 1e9:.2f} | {tg / tc:.1f}x | {total / tm / 1e9:.1f} | {tm / tc:.2f} |")
    text = ("## KV transfer, 2 ranks (pinned), prefill rank 0 -> decode rank 1, same layout\n\n"
            "Medians; a block = one layer's K+V block; request = all its blocks (both planes).\n\n" + "\n".join(lines))
    lat = ["| request | bytes | cam push | peer saw it | local memcpy of the bytes | push - memcpy |", "|---|---|---|---|---|---|"]
    for label, nbytes, tp, ts, tm in latency:
        lat.append(f"| {label} | {nbytes:,} | {tp * 1e6:.1f} us | {ts * 1e6:.1f} us | {tm * 1e6:.1f} us | "
                   f"{(tp - tm) * 1e6:.1f} us |")
    text += ("\n\n## Back-to-back requests (warm; the peer waits and acknowledges each one)\n\n"
             "Medians. The 32-byte rows are the request path's own cost (checks, plan, 2 copies per block, "
             "notification).\n\n" + "\n".join(lat))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
