"""Attention-FFN disaggregation (torch_cam.afd) against the same exchange written with
torch.distributed all_to_all_single, in one run.

    .venv/bin/python benchmarks/bench_afd.py [--quick] [--pin] [--samples N] [--layouts 1:1,2:2,3:1] [--out FILE]

Per layout (attention:FFN ranks) and shape (decode: batch 32 / 128 per attention rank, H 7168 with
256 experts and H 4096 with 64, top-8, bf16; prefill-like: 2048 tokens, H 4096, 64 experts), one
layer's exchange (tokens to the FFN ranks, expert outputs back, combined; the "experts" return
their rows unchanged, so only communication is timed) is timed as the slowest rank's time from a
common start, median over samples of 4 layers each:
- cam afd: ``send`` + ``recv`` on the attention ranks, ``recv_tokens`` + ``send_outputs`` on the
  FFN ranks;
- a2a gloo / a2a cam: the exchange as MoE layers write it today with all_to_all_single on the
  whole group: sort the (token, expert) pairs by expert, exchange counts, rows and expert ids,
  group per expert on the FFN rank, send the outputs back the same way, un-permute and sum the
  weighted rows; over a gloo group and over a cam group;
- memcpy bound: every rank copying, all at once, the bytes it writes in the cam exchange
  (attention: its posted rows and its output; FFN: its grouped rows and one fp32 partial-sum row
  per token it serves); the slowest rank's time. The exchange is a chain (post, pull, sum, sum),
  so it cannot reach this bound within one layer.
Hidden: 16 layers of two micro-batches in a ping-pong with a simulated compute (a sleep: the
host cores stay free, as with compute on an accelerator) as long as one exchange between each
send and its recv; 1 - (time - compute) / (exchange time without overlap). "hidden" posts x with
send (one copy into the channel's slot); "zero-copy" has the compute write x into
``send_buffer()`` (the copy is part of the compute, as an ``out=`` would make it).
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

LAYOUTS = {"1:1": (1, 1), "2:2": (2, 2), "3:1": (3, 1)}
SHAPES = [  # (name, tokens per attention rank, hidden, experts)
    ("decode bs32 H7168 E256", 32, 7168, 256),
    ("decode bs128 H7168 E256", 128, 7168, 256),
    ("decode bs32 H4096 E64", 32, 4096, 64),
    ("decode bs128 H4096 E64", 128, 4096, 64),
    ("prefill 2048 H4096 E64", 2048, 4096, 64),
]
TOPK, LAYERS, OVERLAP_LAYERS = 8, 4, 16
DTYPE = torch.bfloat16


def routing(a, bs, E, layer):
    g = torch.Generator().manual_seed(1000 * a + layer)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(bs)]).to(torch.int32)
    w = torch.rand(bs, TOPK, generator=g)
    return ids, w / w.sum(1, keepdim=True)


def a2a_exchange(group, rank, attn, ffn, x, ids, w, per_rank, H):
    """One layer's exchange over all_to_all_single on `group` (all ranks of the world)."""
    world = dist.get_world_size(group)
    send_counts = torch.zeros(world, dtype=torch.int64)
    if rank in attn:
        flat = ids.view(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        rows = x.index_select(0, order // TOPK)
        sorted_e = flat[order].to(torch.int32)
        dest = torch.tensor(ffn)[sorted_e.to(torch.int64) // per_rank]
        send_counts.index_add_(0, dest, torch.ones_like(dest))
    else:
        rows = torch.empty(0, H, dtype=DTYPE)
        sorted_e = torch.empty(0, dtype=torch.int32)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    got = torch.empty(sum(rc), rows.shape[1], dtype=DTYPE)
    dist.all_to_all_single(got, rows, rc, sc, group=group)
    got_e = torch.empty(sum(rc), dtype=torch.int32)
    dist.all_to_all_single(got_e, sorted_e, rc, sc, group=group)
    if rank in ffn:   # group per expert, "compute", and back to arrival order
        g_order = torch.argsort(got_e, stable=True)
        grouped = got.index_select(0, g_order)
        back = torch.empty_like(got)
        back.index_copy_(0, g_order, grouped)
    else:
        back = got
    ret = torch.empty(sum(sc), rows.shape[1], dtype=DTYPE)
    dist.all_to_all_single(ret, back, sc, rc, group=group)
    if rank in attn:
        y = torch.empty(ids.numel(), ret.shape[1], dtype=DTYPE)
        y.index_copy_(0, order, ret)
        return (y.view(-1, TOPK, ret.shape[1]).float() * w.unsqueeze(2)).sum(1).to(DTYPE)
    return None


def worker(rank, world, store_path, cfg, result_path):
    _harness.setup_worker(rank, cfg["pin"])
    from torch_cam.afd import AfdChannel
    gloo = _harness.init_groups(rank, world, store_path, 600, {"tensor_heap_bytes": 4 << 30})
    M, N = LAYOUTS[cfg["layout"]]
    attn, ffn = list(range(M)), list(range(M, M + N))
    cam_world = dist.group.WORLD
    rows_out = []
    for name, bs, H, E in cfg["shapes"]:
        per_rank = E // N
        ch = AfdChannel(attention_ranks=attn, ffn_ranks=ffn, experts_per_rank=per_rank, hidden=H, topk=TOPK,
                        max_tokens=bs, dtype=DTYPE, micro_batches=2)
        a = rank if rank in attn else None
        g = torch.Generator().manual_seed(rank)
        x = (torch.randn(bs, H, generator=g)).to(DTYPE) if a is not None else None
        routes = [routing(rank, bs, E, l) for l in range(LAYERS)] if a is not None else None

        def cam_layers():
            for l in range(LAYERS):
                if a is not None:
                    ch.recv(ch.send(x, routes[l][0], routes[l][1], layer=l))
                else:
                    tok = ch.recv_tokens(layer=l)
                    ch.send_outputs(tok.rows, tok)

        t_cam = _harness.timed_slowest(cam_layers, gloo, cfg["samples"]) / LAYERS
        # Correctness of the timed exchange: identity experts give sum_k w_k * x.
        # Bytes each rank writes in the exchange: attention its posted rows and its output; FFN
        # the grouped rows and one fp32 partial row per (token, this rank) it serves.
        if a is not None:
            got = ch.recv(ch.send(x, routes[0][0], routes[0][1], layer=0))
            ok = torch.allclose(got.float(), x.float(), atol=2e-2, rtol=2e-2)
            copy_bytes = 2 * bs * H * 2
        else:
            tok = ch.recv_tokens(layer=0)
            ch.send_outputs(tok.rows, tok)
            ok = True
            pairs = torch.unique(tok.source[:, 0].long() * bs + tok.source[:, 1].long()).numel()
            copy_bytes = tok.rows.numel() * tok.rows.element_size() + pairs * H * 4
        ok = _harness.all_ok(ok, gloo)

        def a2a_layers(group):
            def run():
                for l in range(LAYERS):
                    a2a_exchange(group, rank, attn, ffn, x, routes[l][0] if a is not None else None,
                                 routes[l][1] if a is not None else None, per_rank, H)
            return run

        t_gloo = _harness.timed_slowest(a2a_layers(gloo), gloo, max(1, cfg["samples"] // 2)) / LAYERS
        t_a2a_cam = _harness.timed_slowest(a2a_layers(cam_world), gloo, cfg["samples"]) / LAYERS
        src = torch.ones(max(copy_bytes, 1), dtype=torch.uint8)
        dst = torch.empty_like(src)
        bound = _harness.timed_slowest(lambda: dst.copy_(src), gloo, cfg["samples"])
        del src, dst
        # Two micro-batches, ping-pong, a compute of one exchange's length between send and recv.
        compute = t_cam
        sleep_cost = [0.0]

        def overlapped(zero_copy):
            def run():
                if a is None:
                    for l in range(OVERLAP_LAYERS):
                        for m in range(2):
                            tok = ch.recv_tokens(layer=l, micro_batch=m)
                            ch.send_outputs(tok.rows, tok)
                    return
                pending = [None, None]
                slept = 0.0
                for l in range(OVERLAP_LAYERS):
                    ids, w = routes[l % LAYERS]
                    for m in range(2):
                        if l > 0:
                            ch.recv(pending[m])
                        c = time.perf_counter()
                        time.sleep(compute)
                        xs = ch.send_buffer()[:bs].copy_(x) if zero_copy else x
                        slept += time.perf_counter() - c
                        pending[m] = ch.send(xs, ids, w, layer=l, micro_batch=m)
                for m in range(2):
                    ch.recv(pending[m])
                sleep_cost[0] = slept
            return run

        exchange_total = t_cam * OVERLAP_LAYERS * 2
        hidden = []
        for zero_copy in (False, True):
            t_over = _harness.timed_slowest(overlapped(zero_copy), gloo, cfg["samples"])
            slept = _harness.allreduce_max(sleep_cost[0], gloo)
            hidden.append(max(0.0, min(1.0, 1.0 - (t_over - slept) / exchange_total)))
        rows_out.append({"layout": cfg["layout"], "shape": name, "cam": t_cam, "gloo": t_gloo, "a2a_cam": t_a2a_cam,
                         "bound": bound, "hidden": hidden[0], "hidden_zero_copy": hidden[1], "ok": ok})
        if rank == 0:
            _harness.atomic_json(result_path, {"world": world, "rows": rows_out, "complete": False})
        ch.close()
        del ch
    if rank == 0:
        _harness.atomic_json(result_path, {"world": world, "rows": rows_out, "complete": True})
    _harness.finish_worker(gloo)


def fmt(s):
    return f"{s * 1e6:.0f} us" if s < 1e-2 else f"{s * 1e3:.1f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="decode shapes at H 4096 only")
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r %% cores")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", help="also append the table to this file")
    args = ap.parse_args()
    _harness.prepare_env()
    shapes = [s for s in SHAPES if not args.quick or (s[2] == 4096 and s[1] <= 128)]
    lines = [f"# bench_afd, {datetime.date.today()}", _harness.machine_line(4, args.quick, args.pin), "",
             "| layout | shape | cam afd | a2a gloo | gloo/cam | a2a cam | a2a cam/cam | memcpy bound | bound/cam | "
             "hidden | hidden, zero-copy | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for layout in args.layouts.split(","):
        M, N = LAYOUTS[layout]
        cfg = {"layout": layout, "shapes": shapes, "samples": args.samples, "pin": args.pin}
        res = _harness.run_world(worker, M + N, cfg, 3600, "bench_afd")
        if res.get("error"):
            print(f"{layout}: {res['error']}", flush=True)
        for r in res["rows"]:
            line = (f"| {r['layout']} | {r['shape']} | {fmt(r['cam'])} | {fmt(r['gloo'])} | {r['gloo'] / r['cam']:.1f}x | "
                    f"{fmt(r['a2a_cam'])} | {r['a2a_cam'] / r['cam']:.2f}x | {fmt(r['bound'])} | "
                    f"{r['bound'] / r['cam']:.2f} | {100 * r['hidden']:.0f}% | {100 * r['hidden_zero_copy']:.0f}% | "
                    f"{'yes' if r['ok'] else 'NO'} |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
