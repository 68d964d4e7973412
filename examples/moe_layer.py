"""A mixture-of-experts layer forward, expert-parallel over a cam group, checked against a
single-process computation of the same layer.

Run it with:

    torchrun --nproc-per-node 4 examples/moe_layer.py
    torchrun --nproc-per-node 4 examples/moe_layer.py --runs bf16 --tokens 64   # one run, more tokens

The layer: a router (H, E) scores every token, softmax + top-k picks K distinct experts per token
and their weights (renormalised to sum to 1, float32); each expert is an MLP
``w2 @ silu(w1 @ x)`` with w1 (H, F) and w2 (F, H). The E experts are spread over the W ranks
contiguously: rank r owns experts [r*L, (r+1)*L), L = E / W.

What every rank does (the expert-parallel forward):
  1. routes its own tokens (the router runs in fp32);
  2. ``torch_cam.moe_distribute_dispatch`` sends every (token, expert) row to the rank owning that
     expert; the rank gets its rows grouped by local expert (``expert_token_nums`` per expert);
  3. runs only its L local experts, each on its own slice of the received rows (in fp32, handing
     back rows in the activation dtype);
  4. ``torch_cam.moe_distribute_combine`` returns those rows to the tokens' owners, which sum them
     weighted by the router weights (fp32 accumulation).

The check: all ranks build the same seeded weights, and every rank's tokens come from a seed
derived from its rank, so each rank can regenerate all ranks' tokens and compute the whole layer
in plain PyTorch in one process (fp32, every expert applied densely to every token, the top-k
picked out afterwards). Each rank compares its own output rows with that, and also checks that
the number of rows each of its experts received is the number of tokens, over all ranks, that
chose that expert. Tolerances: 1e-4 (fp32), 2e-2 (bf16, the wire and the combined output are
bf16); the int8 run (``quant_mode=2``: dispatch quantizes every row to int8 with a float32 scale
per row, the experts dequantize with ``expand_x.float() * dynamic_scales[:, None]``) is held to 2%
of the largest output value, since int8 rounding of the inputs carries through the MLP.

Output: per rank and run, the token count, the rows each local expert received, the max abs error
against the single-process result and PASS/FAIL; rank 0 then prints a summary with the time per
layer forward on cam (slowest rank, median of --iters; the dispatch and combine share of it).
Exit code 1 if any check fails on any rank.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_cam  # registers the "cam" backend

# name -> (activation dtype, dispatch quant_mode, tolerance, tolerance is relative to max |ref|)
RUNS = {
    "fp32": (torch.float32, 0, 1e-4, False),
    "bf16": (torch.bfloat16, 0, 2e-2, False),
    "int8": (torch.float32, 2, 2e-2, True),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256, help="H, the model width")
    p.add_argument("--ffn", type=int, default=512, help="F, each expert's hidden width")
    p.add_argument("--experts", type=int, default=16, help="E, experts in total (a multiple of the ranks)")
    p.add_argument("--topk", type=int, default=4, help="K, experts per token")
    p.add_argument("--iters", type=int, default=20, help="timed forwards per run")
    p.add_argument("--runs", default="fp32,bf16,int8", help=f"comma-separated, from {','.join(RUNS)}")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ---- the layer ---------------------------------------------------------------------------------

def make_weights(H, Fh, E, seed):
    """Router (H, E), w1 (E, H, F), w2 (E, F, H): the same on every rank (same seed)."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(H, E, generator=g) / H ** 0.5
    w1 = torch.randn(E, H, Fh, generator=g) / H ** 0.5
    w2 = torch.randn(E, Fh, H, generator=g) / Fh ** 0.5
    return router, w1, w2


def make_tokens(src_rank, T, H, dtype, seed):
    """The tokens rank ``src_rank`` holds; any rank can regenerate them."""
    g = torch.Generator().manual_seed(seed * 1000 + 17 + src_rank)
    return torch.randn(T, H, generator=g).to(dtype)


def route(x, router, K):
    """Top-k routing in fp32: (expert_ids (T, K) int32, weights (T, K) float32, rows sum to 1)."""
    probs = torch.softmax(x.float() @ router, dim=-1)
    top_w, top_i = torch.topk(probs, K, dim=-1)
    return top_i.to(torch.int32), top_w / top_w.sum(dim=-1, keepdim=True)


def expert_mlp(rows, w1, w2):
    return F.silu(rows @ w1) @ w2


