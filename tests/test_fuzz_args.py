"""One rank's bad argument, every other rank's good one: a seeded fuzz over every op.

For each case one rank (chosen by the seed) passes a bad argument of one kind (wrong numel,
dtype, device (meta), layout (sparse), 0-dim tensor, expanded output, split lists that are
negative, miscounted or of the wrong length, an out-of-range root, a dtype the reduction cannot
take) while the others pass good ones. Asserted on every rank: the op raises within 2 s (the
group timeout is 20 s, so a rank that only raises at the timeout fails the test), the message
names the op and the bad rank, no process dies, and a correct all_reduce right after gives the
right sum. KV pushes are fuzzed too: the pushing rank raises and its peer's wait for the
request returns FAILED at once. The ops are called on the process group directly, so that torch's Python layer
(which answers some bad inputs itself, on the calling rank only) stays out of the way.
"""
import os
import random
import sys
import time
import unittest
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import cam_segments, run_ranks  # noqa: E402

N = 6  # elements per rank block
GROUP_TIMEOUT_S = 20
RAISE_WITHIN_S = 2.0
R = dist.ReduceOp


def _opts(cls, **kw):
    o = cls()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _bad_tensor(kind, good: torch.Tensor) -> torch.Tensor:
    """The bad variant `kind` of a good argument tensor."""
    if kind == "numel":
        return torch.zeros(good.numel() + 1, dtype=good.dtype)
    if kind == "dtype":
        return good.to(torch.float64 if good.dtype != torch.float64 else torch.float32)
    if kind == "meta":
        return torch.empty(good.shape, dtype=good.dtype, device="meta")
    if kind == "sparse":
        return good.reshape(-1).to_sparse()
    if kind == "zero_dim":
        return torch.zeros((), dtype=good.dtype)
    if kind == "expanded":
        return torch.zeros(1, dtype=good.dtype).expand(good.numel())
    raise ValueError(kind)


TENSOR_KINDS = ["numel", "dtype", "zero_dim"]
# Meta and sparse tensors reach the backend only where torch dispatches the op to it: where a
# meta tensor is the one the op dispatches on, torch's meta kernel returns at once on that rank
# alone, and most c10d ops have no sparse kernel (torch raises NotImplementedError on that rank
# alone), with every backend. Those cases are torch's, not cam's, and are left out.


# Each case: (op name in messages, the kinds it is fuzzed with, fn(pg, rank, world, bad_kind or None)).
def _all_reduce(pg, r, w, bad):
    t = torch.full((N,), float(r + 1))
    op = R.SUM
    if bad == "red_dtype":
        t = torch.zeros(N, dtype=torch.complex64)
        op = R.MAX
    elif bad == "bool_avg":
        t = torch.zeros(N, dtype=torch.bool)
        op = R.AVG
    elif bad:
        t = _bad_tensor(bad, t)
    pg.allreduce([t], _opts(dist.AllreduceOptions, reduceOp=op)).wait()


def _broadcast(pg, r, w, bad):
    t = torch.zeros(N)
    root = 0
    if bad == "root":
        root = w + 2
    elif bad:
        t = _bad_tensor(bad, t)
    pg.broadcast([t], _opts(dist.BroadcastOptions, rootRank=root)).wait()


def _reduce(pg, r, w, bad):
    t = torch.ones(N)
    root = w - 1
    if bad == "root":
        root = -1
    elif bad:
        t = _bad_tensor(bad, t)
    pg.reduce([t], _opts(dist.ReduceOptions, rootRank=root)).wait()


def _all_gather_into_tensor(pg, r, w, bad):
    out, inp = torch.empty(w * N), torch.ones(N)
    if bad:
        out = _bad_tensor(bad, out)
    pg._allgather_base(out, inp).wait()


def _all_gather(pg, r, w, bad):
    outs, inp = [torch.empty(N) for _ in range(w)], torch.ones(N)
    if bad == "list_len":
        outs = outs[:-1]
    elif bad:
        outs[r] = _bad_tensor(bad, outs[r])
    pg.allgather([outs], [inp]).wait()


