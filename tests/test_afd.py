"""Attention-FFN disaggregation (torch_cam.afd): attention ranks send every layer's tokens to the
FFN ranks holding their experts and get the combined output back, two micro-batches in flight;
checked bit for bit against torch_cam.afd_reference (the same layer in one process), with the
FFN side's grouped rows checked row by row; bad input raising on every rank involved; a dead or
frozen peer noticed within the timeout."""
import datetime
import os
import sys
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import assert_all_ok, cam_segments, run_ranks  # noqa: E402


def _init(rank, world, init_file, timeout_s=60):
    import torch_cam  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def expert_fn(e, rows, scales):
    """Row-wise stand-in for expert e (-1: shared) on rows as the FFN rank receives them."""
    x = rows.to(torch.float32) if scales is None else rows.to(torch.float32) * scales.unsqueeze(1)
    if e < 0:
        return x * 0.5 - 0.25
    return x * (1.0 + 0.125 * (e % 7)) + 0.0625 * (e + 1)


def batch(spec, a, layer, mb):
    """Attention index a's tokens, routing and weights for (layer, micro-batch)."""
    g = torch.Generator().manual_seed(7919 * a + 131 * layer + mb + 17 * spec.get("seed", 0))
    bs = spec["bs"][a][mb] if isinstance(spec["bs"][a], (list, tuple)) else spec["bs"][a]
    H, K, E = spec["hidden"], spec["topk"], spec["experts_per_rank"] * len(spec["ffn"])
    x = (torch.randn(bs, H, generator=g) * 3).to(spec["dtype"])
    pool = spec.get("expert_pool", list(range(E)))
    ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:K]] for _ in range(bs)]) \
        if bs else torch.zeros(0, K, dtype=torch.int64)
    ids = ids.to(torch.int32)
    if spec.get("unrouted") and bs:
        drop = torch.rand(bs, K, generator=g) < spec["unrouted"]
        ids[drop] = -1
    w = torch.rand(bs, K, generator=g).to(spec.get("weight_dtype", torch.float32))
    return x, ids, w


