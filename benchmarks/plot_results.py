"""Draws bench_collectives.py results (its --json output) as plots: per op, time and bandwidth
against per-rank size, one line per library, one column per world size.

    .venv/bin/pip install matplotlib
    .venv/bin/python benchmarks/bench_collectives.py --ranks 2 4 8 --mpi --pin --json results.json
    .venv/bin/python benchmarks/plot_results.py results.json --out-dir benchmarks/plots

Bandwidth is per-rank bytes (the size column of the tables) over the median time. ``cam (heap)``
is cam with heap-resident inputs, the path ordinary tensors from 1 MiB take by default (the heap
allocator mode).
"""
import argparse
import json
import os
import sys

OPS = ["broadcast", "all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]
LINES = [("cam", "cam", "C0", "-"), ("cam-heap", "cam (heap)", "C0", "--"), ("mpi", "Open MPI", "C1", "-"),
         ("gloo", "gloo", "C2", "-"), ("ds-shm", "DeepSpeed shm", "C3", "-"), ("ccl", "oneCCL", "C4", "-")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--out-dir", default="benchmarks/plots")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_results.py needs matplotlib: .venv/bin/pip install matplotlib")
    with open(args.json) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if r.get("median_us")]
    worlds = sorted({r["world"] for r in rows})
    os.makedirs(args.out_dir, exist_ok=True)
    for op in OPS:
        fig, axes = plt.subplots(2, len(worlds), figsize=(4.2 * len(worlds), 7), squeeze=False)
        for col, world in enumerate(worlds):
            t_ax, bw_ax = axes[0][col], axes[1][col]
            for backend, label, color, style in LINES:
                pts = sorted((r["size"], r["median_us"]) for r in rows
                             if r["op"] == op and r["world"] == world and r["backend"] == backend)
                if not pts:
                    continue
                sizes = [s for s, _ in pts]
                t_ax.plot(sizes, [us for _, us in pts], style, color=color, marker="o", ms=3, label=label)
                bw_ax.plot(sizes, [s / (us * 1e-6) / 1e9 for s, us in pts], style, color=color, marker="o",
                           ms=3, label=label)
            t_ax.set_title(f"{op}, {world} ranks")
            for ax in (t_ax, bw_ax):
                ax.set_xscale("log", base=2)
                ax.grid(True, which="both", alpha=0.3)
            t_ax.set_yscale("log")
            t_ax.set_ylabel("median time per op (µs)")
            bw_ax.set_ylabel("per-rank GB/s")
            bw_ax.set_xlabel("per-rank bytes")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(data.get("machine", {}).get(str(worlds[0]), ""), fontsize=8)
        fig.tight_layout()
        path = os.path.join(args.out_dir, f"{op}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
