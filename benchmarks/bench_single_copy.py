"""Ordinary tensors three ways, interleaved in one run on the same ranks: staged through the
windows (two copies, pipelined), read by the receivers straight out of the sender's address
space (``single_copy_bytes``: process_vm_readv, all_to_all only), and born in the process heap
(``torch_cam.use_heap_allocator``: peers read them in place, one copy), beside every rank
copying as many bytes as its output receives, all at once (``copy_``: the single-copy bound;
for all_reduce, whose two-shot reads and writes more, a reference rather than a bound).

    timeout 900 .venv/bin/torchrun --nproc-per-node 2 benchmarks/bench_single_copy.py [--sizes 1 4 16 64]

Each sample is single-shot, as a training step issues ops: a barrier of the measured group,
then one op, timed on every rank; the sample is the slowest rank's time (max through gloo).
Prints the median of ``--samples`` samples per (op, per-rank size) and the ratios.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torch_cam

ap = argparse.ArgumentParser()
ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="per-rank MiB")
ap.add_argument("--samples", type=int, default=15)
ap.add_argument("--ops", nargs="+", default=["all_to_all_single", "broadcast", "all_gather_into_tensor",
                                             "all_reduce", "reduce_scatter_tensor", "send_recv"])
args = ap.parse_args()
torch.set_num_threads(1)

dist.init_process_group("cam", pg_options={"single_copy_bytes": 0})
rank, world = dist.get_rank(), dist.get_world_size()
direct = dist.new_group(pg_options={"single_copy_bytes": 64 << 10})
gloo = dist.new_group(backend="gloo")
world_group = dist.group.WORLD


def tensors(op, n):
    """(input, output) for op with n float32 elements per rank."""
    inp = torch.ones(n)
    if op in ("all_to_all_single", "reduce_scatter_tensor"):
        return inp, torch.empty(n if op == "all_to_all_single" else n // world)
    if op == "all_gather_into_tensor":
        return inp, torch.empty(world * n)
    return inp, None


def run(op, g, inp, out):
    if op == "all_to_all_single":
        dist.all_to_all_single(out, inp, group=g)
    elif op == "broadcast":
        dist.broadcast(inp, 0, group=g)
    elif op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(out, inp, group=g)
    elif op == "all_reduce":
        dist.all_reduce(inp, group=g)
    elif op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(out, inp, group=g)
    elif op == "send_recv":  # pairs (0, 1), (2, 3), ...: the even rank sends to the odd one
        if rank % 2 == 0 and rank + 1 < world:
            dist.send(inp, rank + 1, group=g)
        elif rank % 2 == 1:
            dist.recv(inp, rank - 1, group=g)
    elif op == "copy_":
        out.copy_(inp)


def slowest(seconds):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return t.item()


if rank == 0:
    print(f"{world} ranks; direct reads available: {torch_cam.get_cam_backend(direct).direct_read_available}")
    print("| op | per-rank size | staged | direct read | heap allocator | copy_ bound | staged/heap | "
          "bound/heap |")
    print("|---|---|---|---|---|---|---|---|")
for op in args.ops:
    for mib in args.sizes:
        n = (mib << 20) // 4
        torch_cam.use_heap_allocator(None)
        ordinary = tensors(op, n)
        k = world * n if op == "all_gather_into_tensor" else n  # bytes each rank's output receives
        bound = (torch.ones(k), torch.empty(k))
        torch_cam.use_heap_allocator(1 << 16)
        heap = tensors(op, n)
        torch_cam.use_heap_allocator(None)
        cells = {"staged": (world_group, ordinary, op), "heap": (world_group, heap, op),
                 "bound": (world_group, bound, "copy_")}
        if op == "all_to_all_single":
            cells["direct"] = (direct, ordinary, op)
        times = {name: [] for name in cells}
        for _ in range(args.samples + 1):
            for name, (g, (inp, out), what) in cells.items():  # interleaved: same machine state
                dist.barrier(group=g)
                t0 = time.perf_counter()
                run(what, g, inp, out)
                times[name].append(slowest(time.perf_counter() - t0))
        med = {name: statistics.median(v[1:]) for name, v in times.items()}  # the first is warmup
        if rank == 0:
            ms = lambda name: f"{med[name] * 1e3:.2f} ms" if name in med else "–"
            print(f"| {op} | {mib} MiB | {ms('staged')} | {ms('direct')} | {ms('heap')} | {ms('bound')} | "
                  f"{med['staged'] / med['heap']:.2f}x | {med['bound'] / med['heap']:.2f} |", flush=True)
        del ordinary, heap, bound
dist.destroy_process_group()