def _reduce_scatter_tensor(pg, r, w, bad):
    out, inp = torch.empty(N), torch.ones(w * N)
    if bad == "red_dtype":
        out, inp = torch.empty(N, dtype=torch.complex64), torch.ones(w * N, dtype=torch.complex64)
        pg._reduce_scatter_base(out, inp, _opts(dist.ReduceScatterOptions, reduceOp=R.MIN)).wait()
        return
    if bad:
        inp = _bad_tensor(bad, inp)
    pg._reduce_scatter_base(out, inp).wait()


def _reduce_scatter(pg, r, w, bad):
    out, ins = torch.empty(N), [torch.ones(N) for _ in range(w)]
    if bad == "list_len":
        ins = ins + [torch.ones(N)]
    elif bad:
        ins[r] = _bad_tensor(bad, ins[r])
    pg.reduce_scatter([out], [ins]).wait()


def _all_to_all_single(pg, r, w, bad):
    out, inp = torch.empty(w * N), torch.ones(w * N)
    in_splits, out_splits = [], []
    if bad == "split_negative":
        in_splits = [N] * w
        in_splits[0] = -1
        in_splits[-1] += N + 1  # the sum still matches: only the sign is wrong
    elif bad == "split_sum":
        in_splits = [N] * (w - 1) + [N + 1]
    elif bad == "split_len":
        out_splits = [N] * (w + 1)
    elif bad == "expanded":
        out = _bad_tensor("expanded", out)
    elif bad:
        inp = _bad_tensor(bad, inp)
    pg.alltoall_base(out, inp, out_splits, in_splits).wait()


def _all_to_all(pg, r, w, bad):
    outs, ins = [torch.empty(N) for _ in range(w)], [torch.ones(N) for _ in range(w)]
    if bad == "list_len":
        ins = ins[:-1]
    elif bad:
        outs[(r + 1) % w] = _bad_tensor(bad, outs[(r + 1) % w])
    pg.alltoall(outs, ins).wait()


def _gather(pg, r, w, bad):
    root = 0
    inp = torch.ones(N)
    outs = [[torch.empty(N) for _ in range(w)]] if r == root else []
    if bad == "root":
        root = w
    elif bad == "list_len":
        outs = [[torch.empty(N) for _ in range(w + 1)]]
    elif bad:
        inp = _bad_tensor(bad, inp)
    pg.gather(outs, [inp], _opts(dist.GatherOptions, rootRank=root)).wait()


def _scatter(pg, r, w, bad):
    root = w - 1
    out = torch.empty(N)
    ins = [[torch.ones(N) for _ in range(w)]] if r == root else []
    if bad == "root":
        root = -3
    elif bad == "list_len":
        ins = [[torch.ones(N) for _ in range(w)]]  # a non-root passes inputs (or the root too many)
        if r == root:
            ins[0].append(torch.ones(N))
    elif bad:
        out = _bad_tensor(bad, out)
    pg.scatter([out], ins, _opts(dist.ScatterOptions, rootRank=root)).wait()


def _all_reduce_coalesced(pg, r, w, bad):
    ts = [torch.ones(N), torch.ones(3)]
    if bad:
        ts[1] = _bad_tensor(bad, ts[1])
    pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()


def _moe_routing(w):
    """4 tokens, top-2 over 2 experts per rank: every rank receives rows from every rank."""
    M = 2 * w
    return torch.tensor([[(2 * t) % M, (2 * t + 1) % M] for t in range(4)], dtype=torch.int32), M


def _moe_dispatch(pg, r, w, bad):
    import torch_cam
    ids, M = _moe_routing(w)
    x = torch.arange(4 * 16, dtype=torch.float32).view(4, 16).to(torch.bfloat16)
    if bad == "expert_id":
        ids[1, 0] = M + 5
    elif bad == "meta":
        x = torch.empty(x.shape, dtype=x.dtype, device="meta")
    elif bad == "dtype":
        x = x.to(torch.int32)
    elif bad == "numel":
        ids = ids[:3]
    torch_cam.moe_distribute_dispatch(x, ids, pg, w, r, M)


