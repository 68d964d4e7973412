"""torch_cam.Buffer (DeepEP-style) on cam against torch_cam.moe_reference at 2, 4 and 8 ranks:
layout, normal dispatch/combine (with topk weights, biases, fp8 rows, cached handles,
num_worst_tokens, async completion) and low-latency dispatch/combine (bf16 and fp8 slabs,
recv hooks, zero-copy combine buffers)."""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cam  # noqa: E402
from torch_cam import moe_reference as ref  # noqa: E402
from torch_cam.moe_buffer import Buffer, per_token_cast_to_fp8  # noqa: E402
from cam_testing import CamProcessGroupCase  # noqa: E402

H = 256


def topk(T, K, E, seed, drop=0):
    """(T, K) int64 distinct expert ids per row, `drop` random slots set to -1."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, E, generator=g)
    scores[:, : max(1, E // 8)] += 1.0
    idx = scores.topk(K, dim=1).indices
    if drop:
        flat = torch.randperm(T * K, generator=g)[:drop]
        idx.view(-1)[flat] = -1
    return idx


def xs_of(T, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(dtype)


class BufferCases(CamProcessGroupCase):
    timeout = timedelta(seconds=180)
    cam_options = {"window_bytes": 1 << 20}

    def inputs(self, seed, E, K=4, drop=3, same_T=False):
        R = self.world_size
        Ts = [6 if same_T else 3 + (3 * g) % 7 for g in range(R)]
        xs = [xs_of(Ts[g], seed * 10 + g) for g in range(R)]
        idx = [topk(Ts[g], K, E, seed * 10 + 5 + g, drop=min(drop, Ts[g])) for g in range(R)]
        ws = [torch.rand(Ts[g], K, generator=torch.Generator().manual_seed(seed + g)) for g in range(R)]
        return xs, idx, ws

    def test_layout(self):
        R, r = self.world_size, self.rank
        buf = Buffer(self.pg)
        _, idx, _ = self.inputs(1, E=4 * R)
        got = buf.get_dispatch_layout(idx[r], 4 * R)
        want = ref.get_dispatch_layout(idx[r], 4 * R, R)
        for a, b in zip(got[:4], want):
            self.assertTrue((a is None and b is None) or torch.equal(a, b))

    def test_normal_dispatch_combine(self):
        R, r = self.world_size, self.rank
        E = 4 * R
        buf = Buffer(self.pg)
        for seed, align, worst, async_ in ((2, 1, 0, False), (3, 4, 0, True), (4, 1, 64, False)):
            xs, idx, ws = self.inputs(seed, E)
            ntr, _, nte, in_rank, _ = buf.get_dispatch_layout(idx[r], E)
            recv_x, recv_idx, recv_w, per_expert, handle, ev = buf.dispatch(
                xs[r], num_tokens_per_rank=ntr, is_token_in_rank=in_rank, num_tokens_per_expert=nte,
                topk_idx=idx[r], topk_weights=ws[r], expert_alignment=align, num_worst_tokens=worst,
                async_finish=async_)
            ev.current_stream_wait()
            want = ref.normal_dispatch(xs, idx, ws, E, expert_alignment=align, num_worst_tokens=worst)[r]
            what = f"rank {r} seed {seed}"
            self.assertTrue(torch.equal(recv_x, want["recv_x"]), what)
            self.assertTrue(torch.equal(recv_idx, want["recv_topk_idx"]), what)
            self.assertTrue(torch.equal(recv_w, want["recv_topk_weights"]), what)
            self.assertEqual(per_expert, want["num_recv_tokens_per_expert_list"], what)
            self.assertTrue(torch.equal(handle[0], want["rank_prefix_matrix"]), what)
            self.assertTrue(torch.equal(handle[3], want["recv_src_idx"]), what)
            self.assertTrue(torch.equal(handle[5], want["send_pos"]), what)
            # combine each rank's (transformed) rows back, with a bias pair and the weights
            ys = [ref_x.float().mul(0.5).add(j).to(torch.bfloat16) for j, ref_x in
                  enumerate(d["recv_x"] for d in ref.normal_dispatch(xs, idx, ws, E, num_worst_tokens=worst))]
            biases = ([xs_of(xs[g].shape[0], 900 + g) for g in range(R)], [xs_of(xs[g].shape[0], 950 + g) for g in range(R)])
            wrecv = [d["recv_topk_weights"] for d in ref.normal_dispatch(xs, idx, ws, E, num_worst_tokens=worst)]
            comb, comb_w, ev2 = buf.combine(ys[r], handle, topk_weights=wrecv[r],
                                            bias=(biases[0][r], biases[1][r]), async_finish=async_)
            ev2.current_stream_wait()
            disp_all = ref.normal_dispatch(xs, idx, ws, E, num_worst_tokens=worst)
            want_c, want_w = ref.normal_combine(ys, disp_all, wrecv, bias=biases)[r]
            self.assertTrue(torch.equal(comb, want_c), f"{what}: {(comb.float() - want_c.float()).abs().max()}")
            self.assertTrue(torch.equal(comb_w, want_w), what)
            # cached dispatch: same layout, new data
            x2 = xs_of(xs[r].shape[0], 777 + r)
            again, _, _, _, _, _ = buf.dispatch(x2, handle=handle, num_worst_tokens=worst)
            want2 = ref.normal_dispatch([xs_of(xs[g].shape[0], 777 + g) for g in range(R)], idx, ws, E,
                                        num_worst_tokens=worst)[r]["recv_x"]
            self.assertTrue(torch.equal(again, want2), what)

    def test_normal_fp8(self):
        R, r = self.world_size, self.rank
        E = 2 * R
        buf = Buffer(self.pg)
        xs, idx, ws = self.inputs(5, E)
        q = [per_token_cast_to_fp8(x) for x in xs]
        ntr, _, nte, in_rank, _ = buf.get_dispatch_layout(idx[r], E)
        (rx, rs), _, _, _, handle, _ = buf.dispatch(q[r], is_token_in_rank=in_rank, num_tokens_per_rank=ntr,
                                                    num_tokens_per_expert=nte, topk_idx=idx[r], topk_weights=ws[r])
        want_x = ref.normal_dispatch([a.view(torch.uint8) for a, _ in q], idx, ws, E)[r]["recv_x"]
        want_s = ref.normal_dispatch([s for _, s in q], idx, ws, E)[r]["recv_x"]
        self.assertTrue(torch.equal(rx.view(torch.uint8), want_x))
        self.assertTrue(torch.equal(rs, want_s))

    def test_low_latency(self):
        R, r = self.world_size, self.rank
        E, K, max_t = 2 * R, 3, 12
        buf = Buffer(self.pg, low_latency_mode=True)
        for seed, fp8, hook_mode, zero_copy in ((6, False, False, False), (7, True, True, False), (8, False, False, True)):
            xs, idx, ws = self.inputs(seed, E, K=K, drop=4)
            stats = torch.zeros(E // R, dtype=torch.int32)
            recv_x, recv_count, handle, ev, hook = buf.low_latency_dispatch(
                xs[r], idx[r], max_t, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8,
                return_recv_hook=hook_mode)
            if hook_mode:
                hook()
            want = ref.low_latency_dispatch(xs, idx, max_t, E)[r]
            what = f"rank {r} seed {seed} fp8 {fp8}"
            self.assertTrue(torch.equal(recv_count, want["recv_count"]), what)
            self.assertTrue(torch.equal(stats, want["recv_count"]), what)
            self.assertTrue(torch.equal(handle[1], want["layout_range"]), what)
            L = E // R
            for i in range(L):
                n = int(recv_count[i])
                self.assertTrue(torch.equal(handle[0][i, :n], want["src_info"][i, :n]), what)
                if fp8:
                    q, s = recv_x
                    deq = (q[i, :n].float().view(n, H // 128, 128) * s[i, :n, :, None]).view(n, H)
                    torch.testing.assert_close(deq, want["recv_x"][i, :n].float(), rtol=0.07, atol=0.02)
                else:
                    self.assertTrue(torch.equal(recv_x[i, :n], want["recv_x"][i, :n]), what)
            # combine: experts scale their rows
            ys_all = [d["recv_x"].float().mul(1.5).add(j).to(torch.bfloat16)
                      for j, d in enumerate(ref.low_latency_dispatch(xs, idx, max_t, E))]
            y = ys_all[r]
            if zero_copy:
                buffer = buf.get_next_low_latency_combine_buffer(handle)
                self.assertTrue(torch_cam.is_heap_tensor(buffer))
                buffer.copy_(y)
                y = buffer
            comb, ev2, hook2 = buf.low_latency_combine(y, idx[r], ws[r], handle, zero_copy=zero_copy,
                                                       return_recv_hook=hook_mode)
            if hook_mode:
                hook2()
            want_c = ref.low_latency_combine(ys_all, idx, ws, ref.low_latency_dispatch(xs, idx, max_t, E))[r]
            self.assertTrue(torch.equal(comb, want_c), f"{what}: {(comb.float() - want_c.float()).abs().max()}")


    def test_low_latency_too_many_tokens_fails_everywhere(self):
        R, r = self.world_size, self.rank
        buf = Buffer(self.pg, low_latency_mode=True)
        T = 5 if r == R - 1 else 2
        with self.assertRaisesRegex(RuntimeError, rf"rank {R - 1}.* has 5 tokens, more than the 4 per rank"):
            buf.low_latency_dispatch(xs_of(T, r), topk(T, 2, 2 * R, r), 4, 2 * R, use_fp8=False)
        self.test_low_latency()  # still usable


class Buffer2(BufferCases, MultiProcContinuousTest):
    world_size = 2


class Buffer4(BufferCases, MultiProcContinuousTest):
    world_size = 4


class Buffer8(BufferCases, MultiProcContinuousTest):
    world_size = 8


if __name__ == "__main__":
    run_tests()
