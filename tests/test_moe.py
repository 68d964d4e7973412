"""MoE dispatch / combine on cam against the pure-PyTorch reference (torch_cam.moe_reference),
at EP sizes 2, 4 and 8, over random routings (skewed loads, empty experts, masked tokens).

Every rank rebuilds every rank's inputs from a seed, runs the reference for the whole group
and checks its own outputs: unquantized dispatch bit for bit, int8 dispatch bit for bit too
(both sides round the same way), combine bit for bit where the accumulation order is the
reference's and within a tight tolerance where it is not (special experts)."""
import gc
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cam  # noqa: E402
from torch_cam import moe_reference as ref  # noqa: E402
from cam_testing import CamProcessGroupCase  # noqa: E402

H = 48


def routing(bs, K, M, seed, skew=True, empty=()):
    """(bs, K) int32 distinct expert ids per row: top-K of random scores, skewed towards the
    first experts, never choosing the experts in `empty`."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(bs, M, generator=g)
    if skew:
        scores[:, : max(1, M // 8)] += 1.5
    for e in empty:
        scores[:, e] = -1e9
    return scores.topk(K, dim=1).indices.to(torch.int32)


def tokens(bs, dtype, seed, h=H):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bs, h, generator=g) * 2).to(dtype)


def weights(bs, K, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(bs, K, generator=g).to(torch.float32)


def expert_fn(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """A stand-in expert: deterministic, rank-dependent, elementwise."""
    return (rows.float() * 0.5 + (rank + 1) * 0.25).to(rows.dtype)


class MoeCases(CamProcessGroupCase):
    timeout = timedelta(seconds=180)
    cam_options = {"window_bytes": 1 << 20}

    # ---- one case: all ranks' inputs, cam on this rank, reference for all ----
    def run_case(self, *, M, K, dtype=torch.bfloat16, bss=None, S=0, quant=0, smooth=False,
                 mask=None, global_bs=0, ent_type=1, v2=False, comm_quant=0, shared_x=False,
                 special=(0, 0, 0), seed=0, empty=(), with_scales=True, group=None, ranks=None,
                 tp=0, tp_group=None, exact_combine=True):
        pg = group or self.pg
        W = pg.size() if tp == 0 else pg.size()
        r = pg.rank()
        n_all = len(ranks) if ranks is not None else W
        bss = bss or [8] * n_all
        zero_n, copy_n, const_n = special
        M_all = M + zero_n + copy_n + const_n
        xs = [tokens(bss[g], dtype, seed * 100 + g) for g in range(n_all)]
        ids = [routing(bss[g], K, M_all, seed * 100 + 50 + g, empty=empty) for g in range(n_all)]
        ws = [weights(bss[g], K, seed * 100 + 70 + g) for g in range(n_all)] if with_scales else None
        masks = None
        if mask == "1d":
            masks = [torch.arange(bss[g]) < max(1, bss[g] - 1 - g % 3) for g in range(n_all)]
        elif mask == "2d":
            masks = [torch.rand(bss[g], K, generator=torch.Generator().manual_seed(seed + g)) > 0.3 for g in range(n_all)]
        scales = None
        if smooth:
            scales = torch.rand(M + (1 if S else 0), H, generator=torch.Generator().manual_seed(seed + 7)) + 0.5
        g_me = ranks.index(dist.get_rank()) if ranks is not None else r
        kw = dict(scales=scales, x_active_mask=None if masks is None else masks[g_me],
                  expert_scales=None if ws is None else ws[g_me], shared_expert_rank_num=S,
                  quant_mode=quant, global_bs=global_bs, expert_token_nums_type=ent_type)
        if tp:
            kw.update(group_tp=tp_group, tp_world_size=tp, tp_rank_id=g_me % tp)
        perf = torch.zeros(W, dtype=torch.int64)
        if v2:
            kw.update(zero_expert_num=zero_n, copy_expert_num=copy_n, const_expert_num=const_n,
                      performance_info=perf)
            out = torch_cam.moe_distribute_dispatch_v2(xs[g_me], ids[g_me], pg, W, r, M, **kw)
        else:
            out = torch_cam.moe_distribute_dispatch(xs[g_me], ids[g_me], pg, W, r, M, **kw)
        expand_x, dyn, idx, etn, counts, tpc, escales = out
        want = ref.dispatch(xs, ids, M, scales=scales, x_active_mask=masks, expert_scales=ws,
                            tp_world_size=tp, shared_expert_rank_num=S, quant_mode=quant,
                            global_bs=global_bs, expert_token_nums_type=ent_type)[g_me]
        n = want["n_valid"]
        what = f"rank {g_me} M {M} K {K} {dtype} S {S} quant {quant} mask {mask} tp {tp}"
        self.assertEqual(tuple(expand_x.shape), tuple(want["expand_x"].shape), what)
        self.assertEqual(expand_x.dtype, want["expand_x"].dtype, what)
        self.assertTrue(torch.equal(expand_x[:n], want["expand_x"][:n]), what)
        self.assertTrue(torch.equal(counts, want["ep_recv_counts"]), f"{what}: {counts} vs {want['ep_recv_counts']}")
        self.assertTrue(torch.equal(tpc, want["tp_recv_counts"]), what)
        self.assertTrue(torch.equal(etn, want["expert_token_nums"]), f"{what}: {etn} vs {want['expert_token_nums']}")
        if quant:
            self.assertTrue(torch.equal(dyn[:n], want["dynamic_scales"][:n]), what)
        else:
            self.assertIsNone(dyn)
        if ws is not None:
            self.assertTrue(torch.equal(escales[:n], want["expand_scales"][:n]), what)
        if v2:
            A = want["assist_info_for_combine"].numel() // 128
            mine = idx.view(-1, 128)[:, :3]
            theirs = want["assist_info_for_combine"].view(-1, 128)[:, :3]
            n_own = int(counts[len(counts) // max(tp, 1) - 1])
            self.assertTrue(torch.equal(mine[:n_own], theirs[:n_own]), what)
            self.assertEqual(A, idx.numel() // 128)
            self.assertEqual(int(perf[r]), 0, "no wait for itself")
            self.assertTrue(bool((perf >= 0).all()), perf)
        else:
            self.assertTrue(torch.equal(idx, want["expand_idx"]), what)

        # combine: every rank's expert output from the reference's dispatch result
        all_disp = ref.dispatch(xs, ids, M, scales=scales, x_active_mask=masks, expert_scales=ws,
                                tp_world_size=tp, shared_expert_rank_num=S, quant_mode=quant,
                                global_bs=global_bs, expert_token_nums_type=ent_type)
        def y_of(g):
            d = all_disp[g]
            rows = d["expand_x"].float() * d["dynamic_scales"][:, None] if quant else d["expand_x"]
            out_dtype = dtype
            return expert_fn(rows.to(out_dtype), g)
        ys = [y_of(g) for g in range(n_all)]
        sxs = [tokens(bss[g], dtype, seed * 100 + 90 + g) for g in range(n_all)] if shared_x else None
        ori = xs
        const_args = {}
        if const_n:
            gen = torch.Generator().manual_seed(seed + 11)
            const_args = dict(const_expert_alpha_1=torch.rand(const_n, H, generator=gen),
                              const_expert_alpha_2=torch.rand(const_n, H, generator=gen),
                              const_expert_v=torch.rand(const_n, H, generator=gen))
        ckw = dict(tp_send_counts=tpc, x_active_mask=kw["x_active_mask"], shared_expert_rank_num=S,
                   global_bs=global_bs, comm_quant_mode=comm_quant,
                   shared_expert_x=None if sxs is None else sxs[g_me])
        if tp:
            ckw.update(group_tp=tp_group, tp_world_size=tp, tp_rank_id=g_me % tp)
        y_me = ys[g_me]
        if v2:
            got = torch_cam.moe_distribute_combine_v2(
                y_me, ids[g_me], idx, counts, None if ws is None else ws[g_me], pg, W, r, M,
                zero_expert_num=zero_n, copy_expert_num=copy_n, const_expert_num=const_n,
                ori_x=xs[g_me], **const_args, **ckw)
        else:
            got = torch_cam.moe_distribute_combine(y_me, ids[g_me], idx, counts,
                                                   None if ws is None else ws[g_me], pg, W, r, M, **ckw)
        want_c = ref.combine(ys, ids, [d["expand_idx"] for d in all_disp],
                             [d["ep_recv_counts"] for d in all_disp], ws, M,
                             tp_send_counts=[d["tp_recv_counts"] for d in all_disp], x_active_mask=masks,
                             shared_expert_x=sxs, tp_world_size=tp, shared_expert_rank_num=S,
                             comm_quant_mode=comm_quant, ori_x=ori if v2 else None,
                             zero_expert_num=zero_n, copy_expert_num=copy_n, const_expert_num=const_n,
                             **const_args)[g_me]
        self.assertEqual(got.dtype, want_c.dtype)
        if exact_combine:
            self.assertTrue(torch.equal(got, want_c), f"{what}: combine {tuple(got.shape)} vs {tuple(want_c.shape)} max diff {(got.float() - want_c.float()).abs().max() if got.numel() and got.shape == want_c.shape else None}")
        else:
            torch.testing.assert_close(got.float(), want_c.float(), rtol=2e-2, atol=2e-2, msg=what)
        return got

    # ---- the cases ----
    def test_dispatch_combine_basic(self):
        W = self.world_size
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            self.run_case(M=2 * W, K=min(4, 2 * W), dtype=dtype, seed=1)

    def test_many_local_experts_and_empty_experts(self):
        W = self.world_size
        M = 512 if W == 2 else 16 * W
        self.run_case(M=M, K=8, bss=[16] * W, seed=2, empty=(0, 3, M - 1))

    def test_int8_quant(self):
        W = self.world_size
        self.run_case(M=2 * W, K=3, quant=2, seed=3)
        self.run_case(M=2 * W, K=3, quant=2, smooth=True, seed=4, dtype=torch.float16)

    def test_masks(self):
        W = self.world_size
        self.run_case(M=2 * W, K=3, mask="1d", seed=5)
        self.run_case(M=2 * W, K=3, mask="2d", seed=6)

    def test_global_bs_uneven_batches(self):
        W = self.world_size
        bss = [3 + (g * 5) % 7 for g in range(W)]
        self.run_case(M=W, K=2, bss=bss, global_bs=max(bss) * W, seed=7)
        self.run_case(M=W, K=2, bss=[0] + [4] * (W - 1), global_bs=4 * W, seed=8)

    def test_expert_token_nums_type0_no_weights(self):
        W = self.world_size
        self.run_case(M=4 * W, K=4, ent_type=0, with_scales=False, seed=9)

    def test_shared_expert_ranks(self):
        W = self.world_size
        self.run_case(M=2 * (W - 1), K=2, S=1, seed=10, bss=[7] * W)
        if W >= 4:
            self.run_case(M=W - 2, K=1, S=2, seed=11, bss=[5] * W, quant=2, smooth=True)
        self.run_case(M=2 * (W - 1), K=2, S=1, seed=12, mask="1d", shared_x=True)

    def test_v2_assist_info_and_special_experts(self):
        W = self.world_size
        self.run_case(M=2 * W, K=3, v2=True, seed=13)
        self.run_case(M=2 * W, K=4, v2=True, special=(1, 1, 2), seed=14, exact_combine=False)

    def test_comm_quant_combine(self):
        W = self.world_size
        self.run_case(M=2 * W, K=3, comm_quant=2, seed=15)

    def test_consecutive_layers(self):
        """Dispatch and combine back to back over several 'layers' with no barrier: the stage's
        two halves alternate; results stay right and its size stays put."""
        W = self.world_size
        sizes = []
        for layer in range(6):
            self.run_case(M=2 * W, K=2, seed=20 + layer % 2, quant=2 if layer % 2 else 0)
            sizes.append(torch_cam.get_cam_backend().stats()["moe_stage_bytes"])
        # Sized by the largest call: once both halves have seen both loads, nothing grows.
        self.assertEqual(sizes[2:], [sizes[2]] * 4, sizes)

    def test_performance_info_names_the_late_rank(self):
        W, r = self.world_size, self.rank
        x = tokens(4, torch.bfloat16, r)
        ids = routing(4, 2, 2 * W, 80 + r)
        perf = torch.zeros(W, dtype=torch.int64)
        dist.barrier()
        if r == W - 1:
            time.sleep(0.3)
        out = torch_cam.moe_distribute_dispatch_v2(x, ids, self.pg, W, r, 2 * W, performance_info=perf)
        torch_cam.moe_distribute_combine_v2(out[0], ids, out[2], out[4], None, self.pg, W, r, 2 * W,
                                            performance_info=perf)
        if r != W - 1:
            self.assertGreater(int(perf[W - 1]), 150_000, perf)
            self.assertEqual(int(perf.argmax()), W - 1, perf)

    def test_group_name_and_cam_names(self):
        W, r = self.world_size, self.rank
        x = tokens(4, torch.bfloat16, 1000 + r)
        ids = routing(4, 2, 2 * W, 2000 + r)
        w = weights(4, 2, 3000 + r)
        a = torch_cam.moe_distribute_dispatch(x, ids, self.pg.group_name, W, r, 2 * W, expert_scales=w)
        b = torch_cam.moe_dispatch_shmem(x, ids, None, None, W, r, 2 * W, 0, 0, 0, 1, 0, 0, 0, 1, self.pg)
        n = int(a[4][-1])
        self.assertTrue(torch.equal(a[0][:n], b[0][:n]))
        y = expert_fn(a[0], r)
        c1 = torch_cam.moe_distribute_combine(y, ids, a[2], a[4], w, self.pg, W, r, 2 * W)
        c2 = torch_cam.moe_combine_shmem(y, ids, b[2], b[4], w, None, None, None, None, None, None, W, r,
                                         2 * W, 0, 0, 0, 1, 0, 0, 0, self.pg)
        self.assertTrue(torch.equal(c1, c2))

    def test_invalid_inputs_fail_everywhere(self):
        """Bad input on one rank raises on every rank, naming the rank and what was expected,
        and the group stays usable."""
        W, r = self.world_size, self.rank
        M = 2 * W
        x = tokens(4, torch.bfloat16, r)
        good = routing(4, 2, M, 40 + r)

        def expect(pattern, fn):
            with self.assertRaisesRegex(Exception, pattern):
                fn()

        bad = good.clone()
        if r == W - 1:
            bad[2, 1] = M + 3
        expect(rf"rank {W - 1}.*expert_ids\[2, 1\] = {M + 3} is out of range",
               lambda: torch_cam.moe_distribute_dispatch(x, bad, self.pg, W, r, M))
        rep = good.clone()
        if r == 0:
            rep[1, 1] = rep[1, 0]
        expect(r"expert_ids\[1, 1\].*repeats", lambda: torch_cam.moe_distribute_dispatch(x, rep, self.pg, W, r, M))
        expect(r"moe_expert_num 3 must be a positive multiple",
               lambda: torch_cam.moe_distribute_dispatch(x, good % 3, self.pg, W, r, 3 if W > 1 else 2))
        # A batch larger than global_bs allows (the window/output would be too small).
        xb = tokens(6 if r == 0 else 4, torch.bfloat16, r)
        ib = routing(xb.shape[0], 2, M, 50 + r)
        expect(r"rank 0.* has 6 tokens, more than the 4 per rank",
               lambda: torch_cam.moe_distribute_dispatch(xb, ib, self.pg, W, r, M, global_bs=4 * W))
        expect(r"ep_rank_id is", lambda: torch_cam.moe_distribute_dispatch(
            x, good, self.pg, W, (r + 1) % W if r == 0 else r, M))
        # Tokens or expert outputs that are not in host memory (a meta tensor) are refused, not
        # read: every rank raises naming the bad rank.
        xm = torch.empty(4, H, dtype=torch.bfloat16, device="meta") if r == W - 1 else x
        expect(rf"(rank {W - 1} refused its arguments|on rank {W - 1}): x must be a dense CPU tensor, got one on meta",
               lambda: torch_cam.moe_distribute_dispatch(xm, good, self.pg, W, r, M))
        out = torch_cam.moe_distribute_dispatch(x, good, self.pg, W, r, M)
        expand_x, _, expand_idx, _, ep_recv_counts = out[:5]
        y = expert_fn(expand_x, r)
        ym = torch.empty(y.shape, dtype=y.dtype, device="meta") if r == 0 else y
        expect(r"(rank 0 refused its arguments|on rank 0): expand_x must be a dense CPU tensor, got one on meta",
               lambda: torch_cam.moe_distribute_combine(ym, good, expand_idx, ep_recv_counts, None, self.pg, W, r, M))
        # Fewer expert-output rows than dispatch served: refused before any row is read.
        served = torch.tensor([int(ep_recv_counts[-1])])
        dist.broadcast(served, group=self.pg, group_src=0)  # rank 0's count decides, on every rank alike
        if int(served) > 0:
            short = y[: int(served) - 1] if r == 0 else y
            expect(r"(rank 0 refused its arguments|on rank 0): segment \d+ \[\d+, \d+\) lies outside the \d+ "
                   r"expert output rows",
                   lambda: torch_cam.moe_distribute_combine(short, good, expand_idx, ep_recv_counts, None, self.pg,
                                                            W, r, M))
        # still usable
        self.run_case(M=M, K=2, seed=60)

    def test_heap_resident_tokens_and_expert_outputs(self):
        """Token rows and expert outputs that live in the tensor heap are read in place (not
        staged), and the results are the same as from ordinary tensors."""
        W, r = self.world_size, self.rank
        M, K = 2 * W, 3
        xs = [tokens(8, torch.bfloat16, 300 + g) for g in range(W)]
        ids = [routing(8, K, M, 400 + g) for g in range(W)]
        ws = [weights(8, K, 500 + g) for g in range(W)]
        x = torch_cam.empty(8, H, dtype=torch.bfloat16)
        x.copy_(xs[r])
        backend = torch_cam.get_cam_backend()
        staged = backend.stats()["staged_bytes"]
        out = torch_cam.moe_distribute_dispatch(x, ids[r], self.pg, W, r, M, expert_scales=ws[r])
        self.assertEqual(backend.stats()["staged_bytes"], staged, "heap-resident tokens were staged")
        want = ref.dispatch(xs, ids, M, expert_scales=ws)
        n = want[r]["n_valid"]
        self.assertTrue(torch.equal(out[0][:n], want[r]["expand_x"][:n]))
        y = torch_cam.empty(*out[0].shape, dtype=torch.bfloat16)
        y.copy_(expert_fn(out[0], r))
        staged = backend.stats()["staged_bytes"]
        got = torch_cam.moe_distribute_combine(y, ids[r], out[2], out[4], ws[r], self.pg, W, r, M)
        self.assertEqual(backend.stats()["staged_bytes"], staged, "heap-resident expert outputs were staged")
        ys = [expert_fn(d["expand_x"], g) for g, d in enumerate(want)]
        want_c = ref.combine(ys, ids, [d["expand_idx"] for d in want], [d["ep_recv_counts"] for d in want],
                             ws, M)[r]
        self.assertTrue(torch.equal(got, want_c))
        # The caller may overwrite its rows as soon as the op returns: peers are done with them.
        x.fill_(0)
        y.fill_(0)


class Moe2(MoeCases, MultiProcContinuousTest):
    world_size = 2


    def test_memory_bounded(self):
        """Resident memory after many dispatch/combine calls equals that after the first ones:
        the stage, the output pool and the plans do not grow per call."""
        W, r = self.world_size, self.rank
        x = tokens(32, torch.bfloat16, r, h=1024)
        w = weights(32, 4, r)

        def rss_kib():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

        def layers(n):
            for i in range(n):
                ids = routing(32, 4, 4 * W, 1000 * r + i % 7)
                out = torch_cam.moe_distribute_dispatch(x, ids, self.pg, W, r, 4 * W, expert_scales=w,
                                                        quant_mode=2 * (i % 2))
                y = out[0] if i % 2 == 0 else (out[0].float() * out[1][:, None]).to(torch.bfloat16)
                torch_cam.moe_distribute_combine(y, ids, out[2], out[4], w, self.pg, W, r, 4 * W)

        layers(100)
        before = rss_kib()
        stats = torch_cam.get_cam_backend().stats()
        layers(400)
        grown = rss_kib() - before
        after = torch_cam.get_cam_backend().stats()
        self.assertEqual(after["moe_stage_bytes"], stats["moe_stage_bytes"])
        self.assertLessEqual(after["moe_output_cache_bytes"], stats["moe_output_cache_bytes"] + (1 << 20))
        self.assertLess(grown, 4096, f"resident memory grew by {grown} KiB over 400 layers")

    def test_last_op_then_destroy(self):
        """A rank that finishes the group's last MoE op and destroys the group at once must not
        take the rows a slower peer is still reading with it. Rank 0 is frozen (SIGSTOP) after
        publishing its combine; rank 1 completes its own, destroys the group, then thaws rank 0,
        which only then reads rank 1's rows."""
        W, r = self.world_size, self.rank
        pids = [None] * W
        dist.all_gather_object(pids, os.getpid())
        g = dist.new_group(list(range(W)), backend="cam")
        x = tokens(16, torch.bfloat16, 500 + r)
        ids = routing(16, 2, 2 * W, 600 + r)
        w = weights(16, 2, 700 + r)
        out = torch_cam.moe_distribute_dispatch(x, ids, g, W, r, 2 * W, expert_scales=w)
        dist.barrier()
        if r == 0:
            got = torch_cam.moe_distribute_combine(out[0], ids, out[2], out[4], w, g, W, r, 2 * W)
        else:
            time.sleep(0.3)  # rank 0 has published and waits for the others
            if r == 1:
                os.kill(pids[0], signal.SIGSTOP)
            got = torch_cam.moe_distribute_combine(out[0], ids, out[2], out[4], w, g, W, r, 2 * W)
        dist.destroy_process_group(g)
        del g
        gc.collect()
        if r == 1:
            time.sleep(0.1)
            os.kill(pids[0], signal.SIGCONT)
        # identity experts: each token comes back as x * the sum of its weights
        want = (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        dist.barrier()


class Moe4(MoeCases, MultiProcContinuousTest):
    world_size = 4

    def test_tp2(self):
        """tp_world_size 2: EP groups {0, 2} and {1, 3}, TP pairs {0, 1} and {2, 3}."""
        eps = [dist.new_group([0, 2], backend="cam"), dist.new_group([1, 3], backend="cam")]
        tps = [dist.new_group([0, 1], backend="cam"), dist.new_group([2, 3], backend="cam")]
        g = dist.get_rank()
        ep, tpg = eps[g % 2], tps[g // 2]
        self.run_case(M=2, K=1, tp=2, group=ep, tp_group=tpg, ranks=[0, 1, 2, 3], seed=70,
                      bss=[6, 6, 6, 6])


class Moe8(MoeCases, MultiProcContinuousTest):
    world_size = 8


if __name__ == "__main__":
    run_tests()