def _moe_combine(pg, r, w, bad):
    import torch_cam
    ids, M = _moe_routing(w)
    x = torch.arange(4 * 16, dtype=torch.float32).view(4, 16).to(torch.bfloat16)
    expand_x, _, expand_idx, _, counts = torch_cam.moe_distribute_dispatch(x, ids, pg, w, r, M)[:5]
    y = expand_x.clone()
    if bad == "meta":
        y = torch.empty(y.shape, dtype=y.dtype, device="meta")
    elif bad == "numel":
        y = y[:0]  # fewer expert-output rows than dispatch served
    elif bad == "dtype":
        y = y.to(torch.int32)
    torch_cam.moe_distribute_combine(y, ids, expand_idx, counts, None, pg, w, r, M)


CASES = {
    "all_reduce": (_all_reduce, TENSOR_KINDS + ["red_dtype", "bool_avg", "expanded", "sparse"]),
    "broadcast": (_broadcast, TENSOR_KINDS + ["root", "expanded"]),
    "reduce": (_reduce, TENSOR_KINDS + ["root"]),
    "all_gather_into_tensor": (_all_gather_into_tensor, TENSOR_KINDS + ["expanded"]),
    "all_gather": (_all_gather, TENSOR_KINDS + ["list_len", "meta"]),
    "reduce_scatter_tensor": (_reduce_scatter_tensor, TENSOR_KINDS + ["red_dtype"]),
    "reduce_scatter": (_reduce_scatter, TENSOR_KINDS + ["list_len", "meta"]),
    "all_to_all_single": (_all_to_all_single, TENSOR_KINDS + ["split_negative", "split_sum", "split_len", "expanded"]),
    "all_to_all": (_all_to_all, TENSOR_KINDS + ["list_len"]),
    "gather": (_gather, TENSOR_KINDS + ["root", "list_len"]),
    "scatter": (_scatter, TENSOR_KINDS + ["root", "list_len"]),
    "all_reduce_coalesced": (_all_reduce_coalesced, TENSOR_KINDS),
    "moe_distribute_dispatch": (_moe_dispatch, ["expert_id", "meta", "dtype", "numel"]),
    "moe_distribute_combine": (_moe_combine, ["meta", "numel", "dtype"]),
}
# What the bad rank's message names when it is not the op's own name.
OP_NAMES = {"moe_distribute_dispatch": "moe_", "moe_distribute_combine": "moe_"}


def _p2p(pg, r, w, bad, bad_rank, pair):
    """send from pair[0] to pair[1]; the bad rank (one of the pair) passes a bad tensor."""
    src, dst = pair
    t = torch.ones(N) if r == src else torch.empty(N)
    if r == bad_rank and bad:
        t = _bad_tensor(bad, t)
    if r == src:
        pg.send([t], dst, 3).wait()
    elif r == dst:
        pg.recv([t], src, 3).wait()


P2P_KINDS = ["expanded", "numel", "dtype", "zero_dim"]


def _kv(kv, r, bad, bad_rank, pair, case_index):
    """A KV push (or pull) from pair[0] to pair[1]; the bad rank is the transferring one. Its
    peer waits for the request's notification, which must say FAILED at once."""
    src, dst = pair
    rid = f"fuzz-{case_index}".encode()
    if r == src:
        src_ids, dst_ids, tokens, layers = [0, 1], [2, 3], 8, None
        if bad == "float_ids":
            src_ids = [0.5, 1]
        elif bad == "block_range":
            dst_ids = [2, 99]
        elif bad == "numel":
            tokens = 9  # more tokens than two blocks of 4 hold
        elif bad == "layer":
            layers = [5]
        kv.push(dst, src_ids, dst_ids, tokens, layers=layers, request_id=rid)
    elif r == dst:
        n = kv.wait_notification(rid, peer=src, timeout_s=GROUP_TIMEOUT_S)
        if not n.ok:
            raise RuntimeError(n.message)


KV_KINDS = ["float_ids", "block_range", "numel", "layer"]


def plan(seed: int, world: int):
    """The case list: every (op, kind) once, each with a bad rank drawn from the seed."""
    rng = random.Random(seed)
    cases = [(op, kind, rng.randrange(world)) for op, (_, kinds) in CASES.items() for kind in kinds]
    for kind in P2P_KINDS:
        src = rng.randrange(world)
        dst = (src + 1 + rng.randrange(world - 1)) % world
        # A send of an expanded tensor is fine (it is read); the receiver's is not.
        bad = dst if kind == "expanded" else rng.choice([src, dst])
        cases.append((f"p2p:{src}->{dst}", kind, bad))
    for kind in KV_KINDS:
        src = rng.randrange(world)
        dst = (src + 1 + rng.randrange(world - 1)) % world
        cases.append((f"kv:{src}->{dst}", kind, src))
    rng.shuffle(cases)
    return cases


