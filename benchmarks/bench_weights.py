"""RL weight transfer (torch_cam.weights.WeightChannel) against what frameworks do today, in one run.

    .venv/bin/python benchmarks/bench_weights.py [--full] [--pin] [--samples N] [--out FILE]

For each layout (1 trainer -> 1 rollout; 2 trainers (TP 2, split on dim 0) -> 1 replica of 2 ranks
(TP 2, split on dim 1: every rollout rank takes a part from both trainers); 1 trainer -> 3
replicas) and model (256 MiB and 1 GiB of fp32, 4 GiB with --full; as 8 large tensors or as 2048
tensors of 64 KiB - 4 MiB), one update of the whole model is timed (medians over samples; each
sample is the slowest rank's time from a common start):
- cam: ``publish`` on the trainers / ``update`` on the rollouts;
- gloo / cam-bcast: torch.distributed per tensor, as RL frameworks do with NCCL: the trainers
  all-gather a sharded tensor, trainer 0 broadcasts the whole tensor to the rollouts, each rollout
  copies its shard into its tensor (1 -> n: trainer 0 broadcasts straight into the rollouts'
  tensors), over a gloo group and over a cam group;
- memcpy bound: every rollout copying the bytes it receives within its own memory (256 MiB
  copies), all at once, with the threads the channel copies with.
GB/s = bytes each rollout receives / time. "per tensor" (small rows) = what each extra tensor
costs: (cam small - cam large) / (2048 - 8) for the same bytes.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
LAYOUTS = {  # name: (trainers, replicas, trainer shard dim or None, rollout shard dim or None)
    "1->1": ([0], [[1]], None, None),
    "2->2 TP reshard": ([0, 1], [[2, 3]], 0, 1),
    "1->3 replicas": ([0], [[1], [2], [3]], None, None),
}
COLS = 1024  # fp32 columns of every tensor: a 4 KiB row


def model_shapes(total: int, kind: str) -> list[tuple[int, int]]:
    """Shapes (rows, COLS) of fp32 tensors adding up to about ``total`` bytes."""
    if kind == "large":
        return [(total // 8 // (4 * COLS), COLS)] * 8
    mean = total // 2048
    sizes = [max(64 * 1024, min(4 * MiB, s)) for s in (mean // 2, mean, mean * 3 // 2)]
    return [(sizes[i % 3] // (4 * COLS), COLS) for i in range(2048)]


def worker(rank, world, store_path, cfg, result_path):
    _harness.setup_worker(rank, cfg["pin"])
    from torch_cam.weights import Shard, WeightChannel
    gloo = _harness.init_groups(rank, world, store_path, 600, {"tensor_heap_bytes": 8 * GiB})
    trainers, replicas, tdim, rdim = LAYOUTS[cfg["layout"]]
    rollouts = [r for rep in replicas for r in rep]
    root_and_rollouts = [trainers[0]] + rollouts
    bc_gloo = dist.new_group(root_and_rollouts, backend="gloo")
    bc_cam = dist.new_group(root_and_rollouts)
    tr_gloo = dist.new_group(trainers, backend="gloo")
    tr_cam = dist.new_group(trainers)
    is_trainer = rank in trainers
    rows = []
    for total in cfg["sizes"]:
        for kind in ("large", "small"):
            shapes = model_shapes(total, kind)
            mine = []  # (full shape, this rank's tensor)
            for i, shp in enumerate(shapes):
                if is_trainer:
                    t = torch.full(shp, float(i % 7), dtype=torch.float32)
                    if tdim is not None:
                        t = t.chunk(len(trainers), tdim)[trainers.index(rank)].clone()
                else:
                    t = torch.zeros(shp, dtype=torch.float32)
                    if rdim is not None:
                        rep = next(rep for rep in replicas if rank in rep)
                        t = t.chunk(len(rep), rdim)[rep.index(rank)].clone()
                mine.append((shp, t))
            recv_bytes = sum(t.nbytes for _, t in mine) if not is_trainer else 0
            recv_bytes = int(_harness.allreduce_max(float(recv_bytes), gloo))

            ch = WeightChannel(trainers=trainers, replicas=replicas)
            for i, (shp, t) in enumerate(mine):
                if is_trainer:
                    spec = None if tdim is None else Shard(tdim, trainers.index(rank), len(trainers))
                else:
                    rep = next(rep for rep in replicas if rank in rep)
                    spec = None if rdim is None else Shard(rdim, rep.index(rank), len(rep))
                ch.register(f"p{i}", t, spec, shape=shp)
            version = [0]

            def cam_update():
                version[0] += 1
                (ch.publish if is_trainer else ch.update)(version[0])

            t_cam = _harness.timed_slowest(cam_update, gloo, cfg["samples"])
            ok = all(torch.all(t == float(i % 7)).item() for i, (_, t) in enumerate(mine)) if not is_trainer else True
            ok = _harness.all_ok(ok, gloo)

            def bcast(bc, tr):
                def run():
                    for shp, t in mine:
                        if rank not in root_and_rollouts and not is_trainer:
                            continue
                        if tdim is None and rdim is None:
                            if rank in root_and_rollouts:
                                dist.broadcast(t, src=trainers[0], group=bc)
                            continue
                        full = torch.empty(shp, dtype=torch.float32) if rank in root_and_rollouts else None
                        if is_trainer:
                            parts = [torch.empty_like(t) for _ in trainers]
                            dist.all_gather(parts, t, group=tr)
                            if full is not None:
                                torch.cat(parts, dim=tdim, out=full)
                        if rank in root_and_rollouts:
                            dist.broadcast(full, src=trainers[0], group=bc)
                        if not is_trainer:
                            rep = next(rep for rep in replicas if rank in rep)
                            t.copy_(full.chunk(len(rep), rdim)[rep.index(rank)])
                return run

            t_gloo = _harness.timed_slowest(bcast(bc_gloo, tr_gloo), gloo, max(1, cfg["samples"] // 2))
            t_cbc = _harness.timed_slowest(bcast(bc_cam, tr_cam), gloo, cfg["samples"])
            # The bound: every rollout copying the bytes it receives within its own memory, all
            # at once (they share the cores and memory bandwidth as in the update), with the
            # threads the channel copies with (torch's intra-op threads here).
            # (A buffer of at most 256 MiB, copied as often as it takes: far beyond the caches,
            # so it streams as one large copy would, without doubling the model in memory.)
            piece = min(recv_bytes, 256 * MiB)
            src = torch.ones(piece // 4, dtype=torch.float32) if not is_trainer else None
            dst = torch.empty_like(src) if src is not None else None

            def local_copy():
                if src is not None:
                    torch.set_num_threads(ch.copy_threads)
                    for _ in range(recv_bytes // piece):
                        dst.copy_(src)
                    torch.set_num_threads(1)

            bound = _harness.timed_slowest(local_copy, gloo, cfg["samples"])
            del src, dst
            rows.append({"layout": cfg["layout"], "total": total, "kind": kind, "tensors": len(shapes),
                         "recv_bytes": recv_bytes, "cam": t_cam, "gloo": t_gloo, "cam_bcast": t_cbc,
                         "bound": bound, "ok": ok, "threads": ch.copy_threads})
            if rank == 0:
                _harness.atomic_json(result_path, {"world": world, "rows": rows, "complete": False})
            for i in range(len(mine)):
                ch.unregister(f"p{i}")
            del ch, mine
    if rank == 0:
        _harness.atomic_json(result_path, {"world": world, "rows": rows, "complete": True})
    _harness.finish_worker(gloo)


def fmt_s(s):
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="add the 4 GiB model (needs ~20 GiB of memory)")
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r %% cores")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    ap.add_argument("--out", help="also append the table to this file")
    args = ap.parse_args()
    _harness.prepare_env()
    sizes = [256 * MiB, GiB] + ([4 * GiB] if args.full else [])
    lines = [f"# bench_weights, {datetime.date.today()}",
             _harness.machine_line(4, not args.full, args.pin), "",
             "| layout | model | tensors | copy threads | cam | GB/s | bound | bound/cam | gloo | gloo/cam | "
             "cam bcast | bcast/cam | per tensor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    single = {}
    for layout in args.layouts.split(","):
        trainers, replicas, _, _ = LAYOUTS[layout]
        world = len(trainers) + sum(len(r) for r in replicas)
        cfg = {"layout": layout, "sizes": sizes, "samples": args.samples, "pin": args.pin}
        res = _harness.run_world(worker, world, cfg, 3600, "bench_weights")
        if res.get("error"):
            print(f"{layout}: {res['error']}", flush=True)
        large = {r["total"]: r for r in res["rows"] if r["kind"] == "large"}
        for r in res["rows"]:
            base = large.get(r["total"]) if r["kind"] == "small" else None
            per = (f"{(r['cam'] - base['cam']) / (r['tensors'] - base['tensors']) * 1e6:.1f} us"
                   if base else "")
            line = (f"| {layout} | {r['total'] // MiB} MiB {r['kind']} | {r['tensors']} | {r['threads']} | {fmt_s(r['cam'])} | "
                    f"{r['recv_bytes'] / r['cam'] / 1e9:.2f} | {fmt_s(r['bound'])} | {r['bound'] / r['cam']:.2f} | "
                    f"{fmt_s(r['gloo'])} | {r['gloo'] / r['cam']:.1f}x | {fmt_s(r['cam_bcast'])} | "
                    f"{r['cam_bcast'] / r['cam']:.1f}x | {per} |{'' if r['ok'] else ' WRONG VALUES'}")
            print(line, flush=True)
            lines.append(line)
            single.setdefault((r["total"], r["kind"]), {})[layout] = r["cam"]
    extra = []
    for (total, kind), by in single.items():
        if "1->1" in by and "1->3 replicas" in by:
            extra.append(f"- {total // MiB} MiB {kind}: 3 replicas take {by['1->3 replicas'] / by['1->1']:.2f}x "
                         f"the time of one")
    if extra:
        print("\n".join([""] + extra))
        lines += [""] + extra
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