def expected_rows(spec, layer, mb, f, quant):
    """What FFN index f must receive: rows grouped by local expert, then shared, by (a, t)."""
    from torch_cam.moe_reference import quantize_int8_rows
    L, K = spec["experts_per_rank"], spec["topk"]
    data = [batch(spec, a, layer, mb) for a in range(len(spec["attn"]))]
    rows, scales, source = [], [], []
    for j in range(L + (1 if spec.get("shared") else 0)):
        for a, (x, ids, _) in enumerate(data):
            wire, sc = quantize_int8_rows(x) if quant else (x, None)
            if j < L:
                for t in range(x.shape[0]):
                    for k in range(K):
                        if int(ids[t, k]) == f * L + j:
                            rows.append(wire[t]), source.append((a, t, k))
                            if quant:
                                scales.append(sc[t])
            else:
                bs, n = x.shape[0], len(spec["ffn"])
                c = -(-bs // n) if bs else 0
                for t in range(min(bs, f * c), min(bs, (f + 1) * c)):
                    rows.append(wire[t]), source.append((a, t, K))
                    if quant:
                        scales.append(sc[t])
    H = spec["hidden"]
    dt = torch.int8 if quant else spec["dtype"]
    return (torch.stack(rows) if rows else torch.zeros(0, H, dtype=dt),
            torch.stack(scales) if scales else torch.zeros(0),
            torch.tensor(source, dtype=torch.int32).view(-1, 3))


def _channel(spec, timeout=20.0):
    from torch_cam import afd
    return afd.AfdChannel(attention_ranks=spec["attn"], ffn_ranks=spec["ffn"],
                          experts_per_rank=spec["experts_per_rank"], hidden=spec["hidden"], topk=spec["topk"],
                          max_tokens=spec["max_tokens"], dtype=spec["dtype"],
                          shared_expert=spec.get("shared", False), micro_batches=spec.get("slots", 2),
                          timeout=timeout)


def _ffn_step(ch, spec, layer, mb, quant, check_rows=True):
    tok = ch.recv_tokens(layer=layer, micro_batch=mb, quant=quant)
    if check_rows:
        rows, scales, source = expected_rows(spec, layer, mb, ch.cfg.ffn_ranks.index(ch.rank), quant)
        assert torch.equal(tok.rows, rows), f"layer {layer} mb {mb}: grouped rows differ"
        assert torch.equal(tok.source, source), f"layer {layer} mb {mb}: row sources differ"
        if quant:
            assert torch.equal(tok.scales, scales), f"layer {layer} mb {mb}: scales differ"
        assert int(tok.counts.sum()) == rows.shape[0]
    eids = ch.expert_ids(tok)
    out = torch.empty(tok.rows.shape[0], spec["hidden"], dtype=spec["dtype"])
    start = 0
    for g, c in enumerate(tok.counts.tolist()):
        if c:
            e = int(eids[start])
            out[start:start + c] = expert_fn(e, tok.rows[start:start + c],
                                             None if tok.scales is None else tok.scales[start:start + c])
        start += c
    ch.send_outputs(out, tok)
    return tok


def _exchange_worker(rank, world, init_file, spec):
    _init(rank, world, init_file)
    checked = run_exchange(rank, spec)
    dist.barrier()
    dist.destroy_process_group()
    return checked


def run_exchange(rank, spec):
    """On the default group: spec["layers"] layers of spec micro-batches, ping-pong (the
    attention side sends micro-batch m+1 before receiving m), every output and every FFN rank's
    grouped rows checked; returns the exchanges this rank checked."""
    from torch_cam import afd_reference
    ch = _channel(spec)
    L, MB = spec["layers"], spec["micro_batches"]
    quant = spec.get("quant", False)
    M = len(spec["attn"])
    placement = dict(experts_per_rank=spec["experts_per_rank"], num_ffn=len(spec["ffn"]))
    checked = 0
    if rank in spec["attn"]:
        a = spec["attn"].index(rank)
        handles = {}

        def finish(layer, mb):
            nonlocal checked
            data = [batch(spec, b, layer, mb) for b in range(M)]
            ws = [d[2] for d in data]
            at_recv = spec.get("weights_at_recv", False)
            want = afd_reference.exchange([d[0] for d in data], [d[1] for d in data], [None] * M if at_recv else ws,
                                          expert_fn, shared_expert=spec.get("shared", False), quant=quant,
                                          weights_at_recv=ws, **placement)[a]
            got = ch.recv(handles.pop((layer, mb)), ws[a] if at_recv else None)
            if not torch.equal(got, want):
                raise AssertionError(f"attention rank {rank} layer {layer} mb {mb}: max diff "
                                     f"{(got.float() - want.float()).abs().max()}")
            if quant:   # and within the quantization bound of the unquantized layer
                exact = afd_reference.exchange([d[0] for d in data], [d[1] for d in data], ws, expert_fn,
                                               shared_expert=spec.get("shared", False), **placement)[a]
                scale = data[a][0].float().abs().amax(dim=1, keepdim=True) / 127
                bound = scale * 0.5 * 4.0 + 0.02 * exact.float().abs() + 1e-3   # half a step times |gain|+|w|
                assert bool(((got.float() - exact.float()).abs() <= bound).all()), "int8 beyond its bound"
            checked += 1

        for layer in range(L):
            for mb in range(MB):
                if layer > 0:
                    finish(layer - 1, mb)
                x, ids, w = batch(spec, a, layer, mb)
                if spec.get("zero_copy"):   # the tokens computed straight into the slot
                    x = ch.send_buffer()[:x.shape[0]].copy_(x)
                handles[(layer, mb)] = ch.send(x, ids, None if spec.get("weights_at_recv") else w, layer=layer,
                                               micro_batch=mb, quant=quant)
        for mb in range(MB):
            finish(L - 1, mb)
    else:
        for layer in range(L):
            for mb in range(MB):
                _ffn_step(ch, spec, layer, mb, quant)
                checked += 1
    return checked


def _mismatch_worker(rank, world, init_file, spec, case):
    """One bad message, then a good one: the bad one raises on every rank involved, fast, and
    the channel carries the next message."""
    from torch_cam import afd
    _init(rank, world, init_file)
    ch = _channel(spec, timeout=15.0)
    attn = rank in spec["attn"]
    a = spec["attn"].index(rank) if attn else None
    seen = []
    t0 = time.monotonic()
    try:
        if attn:
            x, ids, w = batch(spec, a, 0, 0)
            layer = 0
            if case == "expert_id" and a == 0:
                ids = ids.clone()
                ids[1, 0] = spec["experts_per_rank"] * len(spec["ffn"]) + 3
            if case == "big_batch" and a == 0:
                x = torch.zeros(spec["max_tokens"] + 1, spec["hidden"], dtype=spec["dtype"])
                ids = torch.zeros(spec["max_tokens"] + 1, spec["topk"], dtype=torch.int32)
                w = None
            if case == "attn_layer" and a == len(spec["attn"]) - 1:
                layer = 5
            if case == "duplicate" and a == 0:
                ids = ids.clone()
                ids[0, 1] = ids[0, 0]
            h = ch.send(x, ids, w, layer=layer, micro_batch=0)
            ch.recv(h)
        else:   # an ffn rank that judges the message good (ffn_layer: rank 3) serves it
            tok = ch.recv_tokens(layer=3 if case == "ffn_layer" and rank == spec["ffn"][0] else 0, micro_batch=0)
            ch.send_outputs(torch.zeros(tok.rows.shape[0], spec["hidden"], dtype=spec["dtype"]), tok)
    except afd.AfdError as e:
        seen.append(str(e))
    elapsed = time.monotonic() - t0
    # The next message goes through.
    if attn:
        x, ids, w = batch(spec, a, 1, 0)
        got = ch.recv(ch.send(x, ids, w, layer=1, micro_batch=0))
        assert got.shape == x.shape
    else:
        tok = ch.recv_tokens(layer=1, micro_batch=0)
        ch.send_outputs(torch.zeros(tok.rows.shape[0], spec["hidden"], dtype=spec["dtype"]), tok)
    dist.barrier()
    dist.destroy_process_group()
    return (seen, elapsed)


def _role_worker(rank, world, init_file, spec):
    from torch_cam import afd
    _init(rank, world, init_file)
    ch = _channel(spec)
    msgs = []
    try:
        if rank in spec["attn"]:
            ch.recv_tokens(layer=0)
        else:
            ch.send(torch.zeros(1, spec["hidden"]), torch.zeros(1, 1, dtype=torch.int32), layer=0)
    except afd.AfdError as e:
        msgs.append(str(e))
    # Three slots: a key already in flight (posted as a refusal, so the ffn rank raises too), a
    # second key, then a message whose slot still holds the first.
    if rank in spec["attn"]:
        x, ids, w = batch(spec, 0, 0, 0)
        h0 = ch.send(x, ids, w, layer=0, micro_batch=0)
        for key in ((0, 0), (0, 1), (0, 2)):
            try:
                h = ch.send(x, ids, w, layer=key[0], micro_batch=key[1])
                msgs.append(f"accepted {key}")
                h1 = h
            except afd.AfdError as e:
                msgs.append(str(e))
        try:
            ch.send_buffer()
            msgs.append("send_buffer while its slot is busy")
        except afd.AfdError as e:
            msgs.append(str(e))
        ch.recv(h0)
        ch.recv(h1)
    else:
        for _ in range(3):
            try:
                tok = ch.recv_tokens()
            except afd.AfdError as e:
                msgs.append(str(e))
                continue
            ch.send_outputs(torch.zeros(tok.rows.shape[0], spec["hidden"], dtype=spec["dtype"]), tok)
    dist.barrier()
    dist.destroy_process_group()
    return msgs


def _dead_worker(rank, world, init_file, spec, who, how):
    _init(rank, world, init_file)
    return run_dead(rank, spec, who, how)


def run_dead(rank, spec, who, how):
    """On the default group: `who` ("ffn" or "attention") rank spec[who][0] dies (os._exit) or
    freezes before its part of message 2; the others must raise within the timeout. Returns
    (message, seconds, what a later call raised)."""
    from torch_cam import afd
    ch = _channel(spec, timeout=4.0)
    victim = spec["ffn" if who == "ffn" else "attn"][0]
    attn = rank in spec["attn"]
    a = spec["attn"].index(rank) if attn else None
    # Message 1 goes through.
    if attn:
        x, ids, w = batch(spec, a, 0, 0)
        ch.recv(ch.send(x, ids, w, layer=0))
    else:
        _ffn_step(ch, spec, 0, 0, False, check_rows=False)
    dist.barrier()
    if rank == victim:
        if how == "dies":
            os._exit(0)
        time.sleep(7.0)   # frozen past the others' 4 s timeout, then gone
        os._exit(0)
    t0 = time.monotonic()
    try:
        if attn:
            x, ids, w = batch(spec, a, 1, 0)
            ch.recv(ch.send(x, ids, w, layer=1))
        else:
            _ffn_step(ch, spec, 1, 0, False, check_rows=False)
        return ("no error", time.monotonic() - t0)
    except afd.AfdError as e:
        err = (f"{type(e).__name__}: {e}", time.monotonic() - t0)
    try:   # broken now: later calls raise at once
        ch.recv_tokens() if not attn else ch.send(x, ids, w, layer=2)
        again = "no error"
    except afd.AfdError as e:
        again = str(e)
    return err + (again,)


def _cam_names_worker(rank, world, init_file):
    """CAM's a2e / e2a (expert ranks first, one expert each) and the split async ops
    (attention ranks first), against the reference."""
    from torch_cam import afd, afd_reference
    _init(rank, world, init_file)
    pg = dist.group.WORLD
    H, K, bs = 32, 2, 6
    # a2e / e2a: ranks 0, 1 experts; 2, 3 attention.
    spec = dict(hidden=H, topk=K, experts_per_rank=1, ffn=[0, 1], attn=[2, 3], dtype=torch.bfloat16, bs=[bs, bs])
    for step in range(2):
        data = [batch(dict(spec, seed=step), a, 0, 0) for a in range(2)]
        if rank >= 2:
            x, ids, w = data[rank - 2]
            outs = afd.a2e(x, ids, w, bs, H, K, 2, 2, rank, pg.group_name, aiv_num=4)
            assert outs[3].tolist() == [bs]
            got = afd.e2a(x, outs[3], bs, H, K, 2, 2, rank, pg.group_name)
            want = afd_reference.exchange([d[0] for d in data], [d[1] for d in data], [d[2] for d in data],
                                          lambda e, r, s: r.float(), experts_per_rank=1, num_ffn=2)[rank - 2]
            assert torch.equal(got, want), f"a2e/e2a step {step}: differs"
        else:
            ph = torch.empty(0, H, dtype=torch.bfloat16)
            expand_x, eids, scales, sizes, mask = afd.a2e(ph, torch.empty(0, K, dtype=torch.int32), torch.empty(0, K),
                                                          bs, H, K, 2, 2, rank, pg.group_name)
            assert sizes.tolist() == [bs, bs] and bool((eids == rank).all()) and mask.shape[0] == expand_x.shape[0]
            afd.e2a(expand_x.clone(), sizes, bs, H, K, 2, 2, rank, pg.group_name)
    # Split ops: ranks 0, 1 attention; 2, 3 moe with 3 experts each; two layers, two dispatches
    # in flight.
    spec = dict(hidden=H, topk=K, experts_per_rank=3, ffn=[2, 3], attn=[0, 1], dtype=torch.float16, bs=[bs, bs])
    common = dict(moe_rank_num=2, attn_rank_num=2, route_expert_num_per_moe=3, world_size=4)
    anchor = torch.zeros(1, dtype=torch.float16)
    for layer in range(2):
        if rank < 2:
            sent = []
            for mb in range(2):
                x, ids, w = batch(spec, rank, layer, mb)
                afd.moe_dispatch_send_async(x, ids, anchor, 0, max_seq_len=bs, batch_size=bs, hidden_size=H,
                                            top_k=K, attn_rank_id=rank, layer_index=layer, tp_size=1,
                                            dynamic_quant=0, group_name=pg.group_name, **common)
                sent.append(mb)
            for mb in sent:
                data = [batch(spec, a, layer, mb) for a in range(2)]
                got = afd.moe_combine_recv_async(anchor, data[rank][1], data[rank][2], anchor, 0, bs, H, K,
                                                 attn_rank_id=rank, group_name=pg.group_name, **common)
                want = afd_reference.exchange([d[0] for d in data], [d[1] for d in data], [None, None], expert_fn,
                                              weights_at_recv=[d[2] for d in data], experts_per_rank=3,
                                              num_ffn=2)[rank]
                assert torch.equal(got, want), f"split ops layer {layer} mb {mb}: differs"
        else:
            for mb in range(2):
                rows, scales, info, counts = afd.moe_dispatch_recv_async(
                    anchor, anchor, 0, bs, H, K, moe_rank_id=rank, tp_size=1, dynamic_quant=0,
                    group_name=pg.group_name, **common)
                assert int(info[1]) == layer and int(counts.sum()) == rows.shape[0]
                out = torch.empty_like(rows)
                start = 0
                for j, c in enumerate(counts.tolist()):
                    out[start:start + c] = expert_fn((rank - 2) * 3 + j, rows[start:start + c], None)
                    start += c
                afd.moe_combine_send_async(out, anchor, info, 0, bs, H, K, moe_rank_id=rank, tp_size=1,
                                           group_name=pg.group_name, **common)
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


BASE = dict(hidden=64, topk=2, experts_per_rank=4, max_tokens=16, dtype=torch.float32, layers=3,
            micro_batches=2)


class AfdExchangeTest(unittest.TestCase):
    def run_spec(self, world, spec, deadline=120):
        res = run_ranks(_exchange_worker, world, spec, deadline_s=deadline)
        assert_all_ok(self, res)
        for r, (_, n) in res.items():
            self.assertEqual(n, spec["layers"] * spec["micro_batches"], f"rank {r} checked {n} exchanges")

    def test_1to1_fp32_shared_empty_microbatch(self):
        self.run_spec(2, dict(BASE, attn=[0], ffn=[1], shared=True, bs=[[16, 0]], unrouted=0.2))

    def test_2to2_bf16_interleaved_ranks(self):
        self.run_spec(4, dict(BASE, attn=[1, 3], ffn=[0, 2], dtype=torch.bfloat16, shared=True,
                              bs=[[16, 5], [3, 16]], topk=3, weight_dtype=torch.bfloat16))

    def test_2to2_weights_at_recv(self):
        # Rows travel back unsummed; the attention rank weights them (CAM's split ops do this).
        self.run_spec(4, dict(BASE, attn=[0, 1], ffn=[2, 3], dtype=torch.bfloat16, shared=True, bs=[[16, 3], [0, 9]],
                              weights_at_recv=True, unrouted=0.2))

    def test_2to2_int8(self):
        self.run_spec(4, dict(BASE, attn=[0, 1], ffn=[2, 3], dtype=torch.bfloat16, shared=True, quant=True,
                              bs=[[16, 9], [12, 1]], zero_copy=True))

    def test_3to1_fp16_uneven_batches(self):
        self.run_spec(4, dict(BASE, attn=[0, 1, 2], ffn=[3], dtype=torch.float16, bs=[[16, 2], [7, 0], [1, 11]],
                              unrouted=0.3, experts_per_rank=6, topk=4, zero_copy=True))

    def test_2to4_bf16_experts_on_some_ffn_ranks(self):
        # 64 experts, tokens only routed to experts of ffn ranks 0 and 1: ffn ranks 2 and 3 get none.
        self.run_spec(6, dict(BASE, attn=[0, 1], ffn=[2, 3, 4, 5], dtype=torch.bfloat16, experts_per_rank=16,
                              topk=8, expert_pool=list(range(32)), bs=[[16, 4], [8, 16]], shared=True), deadline=180)

    def test_3to1_fp16_int8(self):
        self.run_spec(4, dict(BASE, attn=[0, 1, 2], ffn=[3], dtype=torch.float16, bs=[[16, 5], [2, 16], [0, 7]],
                              quant=True, layers=2))


    def test_cam_names(self):
        assert_all_ok(self, run_ranks(_cam_names_worker, 4, deadline_s=120))


class AfdErrorTest(unittest.TestCase):
    SPEC = dict(BASE, attn=[0, 1], ffn=[2, 3], bs=[[16, 16], [16, 16]], layers=2)

    def check_case(self, case, expect_all, pattern):
        res = run_ranks(_mismatch_worker, 4, self.SPEC, case, deadline_s=90)
        assert_all_ok(self, res)
        for r in expect_all:
            seen, elapsed = res[r][1]
            self.assertTrue(seen, f"{case}: rank {r} raised nothing")
            self.assertRegex(seen[0], pattern, f"{case}: rank {r}")
            self.assertLess(elapsed, 10.0, f"{case}: rank {r} took {elapsed:.1f} s")

    def test_expert_id_out_of_range(self):
        self.check_case("expert_id", [0, 1, 2, 3], r"expert id 11 is outside \[-1, 8\)")

    def test_duplicate_expert(self):
        self.check_case("duplicate", [0, 1, 2, 3], r"appears in slots 0 and 1")

    def test_batch_too_large(self):
        self.check_case("big_batch", [0, 1, 2, 3], r"batch of 17 tokens exceeds the channel's max_tokens 16")

    def test_attention_layers_differ(self):
        self.check_case("attn_layer", [0, 1, 2, 3], r"layer 5")

    def test_ffn_expects_another_layer(self):
        # ffn rank 2 expects layer 3: it and both attention ranks raise; ffn rank 3 was right.
        self.check_case("ffn_layer", [0, 1, 2], r"ffn rank 2 expected layer 3 micro-batch 0, attention rank 0 sent "
                                                r"layer 0 micro-batch 0")

    def test_wrong_role_and_slots(self):
        spec = dict(BASE, attn=[0], ffn=[1], bs=[[16, 16]], slots=3)
        res = run_ranks(_role_worker, 2, spec, deadline_s=60)
        assert_all_ok(self, res)
        attn, ffn = res[0][1], res[1][1]
        self.assertRegex(attn[0], r"recv_tokens is an ffn rank's call; this rank is an attention rank")
        self.assertRegex(ffn[0], r"send is an attention rank's call; this rank is an ffn rank")
        self.assertRegex(attn[1], r"layer 0 micro-batch 0 is already in flight")
        self.assertEqual(attn[2], "accepted (0, 1)")
        self.assertRegex(attn[3], r"slot 0 still holds layer 0 micro-batch 0 \(message 1\): recv it first")
        self.assertRegex(attn[4], r"send_buffer .* the next slot \(0\) still holds layer 0 micro-batch 0")
        self.assertRegex(ffn[1], r"attention rank 0 refused layer 0 micro-batch 0: layer 0 micro-batch 0 is "
                                 r"already in flight \(message 1\)")
        self.assertEqual(len(ffn), 2)

    def test_config_mismatch(self):
        res = run_ranks(_config_worker, 2, deadline_s=60)
        assert_all_ok(self, res)
        for r in (0, 1):
            self.assertRegex(res[r][1], r"hidden=64.*hidden=32|hidden=32.*hidden=64")


def _config_worker(rank, world, init_file):
    from torch_cam import afd
    _init(rank, world, init_file)
    try:
        afd.AfdChannel(attention_ranks=[0], ffn_ranks=[1], experts_per_rank=2, hidden=64 if rank == 0 else 32,
                       topk=1, max_tokens=4)
        return "no error"
    except afd.AfdError as e:
        return str(e)
    finally:
        dist.destroy_process_group()


class AfdFailureTest(unittest.TestCase):
    SPEC = dict(BASE, attn=[0, 1], ffn=[2, 3], bs=[[8, 8], [8, 8]])

    def check(self, who, how, pattern):
        victim = self.SPEC["ffn" if who == "ffn" else "attn"][0]
        res = run_ranks(_dead_worker, 4, self.SPEC, who, how, deadline_s=90, allow_died=(victim,))
        # Ranks that wait on the victim: for a dead ffn rank, both attention ranks (the other
        # ffn rank serves its share and is not waiting); for a dead attention rank, both ffn ranks.
        waiting = [0, 1] if who == "ffn" else [2, 3]
        for r in waiting:
            status, value = res[r]
            self.assertEqual(status, "ok", value)
            msg, elapsed, again = value
            self.assertRegex(msg, pattern, f"rank {r}")
            self.assertLess(elapsed, 8.0, f"rank {r} took {elapsed:.1f} s")
            self.assertRegex(again, r"the channel is broken", f"rank {r}")
        if who == "attention":
            # A dead attention rank reaches the other one through the ffn ranks' status at once;
            # a frozen one races the other's own equal timeout, so either account may come first.
            msg, elapsed = res[1][1][:2]
            pattern = (r"AfdError: .*ffn rank 2: .*rank 0 died" if how == "dies" else
                       r"ffn rank 2: .*rank 0 did not send message 2|AfdTimeout: .*rank 2 did not return layer 1")
            self.assertRegex(msg, pattern, "attention rank 1")
            self.assertLess(elapsed, 8.0, f"attention rank 1 took {elapsed:.1f} s")
        self.assertEqual(cam_segments(), [])

    def test_ffn_dies(self):
        self.check("ffn", "dies", r"AfdError: .*rank 2 died")

    def test_ffn_freezes(self):
        self.check("ffn", "freezes", r"AfdTimeout: .*rank 2 did not return layer 1 micro-batch 0 .* within 4 s")

    def test_attention_dies(self):
        self.check("attention", "dies", r"AfdError: .*rank 0 died")

    def test_attention_freezes(self):
        self.check("attention", "freezes", r"AfdTimeout: .*rank 0 did not send message 2")


if __name__ == "__main__":
    unittest.main()
