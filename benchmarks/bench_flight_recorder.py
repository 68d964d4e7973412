"""What the flight recorder costs per op: cam with the recorder on (flight_recorder_entries 2000,
the default) and off (0), alternated in one run, on the two ops where a per-op cost shows most:
all_reduce of 1 KiB and the 8-byte send/recv round trip (rank 0 <-> rank 1).

Usage::

    timeout 900 .venv/bin/python benchmarks/bench_flight_recorder.py [--rounds 3] [--pin]

Each round starts a fresh 2-rank world per setting (off, then on). A world times batches of
``--batch`` ops, ``--samples`` times; the slowest rank's time per op is kept. Printed: per
setting the median over every sample of every round, and the on/off ratio (> 1: the recorder
costs time), with the spread of the per-round medians, which is the run-to-run noise the ratio
has to be read against.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def worker(rank, world, store_path, cfg, result_path):
    H.setup_worker(rank, cfg["pin"])
    gloo = H.init_groups(rank, world, store_path, 120, pg_options={"flight_recorder_entries": cfg["entries"]})
    x, buf = torch.ones(256), torch.zeros(2)

    def all_reduce():
        dist.all_reduce(x)

    def roundtrip():
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    rows = {}
    for name, fn in (("all_reduce 1 KiB", all_reduce), ("roundtrip 8 B", roundtrip)):
        for _ in range(cfg["batch"] // 10):  # warm-up
            fn()
        samples = []
        for _ in range(cfg["samples"]):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(cfg["batch"]):
                fn()
            samples.append((time.perf_counter() - t) / cfg["batch"] * 1e6)
        rows[name] = H.max_over_ranks(samples, gloo)
    if rank == 0:
        H.atomic_json(result_path, {"world": world, "rows": rows, "complete": True})
    H.finish_worker(gloo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    H.prepare_env()
    per = {0: {}, 2000: {}}  # entries -> op -> [per-round lists of samples]
    for _ in range(args.rounds):
        for entries in (0, 2000):
            cfg = {"entries": entries, "pin": args.pin, "samples": args.samples, "batch": args.batch}
            res = H.run_world(worker, 2, cfg, args.timeout, "cam_bench_fr")
            if res.get("error"):
                print(f"entries {entries}: {res['error']}", file=sys.stderr)
                return 1
            for op, samples in res["rows"].items():
                per[entries].setdefault(op, []).append(samples)
    print(f"# flight recorder cost per op, 2 ranks — {H.machine_line(2, False, args.pin)}")
    print(f"{args.rounds} rounds x {args.samples} samples x {args.batch} ops; slowest rank; µs per op\n")
    print("| op | recorder off | recorder on | on/off | per-round medians off | per-round medians on |")
    print("|---|---|---|---|---|---|")
    for op in per[0]:
        off = statistics.median(s for r in per[0][op] for s in r)
        on = statistics.median(s for r in per[2000][op] for s in r)
        rounds = {e: ", ".join(f"{statistics.median(r):.1f}" for r in per[e][op]) for e in per}
        print(f"| {op} | {off:.2f} | {on:.2f} | {on / off:.3f} | {rounds[0]} | {rounds[2000]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
