"""Wake-up after a long wait: the single-shot cost a training step pays when one rank reaches a
collective well before the others (uneven compute), so the early ranks have left the spin and
yield tiers and sleep.

Every sample: a gloo barrier, then the late rank (the last one) sleeps ``delay`` before it
issues the op while the others issue at once; the sample is the time from the late rank's issue
to the slowest early rank's return (CLOCK_MONOTONIC, one clock for every process of the host).
cam and gloo run on the same ranks in one run; a delay of 0 is the reference where nobody
sleeps. Medians over the samples.

    .venv/bin/python benchmarks/bench_wake.py [--ranks 2 4] [--delays-ms 0 1 10 30] [--samples 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

OPS = ("all_reduce", "broadcast", "barrier")


def worker(rank, world, store_path, cfg, result_path):
    H.setup_worker(rank, cfg["pin"])
    gloo = H.init_groups(rank, world, store_path, 60.0)
    late = world - 1
    x = torch.zeros(256)
    rows = []
    for op in OPS:
        for backend in ("cam", "gloo"):
            group = None if backend == "cam" else gloo
            call = {"all_reduce": lambda: dist.all_reduce(x, group=group),
                    "broadcast": lambda: dist.broadcast(x, src=late, group=group),
                    "barrier": lambda: dist.barrier(group=group)}[op]
            for delay_ms in cfg["delays_ms"]:
                lat = []
                for i in range(cfg["samples"] + 1):
                    dist.barrier(group=gloo)
                    if rank == late:
                        time.sleep(delay_ms / 1e3)
                    t_issue = time.monotonic()
                    call()
                    t_done = time.monotonic()
                    mine = torch.tensor([t_issue if rank == late else -1e30,
                                         t_done if rank != late else -1e30], dtype=torch.float64)
                    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=gloo)
                    if i:  # the first sample warms up
                        lat.append(mine[1].item() - mine[0].item())
                rows.append({"op": op, "backend": backend, "delay_ms": delay_ms,
                             "median_us": statistics.median(lat) * 1e6})
                if rank == 0:
                    H.atomic_json(result_path, {"world": world, "rows": rows})
    H.finish_worker(gloo)


def table(world: int, rows: list[dict], delays) -> str:
    by = {(r["op"], r["backend"], r["delay_ms"]): r["median_us"] for r in rows}
    out = [f"### {world} ranks", "",
           "| op | late by | cam | gloo | gloo/cam |", "|---|---|---|---|---|"]
    for op in OPS:
        for d in delays:
            c, g = by.get((op, "cam", d)), by.get((op, "gloo", d))
            if c is None or g is None:
                continue
            out.append(f"| {op} | {d:g} ms | {c:.0f} µs | {g:.0f} µs | {g / c:.2f}x |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0, 1, 10, 30])
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r % ncores")
    args = ap.parse_args()
    H.prepare_env()
    cfg = {"delays_ms": args.delays_ms, "samples": args.samples, "pin": args.pin}
    for world in args.ranks:
        res = H.run_world(worker, world, cfg, deadline_s=600, prefix="bench_wake")
        print(table(world, res.get("rows", []), args.delays_ms))
        if res.get("error"):
            print(f"\n**error:** {res['error']}")
        print()


if __name__ == "__main__":
    main()
