"""MoE expert-parallel dispatch + combine: cam's memory-semantic ops against the usual
all-to-all token dispatcher, on one machine, side by side in one run per world size.

Usage::

    timeout 1800 .venv/bin/python benchmarks/bench_moe.py --ranks 2 4 8 [--quick] [--pin] \\
        [--hidden H] [--prefill-hidden H] [--out results_moe.md]

What is measured: the communication of one MoE layer (T tokens per rank, top-K routing over
E experts spread evenly over the W ranks, hidden size H, bf16 activations), with identity
experts (the expert output is the expert input), done three ways:

* ``cam``: ``torch_cam.moe_distribute_dispatch`` then ``torch_cam.moe_distribute_combine``
  (torch_npu-compatible signatures) on the cam world group: one synchronisation per call, every
  receiver pulls its rows from the senders' staged copies straight into place, combine pulls
  and weights/sums in fp32. ``cam int8``: the same with ``quant_mode=2`` (int8 rows + fp32
  row scales on dispatch; combine gets a bf16 expert output of expand_x's shape, made once
  outside the timed region).
* ``(a)`` the common all-to-all dispatcher, written here after Megatron-core's
  ``MoEAlltoAllTokenDispatcher``, over a **gloo** group: tokens per expert (``bincount``),
  counts exchanged with ``all_to_all_single``, token copies permuted by expert id (stable sort,
  ``index_select``), ``all_to_all_single`` of the rows with uneven splits, then the received
  rows re-sorted by local expert (contiguous per expert); combine: inverse permutation, the
  reverse ``all_to_all_single``, then ``index_add_`` of ``w * row`` in fp32 per token and a
  cast to bf16.
* ``(b)`` exactly the same baseline code over **cam**'s own ``all_to_all_single``.

Configurations: ``decode`` (128 tokens per rank, top-8, 64 and 256 experts, H 7168 at 2 and 4
ranks, 4096 at 8; ``--hidden`` overrides) and ``prefill`` (4096 tokens per rank, top-8, 256
experts, H 2048; ``--prefill-hidden`` / ``--prefill-tokens`` override). An expert count that W
does not divide is skipped. Routing: top-K of seeded random scores (softmax weights over the K
chosen), the same tensors for every variant. ``--quick``: the decode 64-expert and the prefill
shapes only, fewer samples.

Correctness, once per configuration and outside timing: with identity experts every variant's
combined output must match the others and ``x * sum(w)`` (allclose, rtol = atol = 1e-2;
int8: atol grown by the quantization step); a mismatch aborts the run (exit status 1). The
check column also says whether cam's expand_x rows equal the baseline's expert-sorted rows bit
for bit (same layout: by local expert, then source rank, then token).

Timing (the conventions of benchmarks/_common.py, with batch 1): per configuration each variant
is warmed up, its cost estimated (max over ranks), and a sample count chosen from a time budget
(clamped to [min, max] samples). Samples of the four variants are interleaved round-robin so
that they see the same machine state. A sample = barrier on the group being measured (cam world
group or gloo group), then dispatch and combine back to back, timed on every rank (dispatch
alone, combine alone, and both); the sample value is the max over ranks, taken with one gloo
all-reduce MAX after the timed loop. Medians and p90 are reported in microseconds; ratios are
median (a) / median cam and median (b) / median cam (> 1: cam is faster).

``cam GB/s`` follows DeepEP's accounting: bytes of bf16 rows received by dispatch per rank plus
bytes of bf16 rows sent by combine per rank (both T*K rows on average over the ranks, H * 2
bytes each), divided by the dispatch + combine median.

Each world size runs in its own spawned processes (torch.multiprocessing, "spawn"; cam world
group from ``init_process_group("cam")`` and a gloo group over the same ranks from
``new_group(backend="gloo")``) under a hard deadline (``--timeout``); past it the workers are
killed and the configurations finished so far are printed. Workers use one intra-op thread;
gloo uses the loopback interface. ``--pin`` pins rank r to core r % ncores.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _p in (_HERE, _REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _common as C  # noqa: E402
import _harness as H  # noqa: E402

TOPK = 8
DECODE_TOKENS = 128
PREFILL_TOKENS = 4096
PREFILL_EXPERTS = 256
DECODE_EXPERTS = (64, 256)
QUICK_DECODE_EXPERTS = (64,)
PREFILL_HIDDEN = 2048


def decode_hidden(world: int) -> int:
    return 7168 if world <= 4 else 4096


VARIANTS = ("cam", "cam_int8", "a2a_cam", "a2a_gloo")
VARIANT_LABEL = {"cam": "cam", "cam_int8": "cam int8", "a2a_cam": "a2a over cam (b)",
                 "a2a_gloo": "a2a over gloo (a)"}

# time plans: (budget per variant and configuration in s, min samples, max samples, warmups)
PLANS = {
    "full": {"budget_s": 3.0, "min_samples": 5, "max_samples": 60, "warmup_decode": 5, "warmup_prefill": 2},
    "quick": {"budget_s": 0.5, "min_samples": 3, "max_samples": 15, "warmup_decode": 3, "warmup_prefill": 1},
}

DEEPEP_CONTEXT = ("Context (published figures, not measured here): DeepEP V1 normal kernels, intranode EP8 "
                  "on H800/NVLink: dispatch 153 GB/s, combine 158 GB/s; DeepEP low-latency kernels, EP8 "
                  "(128 tokens, H 7168, top-8): dispatch 77 µs, combine 114 µs.")


# ----------------------------------------------------------------------------- the baseline

class A2ADispatcher:
    """The usual all-to-all token dispatcher (after Megatron-core's MoEAlltoAllTokenDispatcher,
    without TP/EP sub-grouping, capacity or drop), parameterized by the process group it runs
    on. Experts are laid out contiguously: expert e lives on rank e // (E / W)."""

    def __init__(self, group, world: int, num_experts: int):
        self.group, self.W, self.E = group, world, num_experts
        self.L = num_experts // world

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor):
        """Returns (expert_in, tokens_per_local_expert, state): expert_in holds the rows this
        rank's experts process, grouped by local expert, then source rank, then token."""
        W, L, E, g = self.W, self.L, self.E, self.group
        T, K = expert_ids.shape
        flat = expert_ids.reshape(-1).to(torch.int64)
        tokens_per_expert = torch.bincount(flat, minlength=E)               # (E,) sent counts
        input_splits = tokens_per_expert.view(W, L).sum(1)
        global_counts = torch.empty(W * L, dtype=torch.int64)               # [source rank][local expert]
        dist.all_to_all_single(global_counts, tokens_per_expert, group=g)
        gc = global_counts.view(W, L)
        output_splits = gc.sum(1)
        in_list, out_list = input_splits.tolist(), output_splits.tolist()
        # permute: one copy of a token per chosen expert, sorted by expert id (= by destination)
        order = torch.argsort(flat, stable=True)
        src_token = torch.div(order, K, rounding_mode="floor")
        permuted = x.index_select(0, src_token)
        recv = torch.empty(sum(out_list), x.shape[1], dtype=x.dtype)
        dist.all_to_all_single(recv, permuted, out_list, in_list, group=g)
        # received as [source rank][local expert] chunks: re-sort to [local expert][source rank]
        chunk = torch.repeat_interleave(torch.arange(W * L), gc.reshape(-1))
        key = (chunk % L) * W + torch.div(chunk, L, rounding_mode="floor")
        sort_idx = torch.argsort(key, stable=True)
        expert_in = recv.index_select(0, sort_idx)
        state = (order, src_token, sort_idx, in_list, out_list, T)
        return expert_in, gc.sum(0), state

    def combine(self, expert_out: torch.Tensor, weights: torch.Tensor, state) -> torch.Tensor:
        """sum_k w[t, k] * expert_out(row of (t, k)) per token, accumulated in fp32, cast to
        expert_out's dtype."""
        order, src_token, sort_idx, in_list, out_list, T = state
        H = expert_out.shape[1]
        back = torch.empty_like(expert_out).index_copy_(0, sort_idx, expert_out)  # inverse of the re-sort
        returned = torch.empty(len(order), H, dtype=expert_out.dtype)
        dist.all_to_all_single(returned, back, in_list, out_list, group=self.group)
        w_sorted = weights.reshape(-1).index_select(0, order)
        weighted = returned.to(torch.float32).mul_(w_sorted.unsqueeze(1))
        out = torch.zeros(T, H, dtype=torch.float32).index_add_(0, src_token, weighted)
        return out.to(expert_out.dtype)


