"""Attention-FFN disaggregated decode on one host over cam: 2 attention ranks + 2 FFN ranks.

Run:  torchrun --nproc-per-node 4 examples/afd_decode.py

A small MoE transformer (2 layers, 8 routed experts top-2 plus a shared expert). Ranks 0 and 1
hold the embeddings, attention layers (with KV caches), routers and the head, each for its own 8
sequences; ranks 2 and 3 hold the experts (4 each) and a copy of the shared expert. Every decode
step runs each rank's batch as two micro-batches in a ping-pong: while the FFN ranks compute
micro-batch 0 of a layer, the attention rank runs attention for micro-batch 1. Each step's
logits are checked against a single-process copy of the model on all 16 sequences, and the
attention ranks print the time per layer and how much of the exchange was hidden behind their
compute. Where the host has fewer cores than ranks (4 ranks on a 2-core machine), the attention
compute and the FFN ranks' experts take turns on the same cores, so little of the exchange can
hide; benchmarks/bench_afd.py measures hiding with a compute that leaves the cores free, as
compute on an accelerator does.
"""
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_cam  # noqa: F401  registers "cam"
from torch_cam.afd import AfdChannel

VOCAB, DIM, HEADS, LAYERS, FF = 256, 128, 4, 2, 256
EXPERTS, TOPK, PER_RANK = 8, 2, 4
ATTN, FFN = [0, 1], [2, 3]
SEQS, PROMPT, STEPS, MICRO = 8, 5, 6, 2      # per attention rank; two micro-batches of 4