def moe_forward_cam(x, router, w1, w2, K, group, quant_mode, timing=None):
    """The expert-parallel forward of this rank's tokens. Returns (output (T, H) in x's dtype,
    rows received per local expert)."""
    W, rank = group.size(), group.rank()
    E = router.shape[1]
    L = E // W
    expert_ids, weights = route(x, router, K)

    t0 = time.perf_counter()
    (expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, _tp_recv_counts,
     _expand_scales) = torch_cam.moe_distribute_dispatch(
        x, expert_ids, group, W, rank, E, expert_scales=weights, quant_mode=quant_mode,
        expert_token_nums_type=1)
    t1 = time.perf_counter()

    # Rows [start_j, start_j + n_j) of expand_x belong to local expert j (global rank*L + j).
    expert_out = torch.zeros(expand_x.shape, dtype=x.dtype)
    start = 0
    for j, n in enumerate(expert_token_nums.tolist()):
        rows = expand_x[start:start + n].float()
        if quant_mode == 2:
            rows = rows * dynamic_scales[start:start + n, None]
        expert_out[start:start + n] = expert_mlp(rows, w1[rank * L + j], w2[rank * L + j]).to(x.dtype)
        start += n
    assert start == int(ep_recv_counts[-1]), "expert_token_nums and ep_recv_counts disagree"
    t2 = time.perf_counter()

    out = torch_cam.moe_distribute_combine(expert_out, expert_ids, expand_idx, ep_recv_counts, weights,
                                           group, W, rank, E)
    t3 = time.perf_counter()
    if timing is not None:
        timing.append((t3 - t0, t1 - t0, t3 - t2))
    return out, expert_token_nums


def moe_reference(xs, router, w1, w2, K):
    """The whole layer in one process, fp32: every expert on every token, then the top-k picked
    and weighted. Returns (per source rank: output (T, H) fp32, rows per expert over all ranks)."""
    E = router.shape[1]
    outs, counts = [], torch.zeros(E, dtype=torch.int64)
    for x in xs:
        ids, weights = route(x, router, K)
        xf = x.float()
        dense = torch.stack([expert_mlp(xf, w1[e], w2[e]) for e in range(E)])  # (E, T, H)
        tok = torch.arange(x.shape[0])
        out = torch.zeros(xf.shape)
        for k in range(K):
            out += weights[:, k, None] * dense[ids[:, k].long(), tok]
        outs.append(out)
        counts += torch.bincount(ids.view(-1).long(), minlength=E)
    return outs, counts


# ---- the run -----------------------------------------------------------------------------------

def in_rank_order(rank, world, text):
    for r in range(world):
        if r == rank:
            print(text, flush=True)
        dist.barrier()


def main():
    args = parse_args()
    dist.init_process_group("cam")  # env:// rendezvous from torchrun
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    T, H, Fh, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.topk
    if E % world or K > E:
        if rank == 0:
            print(f"--experts ({E}) must be a multiple of the {world} ranks and at least --topk ({K})")
        dist.destroy_process_group()
        return 2
    L = E // world
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for name in runs:
        if name not in RUNS:
            raise SystemExit(f"unknown run {name!r}; choose from {','.join(RUNS)}")

    router, w1, w2 = make_weights(H, Fh, E, args.seed)
    if rank == 0:
        print(f"MoE layer on cam: {world} ranks x {T} tokens, H={H}, F={Fh}, {E} experts "
              f"({L} per rank), top-{K}", flush=True)

    summary, all_ok = [], True
    for name in runs:
        dtype, quant_mode, tol, relative = RUNS[name]
        x = make_tokens(rank, T, H, dtype, args.seed)
        out, token_nums = moe_forward_cam(x, router, w1, w2, K, group, quant_mode)

        ref_outs, ref_counts = moe_reference(
            [make_tokens(r, T, H, dtype, args.seed) for r in range(world)], router, w1, w2, K)
        ref = ref_outs[rank]
        err = (out.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        limit = tol * scale if relative else tol
        counts_ok = token_nums.tolist() == ref_counts[rank * L:(rank + 1) * L].tolist()
        ok = err <= limit and counts_ok and out.dtype == dtype and tuple(out.shape) == (T, H)

        rows = ", ".join(f"e{rank * L + j}:{n}" for j, n in enumerate(token_nums.tolist()))
        in_rank_order(rank, world,
                      f"[{name} rank {rank}] {T} tokens; rows per local expert {rows} "
                      f"(total {int(token_nums.sum())}{'' if counts_ok else ', EXPECTED ' + str(ref_counts[rank * L:(rank + 1) * L].tolist())}); "
                      f"max abs err {err:.2e} (limit {limit:.1e}) {'PASS' if ok else 'FAIL'}")

        # Time the distributed forward (routing, dispatch, local experts, combine).
        timing = []
        for _ in range(2):
            moe_forward_cam(x, router, w1, w2, K, group, quant_mode)
        dist.barrier()
        for _ in range(args.iters):
            moe_forward_cam(x, router, w1, w2, K, group, quant_mode, timing)
        med = torch.tensor([statistics.median(t[i] for t in timing) for i in range(3)])
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank's medians
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        passed = bool(flag.item() == 1.0)
        all_ok &= passed
        summary.append((name, passed, med.tolist()))

    if rank == 0:
        print(f"\nsummary ({world} ranks, {T * world} tokens, {T * world * K} routed rows per layer):", flush=True)
        for name, passed, (layer, disp, comb) in summary:
            print(f"  {name:5s} {'PASS' if passed else 'FAIL'}   {layer * 1e3:7.3f} ms per layer on cam "
                  f"(dispatch {disp * 1e3:.3f} ms, combine {comb * 1e3:.3f} ms)", flush=True)
        print("all checks passed" if all_ok else "SOME CHECKS FAILED", flush=True)
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