# ----------------------------------------------------------------------------- worker side

def configurations(world: int, cfg: dict) -> tuple[list[dict], list[str]]:
    confs, skipped = [], []
    H_dec = cfg["hidden"] or decode_hidden(world)
    for E in (QUICK_DECODE_EXPERTS if cfg["quick"] else DECODE_EXPERTS):
        c = {"shape": "decode", "T": cfg["decode_tokens"], "K": TOPK, "E": E, "H": H_dec}
        (confs if E % world == 0 else skipped).append(c)
    c = {"shape": "prefill", "T": cfg["prefill_tokens"], "K": TOPK, "E": PREFILL_EXPERTS,
         "H": cfg["prefill_hidden"]}
    (confs if PREFILL_EXPERTS % world == 0 else skipped).append(c)
    return confs, [f"{c['shape']} E={c['E']}" for c in skipped]


def make_inputs(conf: dict, rank: int, seed: int):
    """Seeded per (rank, configuration): x (T, H) bf16, expert ids (T, K) int32 (distinct per
    row: top-K of random scores), weights (T, K) fp32 (softmax over the chosen scores)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + conf["E"] * 31 + conf["T"])
    T, K, E, H = conf["T"], conf["K"], conf["E"], conf["H"]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    scores = torch.randn(T, E, generator=g)
    top, ids = scores.topk(K, dim=1)
    return x, ids.to(torch.int32).contiguous(), torch.softmax(top, dim=1).to(torch.float32).contiguous()


class Variants:
    """The four ways, each as fn() -> (t_dispatch_done, out) timed by the caller."""

    def __init__(self, conf, x, ids, w, gloo, world, rank):
        import torch_cam
        self.tc = torch_cam
        self.conf, self.x, self.ids, self.w = conf, x, ids, w
        self.world, self.rank, self.E = world, rank, conf["E"]
        self.cam_group = dist.group.WORLD
        self.groups = {"cam": self.cam_group, "cam_int8": self.cam_group, "a2a_cam": self.cam_group,
                       "a2a_gloo": gloo}
        self.base = {"a2a_cam": A2ADispatcher(None, world, self.E), "a2a_gloo": A2ADispatcher(gloo, world, self.E)}
        self.int8_expert_out = None  # set by prepare_int8()

    def cam_dispatch(self, quant_mode: int):
        return self.tc.moe_distribute_dispatch(self.x, self.ids, self.cam_group, self.world, self.rank, self.E,
                                               expert_scales=self.w, quant_mode=quant_mode)

    def cam_combine(self, expert_out, expand_idx, ep_recv_counts):
        return self.tc.moe_distribute_combine(expert_out, self.ids, expand_idx, ep_recv_counts, self.w,
                                              self.cam_group, self.world, self.rank, self.E)

    def prepare_int8(self):
        """One untimed int8 dispatch; its dequantized rows, as a bf16 tensor of expand_x's shape,
        are the expert output of every timed int8 combine (the routing never changes)."""
        expand_x, scales, _, _, counts, _, _ = self.cam_dispatch(2)
        n = int(counts[-1])
        out = torch.empty(expand_x.shape, dtype=torch.bfloat16)  # rows >= n are never read
        out[:n] = (expand_x[:n].to(torch.float32) * scales[:n].unsqueeze(1)).to(torch.bfloat16)
        self.int8_expert_out = out
        return expand_x, scales, n

    def run(self, name: str, clock=time.perf_counter):
        """One dispatch + combine; returns (t0, t1, t2, out): start, dispatch done, combine done."""
        if name == "cam":
            t0 = clock()
            expand_x, _, expand_idx, _, ep_recv_counts, _, _ = self.cam_dispatch(0)
            t1 = clock()
            out = self.cam_combine(expand_x, expand_idx, ep_recv_counts)  # identity experts
            return t0, t1, clock(), out
        if name == "cam_int8":
            t0 = clock()
            _, _, expand_idx, _, ep_recv_counts, _, _ = self.cam_dispatch(2)
            t1 = clock()
            out = self.cam_combine(self.int8_expert_out, expand_idx, ep_recv_counts)
            return t0, t1, clock(), out
        b = self.base[name]
        t0 = clock()
        expert_in, _, state = b.dispatch(self.x, self.ids)
        t1 = clock()
        out = b.combine(expert_in, self.w, state)  # identity experts
        return t0, t1, clock(), out

    def barrier(self, name: str):
        dist.barrier(group=self.groups[name])


def check(v: Variants, gloo) -> tuple[bool, str, dict]:
    """Runs every variant once (untimed) and compares the combined outputs; returns (ok on every
    rank, check text, info)."""
    x, w = v.x, v.w
    ref = (x.to(torch.float32) * w.sum(1, keepdim=True)).to(torch.bfloat16)
    problems = []
    outs = {}
    for name in ("cam", "a2a_cam", "a2a_gloo"):
        outs[name] = v.run(name)[3]
    tol = dict(rtol=1e-2, atol=1e-2)
    for name, out in outs.items():
        if out.shape != ref.shape or out.dtype != torch.bfloat16:
            problems.append(f"{name}: output {tuple(out.shape)} {out.dtype}")
        elif not torch.allclose(out.float(), ref.float(), **tol):
            err = (out.float() - ref.float()).abs().max().item()
            problems.append(f"{name} vs x*sum(w): max abs err {err:.3g}")
    for name in ("a2a_cam", "a2a_gloo"):
        if outs[name].shape == outs["cam"].shape and not torch.allclose(outs[name].float(), outs["cam"].float(), **tol):
            err = (outs[name].float() - outs["cam"].float()).abs().max().item()
            problems.append(f"{name} vs cam: max abs err {err:.3g}")
    # dispatch layout: cam's valid expand_x rows against the baseline's expert-sorted rows
    expand_x, _, _, _, counts, _, _ = v.cam_dispatch(0)
    n = int(counts[-1])
    expert_in = v.base["a2a_gloo"].dispatch(x, v.ids)[0]
    same_rows = expert_in.shape[0] == n and torch.equal(expand_x[:n], expert_in)
    # int8: dequantized rows close to the bf16 ones, and the combine of them close to x*sum(w)
    _, _, n8 = v.prepare_int8()
    out8 = v.run("cam_int8")[3]
    step = x.to(torch.float32).abs().amax(1, keepdim=True) / 127.0  # one int8 step per token row
    bound = 1e-2 + 1e-2 * ref.float().abs() + step * w.sum(1, keepdim=True)
    if n8 != n:
        problems.append(f"cam_int8 received {n8} rows, bf16 dispatch {n}")
    elif not bool(((out8.float() - ref.float()).abs() <= bound).all()):
        err = (out8.float() - ref.float()).abs().max().item()
        problems.append(f"cam_int8 vs x*sum(w): max abs err {err:.3g} (beyond one int8 step)")
    ok = H.all_ok(not problems, gloo)
    all_same = H.all_ok(same_rows, gloo)
    rows = torch.tensor([float(n)], dtype=torch.float64)
    dist.all_reduce(rows, group=gloo)
    text = "ok" + ("; dispatch rows identical to (a)" if all_same else "; dispatch rows differ from (a) in order")
    if not ok:
        text = f"FAILED on rank {v.rank}: " + "; ".join(problems) if problems else "FAILED on another rank"
    return ok, text, {"recv_rows_mean": rows.item() / v.world}


def time_config(v: Variants, gloo, plan: dict, warmup: int, samples_override: int | None) -> dict:
    # warmup and a cost estimate per variant (max over ranks of the mean of the timed warmups)
    est = {}
    for name in VARIANTS:
        v.barrier(name)
        v.run(name)  # untimed first call (page faults, stage growth)
        ts = []
        for _ in range(max(1, warmup - 1)):
            v.barrier(name)
            t0, _, t2, _ = v.run(name)
            ts.append(t2 - t0)
        est[name] = sum(ts) / len(ts)
    est = dict(zip(VARIANTS, H.max_over_ranks([est[n] for n in VARIANTS], gloo)))
    nsamp = {}
    for name in VARIANTS:
        if samples_override:
            nsamp[name] = samples_override
        else:
            per = est[name] + 2e-4  # + barrier
            nsamp[name] = int(min(plan["max_samples"], max(plan["min_samples"], plan["budget_s"] // per)))
    times = {name: [] for name in VARIANTS}  # (dispatch, combine, total) per sample, this rank
    for i in range(max(nsamp.values())):
        for name in VARIANTS:  # round-robin: every variant sees the same machine state
            if i < nsamp[name]:
                v.barrier(name)
                t0, t1, t2, _ = v.run(name)
                times[name].append((t1 - t0, t2 - t1, t2 - t0))
    res = {}
    for name in VARIANTS:  # max over ranks, per sample and per part, outside the timed loop
        flat = [t for s in times[name] for t in s]
        mx = H.max_over_ranks(flat, gloo)
        d, c, tot = mx[0::3], mx[1::3], mx[2::3]
        res[name] = {"dispatch": C.summarize(d), "combine": C.summarize(c), "total": C.summarize(tot),
                     "samples": nsamp[name], "est_us": est[name] * 1e6}
    return res


def _worker(rank: int, world: int, store_path: str, cfg: dict, result_path: str):
    H.setup_worker(rank, cfg["pin"])
    confs, skipped = configurations(world, cfg)
    # The MoE stage (two halves, grown with 50% headroom) lives in the tensor heap: make room
    # for the largest combine stage (every received row) with margin; pages cost only when used.
    need = max(c["T"] * c["K"] * c["H"] * 2 for c in confs) * 6 + (64 << 20)
    heap = max(1 << 30, 1 << (need - 1).bit_length())
    gloo = H.init_groups(rank, world, store_path, cfg["op_timeout"],
                         pg_options={"tensor_heap_bytes": heap})
    plan = PLANS["quick" if cfg["quick"] else "full"]
    rows = []
    t_start = time.time()

    def dump(current=None, complete=False, failed=None):
        if rank == 0:
            H.atomic_json(result_path, {"world": world, "rows": rows, "current": current, "skipped": skipped,
                                        "complete": complete, "failed": failed, "heap_bytes": heap,
                                        "elapsed_s": time.time() - t_start})

    for conf in confs:
        name = f"{conf['shape']} T={conf['T']} K={conf['K']} E={conf['E']} H={conf['H']}"
        dump(name)
        c0 = time.time()
        x, ids, w = make_inputs(conf, rank, cfg["seed"])
        v = Variants(conf, x, ids, w, gloo, world, rank)
        ok, text, info = check(v, gloo)
        if not ok:
            dump(name, failed=f"{name}: {text}")
            dist.barrier(group=gloo)
            raise RuntimeError(f"MoE CHECK FAILED [W={world}] {name}: {text}")
        warm = plan["warmup_decode"] if conf["shape"] == "decode" else plan["warmup_prefill"]
        res = time_config(v, gloo, plan, warm, cfg["samples"])
        if rank == 0:
            row = dict(conf, W=world, check=text, variants=res, cell_s=time.time() - c0, **info)
            rows.append(row)
            tot = {n: res[n]["total"]["median_us"] for n in VARIANTS}
            print(f"  [W={world}] {name:44s} " + "  ".join(f"{n} {tot[n]:.0f}us" for n in VARIANTS)
                  + f"  ({row['cell_s']:.1f}s)", file=sys.stderr, flush=True)
        del v, x, ids, w
    dump(None, complete=True)
    H.finish_worker(gloo)


# ----------------------------------------------------------------------------- launcher side

def run_world(world: int, args) -> dict:
    cfg = {"quick": args.quick, "op_timeout": args.op_timeout, "pin": args.pin, "hidden": args.hidden,
           "prefill_hidden": args.prefill_hidden, "prefill_tokens": args.prefill_tokens,
           "decode_tokens": args.decode_tokens, "samples": args.samples, "seed": args.seed}
    return H.run_world(_worker, world, cfg, args.timeout, "bench_moe")


def _us(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.1f}" if v < 100 else f"{v:,.0f}"


def _cell(r: dict | None, part: str = "total") -> str:
    if not r:
        return "n/a"
    return f"{_us(r[part]['median_us'])} / {_us(r[part]['p90_us'])}"


def table(world: int, res: dict, args) -> str:
    lines = [f"## MoE dispatch + combine, {world} ranks — {H.machine_line(world, args.quick, args.pin)}", "",
             "Dispatch + combine per layer, median / p90 in µs (max over ranks per sample); identity experts.", "",
             "| shape | W | experts | H | cam (µs) | cam int8 (µs) | a2a over cam (b) (µs) | "
             "a2a over gloo (a) (µs) | ratio (a)/cam | ratio (b)/cam | cam GB/s | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("rows", []):
        vv = r["variants"]
        cam = vv["cam"]["total"]["median_us"]
        gbs = 2 * r["recv_rows_mean"] * r["H"] * 2 / (cam * 1e-6) / 1e9 if cam else math.nan
        lines.append(f"| {r['shape']} (T={r['T']}, top-{r['K']}) | {r['W']} | {r['E']} | {r['H']} | "
                     f"{_cell(vv['cam'])} | {_cell(vv['cam_int8'])} | {_cell(vv['a2a_cam'])} | "
                     f"{_cell(vv['a2a_gloo'])} | {C.fmt_ratio(vv['a2a_gloo']['total']['median_us'], cam)} | "
                     f"{C.fmt_ratio(vv['a2a_cam']['total']['median_us'], cam)} | {gbs:.2f} | {r['check']} |")
    if res.get("rows"):
        lines += ["", "Dispatch alone / combine alone (medians in µs, each the max over ranks per sample; "
                  "dispatch and combine GB/s for cam bf16 as DeepEP counts them), samples per variant:", "",
                  "| shape | W | experts | H | cam dispatch | cam combine | cam int8 dispatch | cam int8 combine | "
                  "(b) dispatch | (b) combine | (a) dispatch | (a) combine | cam dispatch GB/s | "
                  "cam combine GB/s | samples cam / int8 / b / a |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            vv = r["variants"]
            nbytes = r["recv_rows_mean"] * r["H"] * 2
            gb = lambda t: f"{nbytes / (t * 1e-6) / 1e9:.2f}" if t else "n/a"  # noqa: E731
            med = lambda n, p: _us(vv[n][p]["median_us"])  # noqa: E731
            lines.append(f"| {r['shape']} | {r['W']} | {r['E']} | {r['H']} | "
                         + " | ".join(med(n, p) for n in VARIANTS for p in ("dispatch", "combine"))
                         + f" | {gb(vv['cam']['dispatch']['median_us'])} | {gb(vv['cam']['combine']['median_us'])} | "
                         + " / ".join(str(vv[n]["samples"]) for n in VARIANTS) + " |")
    notes = ["", "Ratios: median (a) or (b) over median cam (> 1: cam faster). cam GB/s: (bf16 bytes received by "
             "dispatch + bf16 bytes sent by combine) per rank / cam median; rows per rank = T*K on average.",
             "(a): Megatron-style all-to-all dispatcher over gloo; (b): the same code over cam's all_to_all_single.",
             DEEPEP_CONTEXT]
    if res.get("skipped"):
        notes.append(f"skipped (experts not divisible by {world}): " + ", ".join(res["skipped"]))
    if res.get("heap_bytes"):
        notes.append(f"cam group pg_options: tensor_heap_bytes = {res['heap_bytes'] >> 20} MiB "
                     f"(MoE stage room), other options default")
    if res.get("failed"):
        notes.append(f"**CHECK FAILED:** {res['failed']}")
    if res.get("error"):
        notes.append(f"**error:** {res['error']}" + (f" (running: {res['current']})" if res.get("current") else ""))
    notes.append(f"wall time for this world size: {res.get('wall_s', math.nan):.1f} s")
    if res.get("load_before"):
        lb, la = res["load_before"], res["load_after"]
        notes.append(f"load average (1/5/15 min) before: {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f}, "
                     f"after: {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f}")
    return "\n".join(lines + notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--quick", action="store_true",
                    help="decode 64-expert and prefill shapes only, fewer samples")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--timeout", type=float, default=900, help="hard deadline per world size (s)")
    ap.add_argument("--op-timeout", type=float, default=300, help="timeout given to the process groups (s)")
    ap.add_argument("--pin", action="store_true", help="pin rank r to core r %% ncores")
    ap.add_argument("--hidden", type=int, default=None,
                    help="decode hidden size (default: 7168 up to 4 ranks, 4096 at 8)")
    ap.add_argument("--prefill-hidden", type=int, default=PREFILL_HIDDEN)
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="prefill tokens per rank")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="decode tokens per rank")
    ap.add_argument("--samples", type=int, default=None, help="fixed sample count per variant (default: by budget)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    H.prepare_env()

    t_all = time.time()
    head = f"# torch_cam MoE dispatch + combine benchmark\n\ncommand: `{' '.join([sys.executable] + sys.argv)}`\n"
    parts = [head]
    failed = False

    def write():
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(parts))

    write()
    for world in args.ranks:
        print(f"== world size {world}", file=sys.stderr, flush=True)
        res = run_world(world, args)  # a failed launch comes back as an error
        md = table(world, res, args)
        print(md + "\n", flush=True)
        parts.append(md + "\n")
        write()
        if res.get("failed"):
            failed = True
            print(f"\n!!!!! MoE CHECK FAILED at {world} ranks: {res['failed']}\n!!!!! aborting", file=sys.stderr,
                  flush=True)
            break
    total = f"total wall time: {time.time() - t_all:.1f} s"
    print(total)
    parts.append(total + "\n")
    write()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
