"""KV-cache transfer on cam (torch_cam.kv.KVTransfer.push) against gloo send/recv of the same
blocks and the memcpy bound, on 2 ranks in one run.

    .venv/bin/python benchmarks/bench_kv.py [--quick] [--out FILE]

A "block" here is one paged-KV block of one layer (K and V, 8 heads x 128 bf16 per token, so a
block of B bytes holds B / 4 KiB tokens). For each block size and blocks-per-request count, rank
0 moves one request's blocks into rank 1:
- cam: ``push`` from rank 0's heap pool into rank 1's (same layout), including the notification,
  timed until rank 1 has seen it (round trip closed by a gloo barrier outside the timing? no:
  rank 0 times push(); the notification is posted inside it);
- gloo: ``isend`` of every block (rank 1 ``irecv`` into its pool blocks), waited;
- memcpy: rank 0 copying the same bytes block by block within its own memory (the bound).
Medians of samples; GB/s = request bytes / time; "per block" = time / blocks.
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
        t_cam, t_gloo, t_copy = [], [], []
        for i in range(samples + 1):
            dist.barrier(group=gloo)
            if rank == 0:
                t0 = time.perf_counter()
                kv.push(1, ids, ids, tokens, request_id=b"r")
                t_cam.append(time.perf_counter() - t0)
            else:
                kv.wait_notification(b"r", peer=0, timeout_s=120)
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
                for b in ids:
                    scratch[:, b].copy_(pool[:, b])
                t_copy.append(time.perf_counter() - t0)
        if rank == 0:
            med = lambda xs: statistics.median(xs[1:])  # noqa: E731  (first sample is a warmup)
            total = 2 * nblocks * bs * 8 * 128 * 2
            rows.append((block_bytes, nblocks, total, med(t_cam), med(t_gloo), med(t_copy)))
        del kv
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    if rank == 0:
        out_q.put(rows)


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
        rows = q.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    lines = ["| block | blocks | request | cam push | cam GB/s | cam per block | gloo GB/s | gloo/cam | memcpy GB/s | cam / memcpy bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for block, n, total, tc, tg, tm in rows:
        lines.append(f"| {fmt_bytes(block)} | {n} | {fmt_bytes(total)} | {tc * 1e6:,.0f} us | {total / tc / 1e9:.1f} | "
                     f"{tc / n * 1e6:.1f} us | {total / tg / 1e9:.2f} | {tg / tc:.1f}x | {total / tm / 1e9:.1f} | "
                     f"{tm / tc:.2f} |")
    text = ("## KV transfer, 2 ranks (pinned), prefill rank 0 -> decode rank 1, same layout\n\n"
            "Medians; a block = one layer's K+V block; request = all its blocks (both planes).\n\n" + "\n".join(lines))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