def _worker(rank, world, init_file, seed):
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    pg = dist.distributed_c10d._get_default_group()
    from torch_cam.kv import KVLayout, KVTransfer
    kv = KVTransfer()  # collective
    lay = KVLayout("mha", 2, 8, 4, 2, 4, torch.bfloat16, "NHD")
    kv.register(kv.allocate(lay), lay)
    pg.barrier().wait()
    results = []
    for i, (op, kind, bad_rank) in enumerate(plan(seed, world)):
        start = time.monotonic()
        err = None
        try:
            if op.startswith("p2p:"):
                src, dst = (int(x) for x in op[4:].split("->"))
                _p2p(pg, rank, world, kind, bad_rank, (src, dst))
            elif op.startswith("kv:"):
                src, dst = (int(x) for x in op[3:].split("->"))
                _kv(kv, rank, kind, bad_rank, (src, dst), i)
            else:
                CASES[op][0](pg, rank, world, kind if rank == bad_rank else None)
        except Exception as e:  # noqa: BLE001 (any Python exception is a pass; a signal is not)
            err = f"{type(e).__name__}: {str(e)[:400]}"
        elapsed = time.monotonic() - start
        # The group must be usable after every argument error.
        t = torch.full((5,), float(rank + 1))
        try:
            pg.allreduce([t]).wait()
            usable = bool(torch.all(t == world * (world + 1) / 2))
        except Exception as e:  # noqa: BLE001
            usable = f"{type(e).__name__}: {str(e)[:300]}"
        results.append((op, kind, bad_rank, err, elapsed, usable))
    dist.destroy_process_group()
    return results


class OneBadRankFuzzTest(unittest.TestCase):
    def run_fuzz(self, world, seed):
        before = set(cam_segments())
        results = run_ranks(_worker, world, seed, deadline_s=240)
        failures = []
        per_rank = {}
        for r, (status, value) in sorted(results.items()):
            self.assertEqual(status, "ok", f"rank {r}: {value}")
            per_rank[r] = value
        n = len(per_rank[0])
        for i in range(n):
            op, kind, bad = per_rank[0][i][:3]
            p2p, kvop = op.startswith("p2p:"), op.startswith("kv:")
            involved = [int(x) for x in op.split(":")[1].split("->")] if p2p or kvop else range(world)
            if p2p:
                name = "send" if bad == involved[0] else "recv"
            else:
                name = "cam KV push" if kvop else OP_NAMES.get(op, op)
            for r in involved:
                _, _, _, err, elapsed, usable = per_rank[r][i]
                where = f"{op} with bad {kind} on rank {bad}, seen by rank {r}"
                if err is None:
                    failures.append(f"{where}: no error")
                    continue
                if elapsed > RAISE_WITHIN_S:
                    failures.append(f"{where}: raised only after {elapsed:.2f} s: {err}")
                if (name if r == bad else "cam ") not in err:
                    failures.append(f"{where}: the message does not name the op: {err}")
                if (f"on rank {bad}" if r == bad else f"rank {bad}") not in err:
                    failures.append(f"{where}: the message does not name rank {bad}: {err}")
                if "Exception raised from" in err:
                    failures.append(f"{where}: a C++ stack trace in the message: {err}")
            for r in range(world):
                if per_rank[r][i][5] is not True:
                    failures.append(f"{op} with bad {kind} on rank {bad}: all_reduce after it on rank {r}: "
                                    f"{per_rank[r][i][5]}")
        if failures:
            self.fail(f"{len(failures)} failures over {n} cases:\n" + "\n".join(failures[:30]))
        self.assertEqual(set(cam_segments()) - before, set())

    def test_two_ranks(self):
        self.run_fuzz(2, seed=1402)

    def test_three_ranks(self):
        self.run_fuzz(3, seed=1403)


if __name__ == "__main__":
    unittest.main()
