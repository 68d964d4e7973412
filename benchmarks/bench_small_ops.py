#!/usr/bin/env python3
"""Small ops under torchrun: cam groups with different options side by side, beside gloo.

    torchrun --nproc-per-node 8 benchmarks/bench_small_ops.py \
        [--configs "default=;stretch10ms=progress_interval_us:10000"] [--samples 100] [--rounds 3]

Each config is a cam group created with those options (``name=key:value,key:value``; an empty
list is the defaults); a gloo group on the same ranks is measured the same way. For every group
and op (barrier, and all_reduce / broadcast / all_gather_into_tensor of 1 KiB per rank):

* single-shot: a barrier of the same group, then one timed op; the sample is the max over ranks;
* batched: ``--samples`` back-to-back ops after one barrier, time per op, max over ranks.

The groups take turns round by round (``--rounds``), so that a slow spell of the machine falls on
all of them; the table gives the median over rounds of each round's median. Ranks are pinned to
core rank % ncores, as bench_collectives.py --pin does. To compare two builds, run the script
alternately with each build first on PYTHONPATH (their rows are then from separate launches).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

import torch_cam  # noqa: F401  (registers the backend)


def parse_configs(text: str) -> list[tuple[str, dict]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, kv = item.partition("=")
        opts = {}
        for pair in filter(None, kv.split(",")):
            key, _, value = pair.partition(":")
            opts[key.strip()] = int(value)
        out.append((name.strip(), opts))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="default=", help="cam option sets: name=key:value,...;name=...")
    ap.add_argument("--samples", type=int, default=100, help="single-shot samples and batch length per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-gloo", action="store_true", help="leave gloo out")
    args = ap.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("cam", timeout=datetime.timedelta(seconds=300))
    reducer = dist.new_group(backend="gloo")  # gathers the samples, outside the timed region
    groups = [(name, dist.new_group(backend="cam", pg_options=opts)) for name, opts in parse_configs(args.configs)]
    if not args.no_gloo:
        groups.append(("gloo", dist.new_group(backend="gloo")))

    x = torch.ones(256)
    out = torch.empty(256 * world)
    ops = {
        "barrier": lambda g: dist.barrier(group=g),
        "all_reduce": lambda g: dist.all_reduce(x, group=g),
        "broadcast": lambda g: dist.broadcast(x, 0, group=g),
        "all_gather": lambda g: dist.all_gather_into_tensor(out, x, group=g),
    }
    n = args.samples
    res = {(g, o, k): [] for g, _ in groups for o in ops for k in ("single", "batched")}
    for _ in range(args.rounds):
        for gname, g in groups:
            for oname, fn in ops.items():
                for _ in range(5):
                    dist.barrier(group=g)
                    fn(g)
                ts = []
                for _ in range(n):
                    dist.barrier(group=g)
                    t0 = time.perf_counter()
                    fn(g)
                    ts.append(time.perf_counter() - t0)
                t = torch.tensor(ts, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=reducer)
                res[(gname, oname, "single")].append(statistics.median(t.tolist()))
                dist.barrier(group=g)
                t0 = time.perf_counter()
                for _ in range(n):
                    fn(g)
                t = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=reducer)
                res[(gname, oname, "batched")].append(t.item())
    if rank == 0:
        print(f"{world} ranks on {os.cpu_count()} cores, torch_cam from {os.path.dirname(torch_cam.__file__)}; "
              f"single-shot / batched, us (median over {args.rounds} rounds of {n} samples)\n")
        print("| group | " + " | ".join(ops) + " |")
        print("|---|" + "---|" * len(ops))
        for gname, _ in groups:
            cells = [f"{statistics.median(res[(gname, o, 'single')]) * 1e6:.0f} / "
                     f"{statistics.median(res[(gname, o, 'batched')]) * 1e6:.0f}" for o in ops]
            print(f"| {gname} | " + " | ".join(cells) + " |", flush=True)
    dist.barrier(group=reducer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