def weights():
    g = torch.Generator().manual_seed(0)
    r = lambda *s, scale=0.08: torch.randn(*s, generator=g) * scale  # noqa: E731
    w = {"emb": r(VOCAB, DIM, scale=1.0), "head": r(DIM, VOCAB)}
    for l in range(LAYERS):
        w[f"qkv{l}"], w[f"o{l}"], w[f"router{l}"] = r(DIM, 3 * DIM), r(DIM, DIM), r(DIM, EXPERTS, scale=0.5)
        w[f"up{l}"], w[f"down{l}"] = r(EXPERTS, DIM, FF), r(EXPERTS, FF, DIM)
        w[f"sup{l}"], w[f"sdown{l}"] = r(DIM, FF), r(FF, DIM)
    return w


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def attention(w, l, x, cache):
    """x (b, D): one new token per sequence; cache[l] (k, v) of (b, t, D) grows by one."""
    q, k, v = (rms(x) @ w[f"qkv{l}"]).split(DIM, dim=-1)
    ks = torch.cat([cache[l][0], k[:, None]], 1) if cache[l] is not None else k[:, None]
    vs = torch.cat([cache[l][1], v[:, None]], 1) if cache[l] is not None else v[:, None]
    cache[l] = (ks, vs)
    b, t = ks.shape[:2]
    split = lambda y: y.view(b, -1, HEADS, DIM // HEADS).transpose(1, 2)  # noqa: E731
    a = F.scaled_dot_product_attention(split(q[:, None]), split(ks), split(vs))
    return x + a.transpose(1, 2).reshape(b, DIM) @ w[f"o{l}"]


def route(w, l, x):
    """Normalized input of the MoE block, top-2 expert ids and weights."""
    xn = rms(x)
    p = torch.softmax(xn @ w[f"router{l}"], dim=-1)
    top, ids = p.topk(TOPK, dim=-1)
    return xn, ids.to(torch.int32), top / top.sum(-1, keepdim=True)


def expert(w, l, e, rows):
    if e < 0:
        return F.silu(rows @ w[f"sup{l}"]) @ w[f"sdown{l}"]
    return F.silu(rows @ w[f"up{l}"][e]) @ w[f"down{l}"][e]


def moe_reference(w, l, xn, ids, wt):
    out = expert(w, l, -1, xn)
    for e in range(EXPERTS):
        t, k = (ids == e).nonzero(as_tuple=True)
        if len(t):
            out = out.index_add(0, t, expert(w, l, e, xn[t]) * wt[t, k, None])
    return out


def reference_logits(w, tokens_all):
    """The whole model in one process over every sequence's tokens so far: the last logits."""
    cache = [None] * LAYERS
    for pos in range(tokens_all.shape[1]):
        x = w["emb"][tokens_all[:, pos]]
        for l in range(LAYERS):
            x = attention(w, l, x, cache)
            xn, ids, wt = route(w, l, x)
            x = x + moe_reference(w, l, xn, ids, wt)
    return rms(x) @ w["head"]


def attention_rank(ch, w, rank, attn_group):
    a = ATTN.index(rank)
    g = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, VOCAB, (len(ATTN) * SEQS, PROMPT), generator=g)[a * SEQS:(a + 1) * SEQS]
    mbs = [slice(m * SEQS // MICRO, (m + 1) * SEQS // MICRO) for m in range(MICRO)]
    caches = [[None] * LAYERS for _ in range(MICRO)]
    steps = PROMPT + STEPS - 1
    exposed = layer_time = 0.0
    all_logits, last_inputs = [], []
    for step in range(steps):
        h = [w["emb"][tokens[mb, step]] for mb in mbs]
        pending = [None] * MICRO
        t0 = time.perf_counter()
        for l in range(LAYERS):       # ping-pong: send m, then compute m + 1 while m is served
            for m in range(MICRO):
                if l > 0:
                    c = time.perf_counter()
                    h[m] = h[m] + ch.recv(pending[m])
                    exposed += time.perf_counter() - c
                h[m] = attention(w, l, h[m], caches[m])
                xn, ids, wt = route(w, l, h[m])
                if step == steps - 1:
                    last_inputs.append((l, m, xn, ids, wt))
                c = time.perf_counter()
                pending[m] = ch.send(xn, ids, wt, layer=l, micro_batch=m)
                exposed += time.perf_counter() - c
        logits = []
        for m in range(MICRO):
            c = time.perf_counter()
            h[m] = h[m] + ch.recv(pending[m])
            exposed += time.perf_counter() - c
            logits.append(rms(h[m]) @ w["head"])
        layer_time += (time.perf_counter() - t0) / LAYERS
        logits = torch.cat(logits)
        all_logits.append(logits)
        if step + 1 >= PROMPT:
            tokens = torch.cat([tokens, logits.argmax(-1)[:, None]], 1)
    # The same exchanges without overlap (send, then recv at once): what there was to hide.
    dist.barrier(group=attn_group)
    serial = 0.0
    for _ in range(steps):
        for l, m, xn, ids, wt in last_inputs:
            c = time.perf_counter()
            ch.recv(ch.send(xn, ids, wt, layer=l, micro_batch=m))
            serial += time.perf_counter() - c
    # Check every step's logits against the whole model in one process over all 16 sequences.
    every = [torch.zeros_like(tokens) for _ in ATTN]
    dist.all_gather(every, tokens.contiguous(), group=attn_group)
    everyone = torch.cat(every)
    worst = 0.0
    for step in range(steps):
        ref = reference_logits(w, everyone[:, :step + 1])[a * SEQS:(a + 1) * SEQS]
        diff = (all_logits[step] - ref).abs().max().item()
        worst = max(worst, diff)
        if diff > 1e-4:
            raise SystemExit(f"attention rank {rank} step {step}: logits differ from the single-process model by {diff}")
    hidden = max(0.0, 1.0 - exposed / serial) if serial > 0 else 0.0
    print(f"attention rank {rank}: {steps} decode steps, {LAYERS} layers x {MICRO} micro-batches, logits match the "
          f"single-process model (max diff {worst:.1e}); {1e3 * layer_time / steps:.2f} ms per layer; the exchange "
          f"alone takes {1e6 * serial / steps / LAYERS / MICRO:.0f} us per layer and micro-batch, "
          f"{100 * hidden:.0f}% of it hidden behind attention compute ({os.cpu_count()} cores for "
          f"{dist.get_world_size()} ranks)", flush=True)


def ffn_rank(ch, w, rank):
    f = FFN.index(rank)
    for _ in range(PROMPT + STEPS - 1):
        for l in range(LAYERS):
            for m in range(MICRO):
                _serve(ch, w, f, l, m)
    for _ in range(PROMPT + STEPS - 1):   # the attention ranks' no-overlap measurement
        for l in range(LAYERS):
            for m in range(MICRO):
                _serve(ch, w, f, l, m)


def _serve(ch, w, f, l, m):
    tok = ch.recv_tokens(layer=l, micro_batch=m)
    out = torch.empty_like(tok.rows)
    start = 0
    for j, c in enumerate(tok.counts.tolist()):
        e = f * PER_RANK + j if j < PER_RANK else -1
        if c:
            out[start:start + c] = expert(w, l, e, tok.rows[start:start + c])
        start += c
    ch.send_outputs(out, tok)


def main():
    dist.init_process_group("cam")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    attn_group = dist.new_group(ATTN, backend="gloo")
    w = weights()
    ch = AfdChannel(attention_ranks=ATTN, ffn_ranks=FFN, experts_per_rank=PER_RANK, hidden=DIM, topk=TOPK,
                    max_tokens=SEQS // MICRO, dtype=torch.float32, shared_expert=True, micro_batches=MICRO)
    if rank in ATTN:
        attention_rank(ch, w, rank, attn_group)
    else:
        ffn_rank(ch, w, rank)
        print(f"ffn rank {rank}: served experts {FFN.index(rank) * PER_RANK}..{FFN.index(rank) * PER_RANK + PER_RANK - 1}"
              f" and its share of the shared expert", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
