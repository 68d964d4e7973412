"""all_to_all_single through the windows (two copies, pipelined) vs the single-copy path
(receivers read blocks straight from the sender's tensor with process_vm_readv), interleaved in
one run on two cam groups over the same ranks.

    timeout 300 .venv/bin/torchrun --nproc-per-node 2 benchmarks/bench_single_copy.py

Prints, per per-rank size, the median over 15 samples (each: the slowest rank's time) of both.
"""
import statistics
import time

import torch
import torch.distributed as dist

import torch_cam  # noqa: F401

dist.init_process_group("cam", pg_options={"single_copy_bytes": 0})
rank, world = dist.get_rank(), dist.get_world_size()
groups = {"staged": dist.group.WORLD,
          "single-copy": dist.new_group(pg_options={"single_copy_bytes": 64 << 10})}
gloo = dist.new_group(backend="gloo")
if rank == 0:
    print(f"all_to_all_single, {world} ranks, direct reads available: "
          f"{torch_cam.get_cam_backend(groups['single-copy']).direct_read_available}")
    print("| per-rank size | staged median | single-copy median | staged/single-copy |")
    print("|---|---|---|---|")
for mib in (1, 4, 16, 64):
    n = (mib << 20) // 4
    inp, out = torch.ones(n), torch.empty(n)
    med = {name: [] for name in groups}
    for _ in range(15):
        for name, g in groups.items():  # interleaved: both see the same machine state
            dist.all_to_all_single(out, inp, group=g)
            dist.barrier(group=g)
            t0 = time.perf_counter()
            dist.all_to_all_single(out, inp, group=g)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            med[name].append(t.item())
    s, d = statistics.median(med["staged"]), statistics.median(med["single-copy"])
    if rank == 0:
        print(f"| {mib} MiB | {s * 1e3:.2f} ms | {d * 1e3:.2f} ms | {s / d:.2f}x |", flush=True)
dist.destroy_process_group()
