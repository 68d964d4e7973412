"""cam across simulated hosts against gloo on the same ranks and against the raw link.

    python benchmarks/bench_multihost.py [--rates none,1gbit] [--sizes 1K,64K,1M,16M] [--samples 5]

Runs itself on 2 hosts x 2 ranks made by the team's multihost.sh (namespaces with their own
network, /dev/shm and boot id; needs root), once per link shaping (tc tbf; "none" = unshaped
veth). In one job per shaping it times, for each op and size, cam (cam inside a host, UCX
between hosts where the build has it), cam with the gloo fallback between hosts, and flat gloo
over the same 4 ranks, and between two hosts
a plain TCP stream (throughput) and a 1-byte ping-pong (round trip). Times are medians over
samples of the slowest rank, each sample from a barrier. all_to_all_single is also timed on a
cam group with the option all_to_all_hops=two_hops. "link" is the op's inter-host bytes
per direction (the least any algorithm must move: all_reduce 2(H-1)/H x S, all_gather
(H-1) x L x S, reduce_scatter (H-1)/H x S, all_to_all L x S x (W-L)/W for S bytes per rank)
over its time, beside the raw stream's. Small all_reduce is also timed on a cam group of one
host's ranks, for the latency target (round trip x 2 + the single-host time), and both again
from the last rank's entry into the op (the simulated hosts share one clock), which leaves out
the gloo barrier's exit skew. KV transfer:
rank 0 (host 0) pushes a request of that many bytes (64 KiB blocks, one layer, the same layout
on both sides) into rank 2 (host 1) until rank 2 has its notification, and rank 2 pulls one
from rank 0; beside cam's send/recv and gloo's of the same bytes between the same ranks.
MoE: one dispatch + combine of that many bytes of bf16 token rows per rank (rows of 1 KiB,
top-4 (--moe-topk) of 16 experts, 4 per rank, identity experts) by
torch_cam.moe_distribute_dispatch / combine, against the usual all-to-all token dispatcher of
bench_moe.py over flat gloo and over cam's all_to_all_single; the outputs are checked against
each other before timing. The combine is also timed alone, as chosen and with every row sent
straight to its owner (at top-8 a token has ~4 rows on the other host, which two hops send as
one partial sum).
Weights: a model of that many bytes (8 fp32 tensors) trained TP 2 on host 0's ranks, taken whole
by a replica on each rank of host 1 (WeightChannel publish / update: every byte crosses the link
once per replica), against gloo broadcasts of each trainer shard from its owner to every rank.
Coalesced: 8 tensors holding that many bytes per rank in all (sizes up to 4 MiB), all-reduced
and all-gathered in one dist._coalescing_manager block with a device (as DeepSpeed's ZeRO-3
issues them), against the same 8 ops one by one. --parts picks the sections to run.
AFD: one layer's attention-FFN exchange (bench_afd.py's decode shapes at H 4096, 64 experts,
top-8, bf16) with host 0's ranks as attention ranks and host 1's as FFN ranks, cam's AfdChannel
against the same exchange written with all_to_all_single over flat gloo and over cam.
Results: benchmarks/results_multihost.md (written with --write).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOSTS, PER_HOST = 2, 2
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all_single")
PARTS = ("collectives", "kv", "moe", "weights", "afd", "coalesced")
COALESCED_TENSORS, COALESCED_MAX_BYTES = 8, 4 << 20


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def human(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def link_bytes(op: str, nbytes: int) -> float:
    h, l = HOSTS, PER_HOST
    w = h * l
    return {"all_reduce": 2 * (h - 1) / h * nbytes, "all_gather": (h - 1) * l * nbytes,
            "reduce_scatter": (h - 1) / h * nbytes, "all_to_all_single": l * nbytes * (w - l) / w}[op]


# ----------------------------------------------------------------------------- one rank

def raw_link(rank: int, store, samples: int) -> dict:
    """Rank 0 (host 0) against rank PER_HOST (host 1): a TCP stream and a 1-byte ping-pong."""
    peer = PER_HOST
    if rank not in (0, peer):
        return {}
    if rank == peer:
        srv = socket.socket()
        srv.settimeout(120)  # every wait has a deadline
        srv.bind((os.environ["MULTIHOST_HOST_ADDR"], 0))
        srv.listen(1)
        store.set("bench/raw", f"{os.environ['MULTIHOST_HOST_ADDR']}:{srv.getsockname()[1]}")
        conn, _ = srv.accept()
        conn.settimeout(120)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        total = int(conn.recv(32).decode().strip())
        conn.sendall(b"k")
        got = 0
        while got < total:
            got += len(conn.recv(1 << 20))
        conn.sendall(b"d")
        for _ in range(samples * 40):
            conn.recv(1)
            conn.sendall(b"p")
        conn.close()
        srv.close()
        return {}
    host, port = store.get("bench/raw").decode().rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    total = 256 << 20
    s.sendall(f"{total:<32}".encode())
    s.recv(1)
    chunk = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(total >> 20):
        s.sendall(chunk)
    s.recv(1)  # the peer has received every byte
    stream = total / (time.perf_counter() - t0)
    rtts = []
    for _ in range(samples * 40):
        t0 = time.perf_counter()
        s.sendall(b"p")
        s.recv(1)
        rtts.append(time.perf_counter() - t0)
    s.close()
    return {"stream_Bps": stream, "rtt_s": statistics.median(rtts)}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from _harness import setup_worker, timed_from_last_entry, timed_slowest

    setup_worker(int(os.environ["RANK"]), False)
    dist.init_process_group("cam", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == HOSTS * PER_HOST, world
    gloo = dist.new_group(backend="gloo")
    cam_gloo = dist.new_group(backend="cam", pg_options={"inter_host_engine": "gloo"})
    two_hops = dist.new_group(backend="cam", pg_options={"all_to_all_hops": "two_hops"})
    engine = dist.group.WORLD._get_backend(torch.device("cpu")).inter_host_engine
    host_ranks = [list(range(h * PER_HOST, (h + 1) * PER_HOST)) for h in range(HOSTS)]
    local = None
    for ranks in host_ranks:  # every rank takes part in every new_group call
        g = dist.new_group(ranks, backend="cam")
        if rank in ranks:
            local = g
    store = dist.distributed_c10d._get_default_store()
    raw = raw_link(rank, store, args.samples)
    rows = []
    for op in OPS if "collectives" in args.parts else ():
        for nbytes in args.sizes:
            n = max(1, nbytes // 4)
            x = torch.ones(n)
            if op == "all_reduce":
                out, fn = None, lambda g: dist.all_reduce(x, group=g)
            elif op == "all_gather":
                out = torch.empty(world * n)
                fn = lambda g: dist.all_gather_into_tensor(out, x, group=g)  # noqa: E731
            elif op == "reduce_scatter":
                x = torch.ones(n - n % world or world)
                out = torch.empty(x.numel() // world)
                fn = lambda g: dist.reduce_scatter_tensor(out, x, group=g)  # noqa: E731
            else:
                x = torch.ones(n - n % world or world)
                out = torch.empty_like(x)
                fn = lambda g: dist.all_to_all_single(out, x, group=g)  # noqa: E731
            cam_s = timed_slowest(lambda: fn(None), gloo, args.samples)
            gloo_s = timed_slowest(lambda: fn(gloo), gloo, args.samples)
            row = {"op": op, "bytes": nbytes, "cam_s": cam_s, "gloo_s": gloo_s}
            if engine != "gloo":
                row["cam_gloo_s"] = timed_slowest(lambda: fn(cam_gloo), gloo, args.samples)
            if op == "all_to_all_single":
                row["cam_two_hops_s"] = timed_slowest(lambda: fn(two_hops), gloo, args.samples)
            if op == "all_reduce" and nbytes <= 4096:
                row["one_host_s"] = timed_slowest(lambda: dist.all_reduce(x, group=local), gloo, args.samples)
                # The latency target again, timed from the last rank's entry (no barrier skew).
                row["cam_last_s"] = timed_from_last_entry(lambda: fn(None), gloo, args.samples)
                row["one_host_last_s"] = timed_from_last_entry(lambda: dist.all_reduce(x, group=local), gloo,
                                                               args.samples)
            rows.append(row)
    parts = {"kv": lambda: kv_rows(rank, gloo, args), "moe": lambda: moe_rows(rank, world, gloo, args),
             "weights": lambda: weights_rows(rank, gloo, args), "afd": lambda: afd_rows(rank, gloo, args),
             "coalesced": lambda: coalesced_rows(rank, world, gloo, args)}
    for name, part in parts.items():
        if name in args.parts:
            rows += part()
    raws = [None] * world
    dist.all_gather_object(raws, raw, group=gloo)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"raw": raws[0], "rows": rows, "engine": engine}, f)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def kv_rows(rank: int, gloo, args) -> list[dict]:
    """KV push and pull between host 0's rank 0 and host 1's rank 2 (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from _harness import timed_slowest
    from torch_cam.kv import KVTransfer, KVLayout

    src, dst = 0, PER_HOST
    block = 64 << 10
    rows = []
    for nbytes in args.sizes:
        if nbytes < block:
            continue
        nblocks = nbytes // block
        lay = KVLayout("mha", 1, nblocks, block // (2 * 8 * 128 * 2), 8, 128, torch.bfloat16, "NHD")
        kv = KVTransfer()
        pools = kv.allocate(lay)
        kv.register(pools, lay)
        ids, tokens = list(range(nblocks)), nblocks * lay.block_size
        kv.version(dst if rank == src else src)
        seq = iter(range(1 << 30))

        def push():
            rid = b"p%d" % next(seq)
            if rank == src:
                kv.push(dst, ids, ids, tokens, request_id=rid)
            elif rank == dst:
                kv.wait_notification(rid, peer=src)

        def pull():
            rid = b"q%d" % next(seq)
            if rank == dst:
                kv.pull(src, ids, ids, tokens, request_id=rid)
            elif rank == src:
                kv.wait_notification(rid, peer=dst)

        buf = pools[0].view(-1)

        def p2p(group):
            if rank == src:
                dist.send(buf, dst, group=group)
            elif rank == dst:
                dist.recv(buf, src, group=group)

        row = {"op": "kv", "bytes": nbytes}
        row["push_s"] = timed_slowest(push, gloo, args.samples)
        row["pull_s"] = timed_slowest(pull, gloo, args.samples)
        row["send_s"] = timed_slowest(lambda: p2p(None), gloo, args.samples)
        row["gloo_s"] = timed_slowest(lambda: p2p(gloo), gloo, args.samples)
        rows.append(row)
        del kv, pools
    return rows


MOE_HIDDEN, MOE_EXPERTS = 512, 16


def moe_link_bytes(nbytes: int, topk: int) -> float:
    """Inter-host bytes per direction of one dispatch + combine: every token row goes to top-K
    experts, (W-L)/W of them on the other host, and comes back weighted."""
    w = HOSTS * PER_HOST
    return 2 * PER_HOST * nbytes * topk * (w - PER_HOST) / w


def moe_rows(rank: int, world: int, gloo, args) -> list[dict]:
    """MoE dispatch + combine (see the module docstring), cam against the all-to-all dispatcher."""
    import torch
    import torch.distributed as dist
    import torch_cam
    from _harness import all_ok, timed_slowest
    from bench_moe import A2ADispatcher

    rows = []
    for nbytes in args.sizes:
        T = max(1, nbytes // (2 * MOE_HIDDEN))
        g = torch.Generator().manual_seed(1000 * rank + T)
        x = torch.randn(T, MOE_HIDDEN, generator=g).to(torch.bfloat16)
        top, ids = torch.randn(T, MOE_EXPERTS, generator=g).topk(args.moe_topk, dim=1)
        ids, w = ids.to(torch.int32).contiguous(), torch.softmax(top, dim=1).contiguous()

        def cam():
            expand_x, _, expand_idx, _, counts, _, _ = torch_cam.moe_distribute_dispatch(
                x, ids, dist.group.WORLD, world, rank, MOE_EXPERTS, expert_scales=w)
            return torch_cam.moe_distribute_combine(expand_x, ids, expand_idx, counts, w, dist.group.WORLD,
                                                    world, rank, MOE_EXPERTS)

        def a2a(group):
            b = A2ADispatcher(group, world, MOE_EXPERTS)
            expert_in, _, state = b.dispatch(x, ids)
            return b.combine(expert_in, w, state)

        want = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)
        ok = all(torch.allclose(f().float(), want.float(), rtol=1e-2, atol=1e-2)
                 for f in (cam, lambda: a2a(gloo), lambda: a2a(None)))
        if not all_ok(ok, gloo):
            raise RuntimeError(f"bench_multihost: MoE outputs disagree at {nbytes} bytes per rank")
        expand_x, _, expand_idx, _, counts, _, _ = torch_cam.moe_distribute_dispatch(
            x, ids, dist.group.WORLD, world, rank, MOE_EXPERTS, expert_scales=w)

        def combine():
            return torch_cam.moe_distribute_combine(expand_x, ids, expand_idx, counts, w, dist.group.WORLD,
                                                    world, rank, MOE_EXPERTS)

        row = {"op": "moe", "bytes": T * 2 * MOE_HIDDEN, "topk": args.moe_topk,
               "cam_s": timed_slowest(cam, gloo, args.samples),
               "gloo_s": timed_slowest(lambda: a2a(gloo), gloo, args.samples),
               "a2a_cam_s": timed_slowest(lambda: a2a(None), gloo, args.samples),
               "combine_s": timed_slowest(combine, gloo, args.samples)}
        # The same with every row sent straight to its receiver (no two hops).
        moe = torch_cam.moe_hosts.moe_backend(dist.group.WORLD)
        auto, moe.two_hop_min_bytes = moe.two_hop_min_bytes, 1 << 62
        row["direct_s"] = timed_slowest(cam, gloo, args.samples)
        row["combine_direct_s"] = timed_slowest(combine, gloo, args.samples)
        moe.two_hop_min_bytes = auto
        rows.append(row)
    return rows


def coalesced_rows(rank: int, world: int, gloo, args) -> list[dict]:
    """8 all_reduces and 8 all_gathers as one coalescing block each, against one by one."""
    import torch
    import torch.distributed as dist
    from _harness import timed_slowest

    cpu = torch.device("cpu")
    rows = []
    for nbytes in (b for b in args.sizes if b <= COALESCED_MAX_BYTES):
        n = max(1, nbytes // (4 * COALESCED_TENSORS))
        ts = [torch.ones(n) for _ in range(COALESCED_TENSORS)]
        outs = [torch.empty(world * n) for _ in ts]

        def all_reduce():
            for t in ts:
                dist.all_reduce(t)

        def all_gather():
            for o, t in zip(outs, ts):
                dist.all_gather_into_tensor(o, t)

        def block(ops):
            with dist._coalescing_manager(device=cpu):
                ops()

        rows.append({"op": "coalesced", "bytes": COALESCED_TENSORS * n * 4,
                     "ar_block_s": timed_slowest(lambda: block(all_reduce), gloo, args.samples),
                     "ar_each_s": timed_slowest(all_reduce, gloo, args.samples),
                     "ag_block_s": timed_slowest(lambda: block(all_gather), gloo, args.samples),
                     "ag_each_s": timed_slowest(all_gather, gloo, args.samples)})
    return rows


def weights_rows(rank: int, gloo, args) -> list[dict]:
    """WeightChannel from host 0's trainers (TP 2) to a replica on each rank of host 1 (see the
    module docstring), against gloo broadcasts of the same shards."""
    import torch
    import torch.distributed as dist
    from _harness import timed_slowest
    from torch_cam.weights import Shard, WeightChannel

    trainers, replicas = list(range(PER_HOST)), [[r] for r in range(PER_HOST, HOSTS * PER_HOST)]
    rows = []
    for nbytes in args.sizes:
        if nbytes < (64 << 10):
            continue
        cols = 256
        shape = (max(PER_HOST, nbytes // (8 * 4 * cols)), cols)
        ch = WeightChannel(trainers=trainers, replicas=replicas)
        full = [torch.full(shape, float(i)) for i in range(8)]
        if rank in trainers:
            i = trainers.index(rank)
            mine = [ch.register(f"w{k}", t.chunk(PER_HOST, 0)[i].clone(), Shard(0, i, PER_HOST), shape=shape)
                    for k, t in enumerate(full)]
        else:
            mine = [ch.register(f"w{k}", torch.zeros(shape)) for k in range(8)]
        version = iter(range(1, 1 << 30))
        step = (lambda: ch.publish(next(version))) if rank in trainers else (lambda: ch.update(next(version)))
        step()
        if rank not in trainers and not all(torch.equal(m, f) for m, f in zip(mine, full)):
            raise RuntimeError(f"bench_multihost: weights differ on rank {rank} at {nbytes} bytes")
        shards = [t.chunk(PER_HOST, 0)[i].clone() for t in full for i in range(PER_HOST)]

        def broadcasts():
            for j, t in enumerate(shards):
                dist.broadcast(t, src=trainers[j % PER_HOST], group=gloo)

        rows.append({"op": "weights", "bytes": 8 * shape[0] * cols * 4, "cam_s": timed_slowest(step, gloo, args.samples),
                     "gloo_s": timed_slowest(broadcasts, gloo, args.samples)})
        del ch, mine
    return rows


AFD_SHAPES = ((32, 4096, 64), (128, 4096, 64))  # (tokens per attention rank, hidden, experts)


def afd_rows(rank: int, gloo, args) -> list[dict]:
    """One AFD layer between host 0 (attention) and host 1 (FFN), see the module docstring."""
    import torch
    from _harness import all_ok, timed_slowest
    from bench_afd import DTYPE, TOPK, a2a_exchange, routing
    from torch_cam.afd import AfdChannel

    attn, ffn = list(range(PER_HOST)), list(range(PER_HOST, HOSTS * PER_HOST))
    rows = []
    for bs, H, E in AFD_SHAPES:
        per_rank = E // len(ffn)
        ch = AfdChannel(attention_ranks=attn, ffn_ranks=ffn, experts_per_rank=per_rank, hidden=H, topk=TOPK,
                        max_tokens=bs, dtype=DTYPE, micro_batches=2)
        on_attn = rank in attn
        x = torch.randn(bs, H, generator=torch.Generator().manual_seed(rank)).to(DTYPE) if on_attn else None
        ids, w = routing(rank, bs, E, 0) if on_attn else (None, None)

        def cam():
            if on_attn:
                return ch.recv(ch.send(x, ids, w, layer=0))
            tok = ch.recv_tokens(layer=0)
            ch.send_outputs(tok.rows, tok)  # identity experts: only the exchange is timed
            return None

        got = cam()
        if not all_ok(not on_attn or torch.allclose(got.float(), x.float(), atol=2e-2, rtol=2e-2), gloo):
            raise RuntimeError(f"bench_multihost: the AFD exchange is wrong at bs {bs}")
        row = {"op": "afd", "bytes": bs * H * 2, "bs": bs, "cam_s": timed_slowest(cam, gloo, args.samples)}
        for key, group in (("gloo_s", gloo), ("a2a_cam_s", None)):
            row[key] = timed_slowest(lambda g=group: a2a_exchange(g, rank, attn, ffn, x, ids, w, per_rank, H),
                                     gloo, args.samples)
        rows.append(row)
        ch.close()
    return rows


# ----------------------------------------------------------------------------- launcher

def find_tool() -> str:
    for t in (os.environ.get("TORCH_CAM_MULTIHOST", ""), os.path.join(ROOT, "..", "shared", "tools", "multihost.sh"),
              "/work/shared/tools/multihost.sh"):
        if t and os.access(t, os.X_OK):
            return t
    sys.exit("bench_multihost: multihost.sh not found (set TORCH_CAM_MULTIHOST)")


def run_one(rate: str, args) -> dict:
    fd, out = tempfile.mkstemp(prefix=".multihost_", suffix=".json", dir=HERE)  # a path every host sees
    os.close(fd)
    cmd = [find_tool(), "--torchrun", "--timeout", str(args.timeout)]
    if rate != "none":
        cmd += ["--rate", rate]
    cmd += [str(HOSTS), str(PER_HOST), "--", os.path.abspath(__file__), "--worker", "--out", out,
            "--samples", str(args.samples), "--sizes", ",".join(str(s) for s in args.sizes),
            "--moe-topk", str(args.moe_topk), "--parts", ",".join(args.parts)]
    env = dict(os.environ, MULTIHOST_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 60)
        if proc.returncode != 0 or os.path.getsize(out) == 0:
            sys.exit(f"bench_multihost: the {rate} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def table(rate: str, res: dict) -> list[str]:
    raw = res["raw"]
    stream, rtt = raw["stream_Bps"], raw["rtt_s"]
    lines = [f"### {HOSTS} hosts x {PER_HOST} ranks, link {'unshaped (veth)' if rate == 'none' else rate}",
             "",
             f"Raw link between two hosts: TCP stream {stream / 1e9:.3f} GB/s, 1-byte round trip {rtt * 1e6:.0f} us.",
             f"cam between hosts: {res.get('engine', 'gloo')}; \"cam (gloo)\": the same group with the gloo fallback.",
             "",
             "| op | size per rank | cam ms | cam (gloo) ms | flat gloo ms | gloo / cam | cam (gloo) / cam | cam link GB/s | of raw stream |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if r["op"] not in OPS:
            continue
        link = link_bytes(r["op"], r["bytes"]) / r["cam_s"]
        cg = r.get("cam_gloo_s")
        lines.append(f"| {r['op']} | {human(r['bytes'])} | {r['cam_s'] * 1e3:.3f} | "
                     f"{cg * 1e3 if cg else float('nan'):.3f} | {r['gloo_s'] * 1e3:.3f} | "
                     f"{r['gloo_s'] / r['cam_s']:.2f}x | {cg / r['cam_s'] if cg else float('nan'):.2f}x | "
                     f"{link / 1e9:.3f} | {link / stream:.0%} |")
    a2a = [r for r in res["rows"] if "cam_two_hops_s" in r]
    if a2a:
        lines += ["", "all_to_all_single with the option all_to_all_hops=two_hops (each rank's blocks for rail l "
                  "gathered by its host's rank l, one message per rail and host) against the direct form above:",
                  "", "| size per rank | direct ms | two hops ms | direct / two hops | two hops link GB/s |",
                  "|---|---|---|---|---|"]
        for r in a2a:
            lines.append(f"| {human(r['bytes'])} | {r['cam_s'] * 1e3:.3f} | {r['cam_two_hops_s'] * 1e3:.3f} | "
                         f"{r['cam_s'] / r['cam_two_hops_s']:.2f}x | "
                         f"{link_bytes(r['op'], r['bytes']) / r['cam_two_hops_s'] / 1e9:.3f} |")
    kv = [r for r in res["rows"] if r["op"] == "kv"]
    if kv:
        lines += ["", "KV transfer and point-to-point between hosts (rank 0 -> rank 2: KV push until the "
                  "notification is seen, pull by rank 2, cam send/recv), against gloo send/recv of the same bytes:",
                  "",
                  "| bytes | KV push ms | KV pull ms | cam send/recv ms | gloo send/recv ms | gloo / push | "
                  "gloo / cam send | push GB/s | push of raw stream |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in kv:
            bw = r["bytes"] / r["push_s"]
            lines.append(f"| {human(r['bytes'])} | {r['push_s'] * 1e3:.3f} | {r['pull_s'] * 1e3:.3f} | "
                         f"{r['send_s'] * 1e3:.3f} | {r['gloo_s'] * 1e3:.3f} | {r['gloo_s'] / r['push_s']:.2f}x | "
                         f"{r['gloo_s'] / r['send_s']:.2f}x | {bw / 1e9:.3f} | {bw / stream:.0%} |")
    moe = [r for r in res["rows"] if r["op"] == "moe"]
    if moe:
        lines += ["", f"MoE dispatch + combine (bf16 rows of {MOE_HIDDEN * 2} B, top-{moe[0]['topk']} of {MOE_EXPERTS} "
                  "experts), against the all-to-all token dispatcher over flat gloo and over cam's all_to_all_single; "
                  "\"direct\": every row straight to its receiver (cam takes two hops from 1 MiB of rows between "
                  "hosts, and combine only where its partial sums cross fewer bytes); combine also alone; link: "
                  "the bytes of every row crossing on its own (two hops carry fewer, so it can pass the stream):",
                  "",
                  "| rows per rank | cam ms | cam direct ms | a2a over gloo ms | a2a over cam ms | gloo / cam | "
                  "a2a over cam / cam | direct / cam | combine ms | combine direct ms | cam link GB/s | of raw stream |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in moe:
            link = moe_link_bytes(r["bytes"], r["topk"]) / r["cam_s"]
            direct = r.get("direct_s", float("nan"))
            lines.append(f"| {human(r['bytes'])} | {r['cam_s'] * 1e3:.3f} | {direct * 1e3:.3f} | {r['gloo_s'] * 1e3:.3f} | "
                         f"{r['a2a_cam_s'] * 1e3:.3f} | {r['gloo_s'] / r['cam_s']:.2f}x | "
                         f"{r['a2a_cam_s'] / r['cam_s']:.2f}x | {direct / r['cam_s']:.2f}x | "
                         f"{r['combine_s'] * 1e3:.3f} | {r['combine_direct_s'] * 1e3:.3f} | {link / 1e9:.3f} | "
                         f"{link / stream:.0%} |")
    weights = [r for r in res["rows"] if r["op"] == "weights"]
    if weights:
        lines += ["", f"RL weights: host 0's {PER_HOST} trainers (TP {PER_HOST}) to a whole replica on each of host 1's "
                  f"{PER_HOST} ranks (WeightChannel publish / update), against gloo broadcasts of the shards; "
                  f"link bytes: the model once per replica:",
                  "",
                  "| model | cam ms | gloo broadcasts ms | gloo / cam | cam link GB/s | of raw stream |",
                  "|---|---|---|---|---|---|"]
        for r in weights:
            link = PER_HOST * r["bytes"] / r["cam_s"]
            lines.append(f"| {human(r['bytes'])} | {r['cam_s'] * 1e3:.3f} | {r['gloo_s'] * 1e3:.3f} | "
                         f"{r['gloo_s'] / r['cam_s']:.2f}x | {link / 1e9:.3f} | {link / stream:.0%} |")
    afd = [r for r in res["rows"] if r["op"] == "afd"]
    if afd:
        lines += ["", f"AFD: one layer's exchange, host 0's {PER_HOST} ranks attention, host 1's {PER_HOST} FFN "
                  "(H 4096, 64 experts, top-8, bf16), against the exchange written with all_to_all_single:",
                  "",
                  "| tokens per attention rank | cam ms | a2a over gloo ms | a2a over cam ms | gloo / cam | "
                  "a2a over cam / cam |",
                  "|---|---|---|---|---|---|"]
        for r in afd:
            lines.append(f"| {r['bs']} | {r['cam_s'] * 1e3:.3f} | {r['gloo_s'] * 1e3:.3f} | {r['a2a_cam_s'] * 1e3:.3f} | "
                         f"{r['gloo_s'] / r['cam_s']:.2f}x | {r['a2a_cam_s'] / r['cam_s']:.2f}x |")
    coalesced = [r for r in res["rows"] if r["op"] == "coalesced"]
    if coalesced:
        lines += ["", f"Coalescing blocks: {COALESCED_TENSORS} tensors holding the bytes per rank in all, in one "
                  "dist._coalescing_manager block with a device (small tensors move as one op), against the same "
                  "ops one by one:", "",
                  "| bytes per rank | all_reduce block ms | one by one ms | one by one / block | "
                  "all_gather block ms | one by one ms | one by one / block |",
                  "|---|---|---|---|---|---|---|"]
        for r in coalesced:
            lines.append(f"| {human(r['bytes'])} | {r['ar_block_s'] * 1e3:.3f} | {r['ar_each_s'] * 1e3:.3f} | "
                         f"{r['ar_each_s'] / r['ar_block_s']:.2f}x | {r['ag_block_s'] * 1e3:.3f} | "
                         f"{r['ag_each_s'] * 1e3:.3f} | {r['ag_each_s'] / r['ag_block_s']:.2f}x |")
    small = [r for r in res["rows"] if "one_host_s" in r]
    for r in small:
        bound = 2 * rtt + r["one_host_s"]
        lines.append("")
        lines.append(f"all_reduce {human(r['bytes'])}: cam {r['cam_s'] * 1e6:.0f} us across hosts; one host's "
                     f"ranks alone {r['one_host_s'] * 1e6:.0f} us; target 2 x round trip + that = "
                     f"{bound * 1e6:.0f} us ({r['cam_s'] / bound:.2f} of it)")
        if "cam_last_s" in r:
            last = 2 * rtt + r["one_host_last_s"]
            lines.append(f"the same from the last rank's entry (without the barrier's skew, which inflates both "
                         f"terms above): cam {r['cam_last_s'] * 1e6:.0f} us; one host {r['one_host_last_s'] * 1e6:.0f}"
                         f" us; target {last * 1e6:.0f} us ({r['cam_last_s'] / last:.2f} of it)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rates", default="none,1gbit", help="link shapings, comma-separated (none = unshaped)")
    p.add_argument("--sizes", default="1K,64K,1M,16M", help="bytes per rank, comma-separated (K/M suffixes)")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--moe-topk", type=int, default=4, help="experts per token of the MoE rows (of 16)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per shaping")
    p.add_argument("--parts", default=",".join(PARTS), help=f"sections to run, comma-separated, of {','.join(PARTS)}")
    p.add_argument("--write", action="store_true", help="also write benchmarks/results_multihost.md")
    args = p.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.parts = args.parts.split(",")
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.worker:
        worker(args)
        return
    if os.geteuid() != 0:
        sys.exit("bench_multihost: simulated hosts need root (network and mount namespaces)")
    out = [f"## cam across hosts ({datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, "
           f"{os.cpu_count()} cores shared by all simulated hosts, {args.samples} samples)", ""]
    for rate in args.rates.split(","):
        out += table(rate, run_one(rate, args)) + [""]
    text = "\n".join(out)
    print(text)
    if args.write:
        with open(os.path.join(HERE, "results_multihost.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
