"""Single-process tests of the MoE dispatch/combine reference (torch_cam.moe_reference) on small
hand-computed cases. The reference is the ground truth of the multi-process tests, so it is checked
here against values worked out by hand from docs moe-semantics.md sections 5.3-5.5."""
import pytest
import torch

from torch_cam import moe_reference as ref

H = 4


def tagged(values, dtype=torch.float32, h=H):
    """Rows whose every channel equals the given value (identifies the source of a received row)."""
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1).repeat(1, h).to(dtype)


def col(t):
    return t[:, 0].tolist()


# Base case: W=2, M=4 (L=2), BS=3, K=2; x[r][t] = 10*r + t + 1.
IDS = [torch.tensor([[0, 2], [1, 0], [3, 2]], dtype=torch.int32),
       torch.tensor([[2, 1], [0, 3], [1, 2]], dtype=torch.int32)]
XS = [tagged([1, 2, 3]), tagged([11, 12, 13])]
WS = [torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.125, 4.0]]),
      torch.tensor([[3.0, 0.5], [1.5, 0.75], [2.5, 1.25]])]


def test_dispatch_basic_layout():
    out = ref.dispatch(XS, IDS, 4, expert_scales=WS)
    r0, r1 = out
    assert r0["A"] == 12 and r0["expand_x"].shape == (12, H) and r0["expand_x"].dtype == torch.float32
    # (local expert, source rank, token) order
    assert col(r0["expand_x"][:6]) == [1, 2, 12, 2, 11, 13]
    assert col(r1["expand_x"][:6]) == [1, 3, 11, 13, 3, 12]
    assert (r0["expand_x"][6:] == 0).all() and (r1["expand_x"][6:] == 0).all()
    assert r0["ep_recv_counts"].tolist() == [2, 3, 4, 6]
    assert r1["ep_recv_counts"].tolist() == [2, 4, 5, 6]
    assert r0["ep_recv_counts"].dtype == torch.int32
    assert r0["expert_token_nums"].tolist() == [3, 3] and r0["expert_token_nums"].dtype == torch.int64
    assert r1["expert_token_nums"].tolist() == [4, 2]
    assert r0["tp_recv_counts"].tolist() == [6] and r1["tp_recv_counts"].tolist() == [6]
    assert r0["expand_idx"].tolist() == [0, 0, 0, 1, 0, 1]
    assert r1["expand_idx"].tolist() == [0, 0, 0, 0, 1, 1]
    assert r0["expand_idx"].dtype == torch.int32
    assert r0["dynamic_scales"] is None
    # expand_scales follow the rows
    assert r0["expand_scales"][:6].tolist() == [0.5, 2.0, 1.5, 1.0, 0.5, 2.5]
    assert (r0["expand_scales"][6:] == 0).all() and r0["expand_scales"].shape == (12,)
    # assist info: [src_rank, src_token, k_slot] per row
    a = r0["assist_info_for_combine"]
    assert a.shape == (12 * 128,) and a.dtype == torch.int32
    rows = a.view(12, 128)
    assert rows[:6, :3].tolist() == [[0, 0, 0], [0, 1, 1], [1, 1, 0], [0, 1, 0], [1, 0, 1], [1, 2, 0]]
    assert (rows[:, 3:] == 0).all() and (rows[6:] == 0).all()


def test_dispatch_prefix_type0_and_no_scales():
    out = ref.dispatch(XS, IDS, 4, expert_token_nums_type=0)
    assert out[0]["expert_token_nums"].tolist() == [3, 6]
    assert out[1]["expert_token_nums"].tolist() == [4, 6]
    assert out[0]["expand_scales"] is None


def test_dispatch_bf16_is_bitwise_copy():
    xs = [torch.randn(3, 8).to(torch.bfloat16) for _ in range(2)]
    out = ref.dispatch(xs, IDS, 4)
    assert out[0]["expand_x"].dtype == torch.bfloat16
    # row 2 of rank 0 is x1[1]; row 4 is x1[0]
    assert torch.equal(out[0]["expand_x"][2], xs[1][1])
    assert torch.equal(out[0]["expand_x"][4], xs[1][0])


def test_shared_expert_rank_s1():
    # W=3, S=1: rank 0 shared, ranks 1, 2 MoE with L=2; BS=3, K=2
    ids = [torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)] * 3
    xs = [tagged([1, 2, 3]), tagged([11, 12, 13]), tagged([21, 22, 23])]
    out = ref.dispatch(xs, ids, 4, shared_expert_rank_num=1, expert_scales=[torch.ones(3, 2)] * 3)
    s = out[0]
    assert s["A"] == 9 and s["expand_x"].shape == (9, H)
    assert col(s["expand_x"]) == [1, 2, 3, 11, 12, 13, 21, 22, 23]
    assert s["ep_recv_counts"].tolist() == [3, 6, 9]
    assert s["expert_token_nums"].tolist() == [9]
    assert (s["expand_scales"] == 0).all()
    rows = s["assist_info_for_combine"].view(9, 128)
    assert rows[:, :3].tolist() == [[r, t, -1] for r in range(3) for t in range(3)]
    # MoE rank 1 owns experts 0, 1: expert 0 gets token 0 of every source; expert 1 tokens 0, 2
    m = out[1]
    assert col(m["expand_x"][:9]) == [1, 11, 21, 1, 3, 11, 13, 21, 23]
    assert m["ep_recv_counts"].tolist() == [1, 2, 3, 5, 7, 9]
    assert m["A"] == 3 * 3 * 2
    # smooth-scale row of routed expert e is e+1 (checked via quantisation below)


def test_shared_expert_rank_s2_chunks():
    # W=4, S=2, M=4 (L=2), BS=3: chunks of rank 2 are [0,1), [1,3); of rank 3 [0,2), [2,3)
    ids = [torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)] * 4
    xs = [tagged([10 * r + t + 1 for t in range(3)]) for r in range(4)]
    out = ref.dispatch(xs, ids, 4, shared_expert_rank_num=2)
    s0, s1 = out[0], out[1]
    assert s0["A"] == 6 and s0["expand_x"].shape == (6, H)
    assert col(s0["expand_x"]) == [1, 2, 3, 21, 31, 32]
    assert s0["ep_recv_counts"].tolist() == [1, 3, 4, 6]
    assert col(s1["expand_x"]) == [11, 12, 13, 22, 23, 33]
    assert s1["ep_recv_counts"].tolist() == [2, 3, 5, 6]
    assert s0["expert_token_nums"].tolist() == [6]
    assert ref._shared_chunk(2, 0, 3, 2) == (0, 1) and ref._shared_chunk(3, 1, 3, 2) == (2, 3)


def test_shared_rank_mask_skips_inactive_tokens():
    ids = [torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)] * 3
    xs = [tagged([10 * r + t + 1 for t in range(3)]) for r in range(3)]
    masks = [torch.tensor([True, False, True]),
             torch.tensor([[False, False], [True, False], [False, True]]),
             None]
    out = ref.dispatch(xs, ids, 4, shared_expert_rank_num=1, x_active_mask=masks)
    s = out[0]
    assert col(s["expand_x"][:7]) == [1, 3, 12, 13, 21, 22, 23]
    assert s["ep_recv_counts"].tolist() == [2, 4, 7]
    assert s["expert_token_nums"].tolist() == [7]
    assert (s["expand_x"][7:] == 0).all()


def test_masks_1d_and_2d():
    m1 = [torch.tensor([True, False, True]), torch.tensor([True, True, True])]
    out = ref.dispatch(XS, IDS, 4, x_active_mask=m1)
    assert out[0]["expand_x"].shape == (12, H)                 # shapes do not depend on the mask
    # rank 0's token 1 (experts 1, 0) is gone
    assert col(out[0]["expand_x"][:4]) == [1, 12, 11, 13]
    assert out[0]["ep_recv_counts"].tolist() == [1, 2, 2, 4]
    assert out[0]["expand_idx"].tolist() == [0, 0, -1, -1, 0, 1]
    m2 = [torch.tensor([[True, False], [True, True], [False, True]]), torch.ones(3, 2, dtype=torch.bool)]
    out = ref.dispatch(XS, IDS, 4, x_active_mask=m2)
    assert out[0]["expand_idx"].tolist() == [0, -1, 0, 1, -1, 0]
    # rank 1 (experts 2, 3) gets expert 2 from rank 0 only via (2,1); expert 3 from rank 1 only
    assert col(out[1]["expand_x"][:4]) == [3, 11, 13, 12]
    assert out[1]["ep_recv_counts"].tolist() == [1, 3, 3, 4]


def test_special_experts_not_dispatched():
    ids = [torch.tensor([[0, 4], [5, 1], [3, 6]], dtype=torch.int32), IDS[1]]
    out = ref.dispatch(XS, ids, 4)
    assert out[0]["expand_idx"].tolist() == [0, -1, -1, 0, 0, -1]
    n0 = out[0]["ep_recv_counts"][-1] + out[1]["ep_recv_counts"][-1]
    assert int(n0) == 3 + 6


def test_global_bs_padding_and_ragged_bs():
    xs = [tagged([1, 2, 3]), tagged([11, 12])]
    ids = [IDS[0], IDS[1][:2]]
    out = ref.dispatch(xs, ids, 4, global_bs=8)                # max_bs = 4
    assert out[0]["A"] == 4 * 2 * 2 and out[0]["expand_x"].shape == (16, H)
    assert out[0]["assist_info_for_combine"].shape == (16 * 128,)
    assert col(out[0]["expand_x"][:5]) == [1, 2, 12, 2, 11]
    assert (out[0]["expand_x"][5:] == 0).all()
    with pytest.raises(ValueError):
        ref.dispatch(xs, ids, 4)                               # ragged BS needs global_bs
    with pytest.raises(ValueError):
        ref.dispatch(XS, IDS, 4, global_bs=4)                  # BS 3 > 4/2


def test_tp2_concatenation():
    # 4 global ranks, T=2 -> W=2, M=2 (L=1), K=2: every token goes to both experts.
    # tp-rank-0 group = global ranks 0, 2; tp-rank-1 group = global ranks 1, 3.
    ids = [torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)] * 4
    xs = [tagged([100 * g + t + 1 for t in range(2)]) for g in range(4)]
    out = ref.dispatch(xs, ids, 2, tp_world_size=2)
    # EP rank 0 (expert 0): tp0 group receives tokens of g0 then g2; tp1 group of g1 then g3
    own0 = [1, 2, 201, 202]
    own1 = [101, 102, 301, 302]
    assert out[0]["A"] == 2 * 2 * 1 and out[0]["expand_x"].shape == (8, H)
    assert col(out[0]["expand_x"]) == own0 + own1
    assert col(out[1]["expand_x"]) == own1 + own0
    assert out[0]["tp_recv_counts"].tolist() == [4, 4] and out[1]["tp_recv_counts"].tolist() == [4, 4]
    assert out[0]["ep_recv_counts"].tolist() == [2, 4, 2, 4]
    assert out[0]["expert_token_nums"].tolist() == [8]
    assert out[0]["assist_info_for_combine"].shape == (4 * 128,)
    assert out[0]["assist_info_for_combine"].view(4, 128)[:, :3].tolist() == \
        [[0, 0, 0], [0, 1, 1], [1, 0, 0], [1, 1, 1]]


def _identity_outputs(out, tp=1):
    ys = []
    for o in out:
        y = o["expand_x"].to(torch.float32)
        if o["dynamic_scales"] is not None:
            y = y * o["dynamic_scales"].unsqueeze(1)
        ys.append(y / tp)
    return ys


def _combine_from(out, ids, ws, m, **kw):
    return ref.combine(_identity_outputs(out, max(kw.get("tp_world_size", 0), 1)), ids,
                       [o["expand_idx"] for o in out], [o["ep_recv_counts"] for o in out], ws, m,
                       tp_send_counts=[o["tp_recv_counts"] for o in out], **kw)


def test_identity_combine_basic():
    xs = [torch.randn(3, 16) for _ in range(2)]
    out = ref.dispatch(xs, IDS, 4)
    res = _combine_from(out, IDS, WS, 4)
    for r in range(2):
        assert torch.allclose(res[r], xs[r] * WS[r].sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
    # exact accumulation order: k = 0, then k = 1
    exp = (torch.zeros(3, 16) + WS[0][:, 0:1] * xs[0]) + WS[0][:, 1:2] * xs[0]
    assert torch.equal(res[0], exp)


def test_identity_combine_shared_and_masks():
    ids = [torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)] * 4
    xs = [torch.randn(3, 8) for _ in range(4)]
    ws = [torch.rand(3, 2) for _ in range(4)]
    masks = [torch.tensor([True, False, True]),
             torch.tensor([[False, False], [True, False], [False, True]]),
             None,
             torch.tensor([True, True, False])]
    out = ref.dispatch(xs, ids, 4, shared_expert_rank_num=2, x_active_mask=masks)
    res = _combine_from(out, ids, ws, 4, shared_expert_rank_num=2, x_active_mask=masks)
    for r in range(4):
        allowed = ref._entry_activity(ids[r], masks[r], 4)[2]
        tok = ref._entry_activity(ids[r], masks[r], 4)[1]
        exp = xs[r] * (ws[r] * allowed).sum(1, keepdim=True) + xs[r]
        exp[~tok] = 0
        assert torch.allclose(res[r], exp, rtol=1e-5, atol=1e-6), r


def test_identity_combine_tp2_and_shared_expert_x():
    ids = [torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32)] * 4
    xs = [torch.randn(3, 8) for _ in range(4)]
    ws = [torch.rand(3, 2) for _ in range(4)]
    sx = [torch.randn(3, 1, 8) for _ in range(4)]               # 3-D shared_expert_x
    out = ref.dispatch(xs, ids, 2, tp_world_size=2)
    res = _combine_from(out, ids, ws, 2, tp_world_size=2, shared_expert_x=sx)
    for g in range(4):
        exp = xs[g] * ws[g].sum(1, keepdim=True) + sx[g].reshape(3, 8)
        assert torch.allclose(res[g], exp, rtol=1e-5, atol=1e-6)


def test_identity_combine_bf16_calc_diff():
    xs = [torch.randn(3, 64).to(torch.bfloat16) for _ in range(2)]
    out = ref.dispatch(xs, IDS, 4)
    ys = [o["expand_x"] for o in out]
    res = ref.combine(ys, IDS, [o["expand_idx"] for o in out], [o["ep_recv_counts"] for o in out], WS, 4)
    for r in range(2):
        assert res[r].dtype == torch.bfloat16
        assert ref.calc_diff(res[r].float(), xs[r].float() * WS[r].sum(1, keepdim=True)) < 1e-5


def test_special_experts_combine():
    # M=4, zero id 4, copy id 5, const ids 6, 7
    ids = [torch.tensor([[0, 4], [5, 1], [3, 6], [7, 2]], dtype=torch.int32),
           torch.tensor([[2, 1], [0, 3], [1, 2], [0, 1]], dtype=torch.int32)]
    xs = [torch.randn(4, 8) for _ in range(2)]
    ws = [torch.rand(4, 2) for _ in range(2)]
    a1, a2, v = torch.rand(2, 8), torch.rand(2, 8), torch.randn(2, 8)
    out = ref.dispatch(xs, ids, 4)
    res = _combine_from(out, ids, ws, 4, ori_x=xs, const_expert_alpha_1=a1, const_expert_alpha_2=a2,
                        const_expert_v=v, zero_expert_num=1, copy_expert_num=1, const_expert_num=2)
    x, w = xs[0], ws[0]
    exp = torch.stack([
        w[0, 0] * x[0],
        w[1, 0] * x[1] + w[1, 1] * x[1],
        w[2, 0] * x[2] + w[2, 1] * (a1[0] * x[2] + a2[0] * v[0]),
        w[3, 0] * (a1[1] * x[3] + a2[1] * v[1]) + w[3, 1] * x[3],
    ])
    assert torch.allclose(res[0], exp, rtol=1e-5, atol=1e-6)
    assert torch.allclose(res[1], xs[1] * ws[1].sum(1, keepdim=True), rtol=1e-5, atol=1e-6)


def test_quant_dispatch_and_round_trip():
    torch.manual_seed(0)
    xs = [torch.randn(3, 32).to(torch.bfloat16) for _ in range(2)]
    xs[0][2] = 0                                                # zero row -> scale 0
    out = ref.dispatch(xs, IDS, 4, quant_mode=2)
    r0 = out[0]
    assert r0["expand_x"].dtype == torch.int8 and r0["dynamic_scales"].shape == (12,)
    # row 2 of rank 0 is x1[1]
    q, s = r0["expand_x"][2].float(), r0["dynamic_scales"][2]
    assert (q * s - xs[1][1].float()).abs().max() <= s / 2 * (1 + 1e-5)
    assert r0["expand_x"].abs().max() <= 127
    # rank 1 row 1 is x0[2] (all zero)
    assert out[1]["dynamic_scales"][1] == 0 and (out[1]["expand_x"][1] == 0).all()
    # comm-quant combine: identity experts, ~1% error
    res = _combine_from(out, IDS, WS, 4, comm_quant_mode=2)
    for r in range(2):
        exp = xs[r].float() * WS[r].sum(1, keepdim=True)
        assert torch.allclose(res[r].float(), exp, rtol=3e-2, atol=3e-2)


def test_quant_rule_bitwise_and_smooth_rows():
    torch.manual_seed(1)
    x = torch.randn(5, 33)
    smooth = torch.rand(5, 33) + 0.5
    q, s = ref.quantize_int8_rows(x, smooth)
    for i in range(5):
        xf = x[i].float() * smooth[i]
        m = xf.abs().amax()
        inv = torch.tensor(127.0, dtype=torch.float32) / m
        assert torch.equal(q[i], torch.round(xf * inv).clamp(-127, 127).to(torch.int8))
        assert torch.equal(s[i], m / 127)
        assert (q[i].float() * s[i] - xf).abs().max() <= s[i] / 2 * (1 + 1e-5)
    # round half to even: with m = 127 the scaled values are exact, so 2.5 -> 2, -3.5 -> -4, 0.5 -> 0
    row = torch.tensor([[127.0, 2.5, -3.5, 0.5]])
    q, s = ref.quantize_int8_rows(row)
    assert q.tolist() == [[127, 2, -4, 0]] and s.item() == 1.0
    # smooth scales in dispatch: S=0 -> row e, S=1 -> row e+1 (row 0 shared)
    xs = [torch.ones(3, 4), torch.ones(3, 4)]
    scales = torch.arange(1, 5, dtype=torch.float32).unsqueeze(1).repeat(1, 4)   # row e -> e+1
    out = ref.dispatch(xs, IDS, 4, quant_mode=2, scales=scales)
    assert torch.allclose(out[0]["dynamic_scales"][:6], torch.tensor([1, 1, 1, 2, 2, 2]) / 127.0)
    ids = [torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)] * 3
    xs3 = [torch.ones(3, 4)] * 3
    scales = torch.arange(1, 6, dtype=torch.float32).unsqueeze(1).repeat(1, 4)   # 5 rows
    out = ref.dispatch(xs3, ids, 4, shared_expert_rank_num=1, quant_mode=2, scales=scales)
    assert torch.allclose(out[0]["dynamic_scales"][:9], torch.full((9,), 1 / 127.0))
    assert torch.allclose(out[1]["dynamic_scales"][:3], torch.full((3,), 2 / 127.0))   # expert 0 -> row 1
    with pytest.raises(ValueError):
        ref.dispatch(XS, IDS, 4, quant_mode=1)


def test_calc_diff():
    a = torch.randn(10, 10)
    assert abs(ref.calc_diff(a, a)) < 1e-12
    assert ref.calc_diff(a, -a) > 0.1


# ----------------------------------------------------------------------------------------- DeepEP

TOPK = [torch.tensor([[0, 3], [1, -1], [2, 3]]), torch.tensor([[-1, -1], [3, 2], [0, 1]])]   # E=4, R=2


def test_dispatch_layout():
    ntr, rdma, nte, itr = ref.get_dispatch_layout(TOPK[0], 4, 2)
    assert rdma is None
    assert ntr.tolist() == [2, 2] and ntr.dtype == torch.int32
    assert nte.tolist() == [1, 1, 1, 2] and nte.dtype == torch.int32
    assert itr.tolist() == [[True, True], [True, False], [False, True]]


def test_normal_dispatch_and_combine_identity():
    xs = [tagged([1, 2, 3], torch.bfloat16), tagged([11, 12, 13], torch.bfloat16)]
    ws = [torch.rand(3, 2), torch.rand(3, 2)]
    out = ref.normal_dispatch(xs, TOPK, ws, 4, expert_alignment=4)
    r0, r1 = out
    assert col(r0["recv_x"].float()) == [1, 2, 13]
    assert col(r1["recv_x"].float()) == [1, 3, 12]
    assert r0["recv_src_idx"].tolist() == [0, 1, 2] and r1["recv_src_idx"].tolist() == [0, 2, 1]
    assert r0["recv_topk_idx"].tolist() == [[0, -1], [1, -1], [0, 1]]
    assert r1["recv_topk_idx"].tolist() == [[-1, 1], [0, 1], [1, 0]]
    assert r0["recv_topk_weights"][0].tolist() == [ws[0][0, 0].item(), 0.0]
    assert r0["num_recv_tokens_per_expert_list"] == [4, 4]     # counts 2, 2 aligned to 4
    assert r0["rank_prefix_matrix"].tolist() == [[2, 2], [3, 3]]
    assert r0["send_pos"].tolist() == [[0, 0], [1, -1], [-1, 1]]
    assert r1["send_pos"].tolist() == [[-1, -1], [-1, 2], [2, -1]]
    comb = ref.normal_combine([o["recv_x"] for o in out], out,
                              topk_weights_recv=[o["recv_topk_weights"] for o in out])
    for s in range(2):
        cx, cw = comb[s]
        n_ranks = ref.get_dispatch_layout(TOPK[s], 4, 2)[3].sum(1, keepdim=True)
        assert cx.dtype == torch.bfloat16
        assert torch.equal(cx.float(), xs[s].float() * n_ranks)
        assert torch.allclose(cw, torch.where(TOPK[s] >= 0, ws[s], torch.zeros(3, 2)))
    # bias: single list and pair
    b = [torch.ones(3, H), torch.ones(3, H)]
    comb_b = ref.normal_combine([o["recv_x"] for o in out], out, bias=(b, b))
    assert torch.equal(comb_b[0][0].float(), xs[0].float() * torch.tensor([[2.], [1.], [1.]]) + 2)
    assert comb_b[0][1] is None


def test_normal_dispatch_worst_tokens():
    xs = [torch.randn(3, 8), torch.randn(3, 8)]
    base = ref.normal_dispatch(xs, TOPK, None, 4)
    out = ref.normal_dispatch(xs, TOPK, None, 4, num_worst_tokens=6)
    for j in range(2):
        n = base[j]["num_recv_tokens"]
        assert out[j]["recv_x"].shape == (6, 8)
        assert torch.equal(out[j]["recv_x"][:n], base[j]["recv_x"])
        assert (out[j]["recv_x"][n:] == 0).all()
        assert (out[j]["recv_topk_idx"][n:] == -1).all()
        assert out[j]["num_recv_tokens_per_expert_list"] == []
        assert out[j]["recv_topk_weights"] is None
    comb = ref.normal_combine([o["recv_x"] for o in out], out)
    assert torch.allclose(comb[1][0], xs[1] * torch.tensor([[0.], [1.], [1.]]))


def test_low_latency_round_trip():
    xs = [tagged([1, 2, 3], torch.bfloat16), tagged([11, 12, 13], torch.bfloat16)]
    ws = [torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.125, 4.0]]), torch.tensor([[1.0, 1.0], [0.5, 2.0], [4.0, 0.25]])]
    out = ref.low_latency_dispatch(xs, TOPK, 4, 4)
    r0, r1 = out
    assert r0["recv_x"].shape == (2, 8, H)
    assert r0["recv_count"].tolist() == [2, 2] and r1["recv_count"].tolist() == [2, 3]
    # expert 3 (rank 1, local 1): rank 0 tokens 0, 2 then rank 1 token 1
    assert col(r1["recv_x"][1, :4].float()) == [1, 3, 12, 0]
    assert r1["src_info"][1].tolist()[:4] == [0, 2, 1, -1]
    assert r1["layout_range"][1].tolist() == [(0 << 32) | 2, (2 << 32) | 1]
    assert r1["layout_range"][0].tolist() == [(0 << 32) | 1, (1 << 32) | 1]
    assert col(r1["recv_x"][0, :3].float()) == [3, 12, 0]
    res = ref.low_latency_combine([o["recv_x"] for o in out], TOPK, ws, out)
    for s in range(2):
        exp = xs[s].float() * torch.where(TOPK[s] >= 0, ws[s], torch.zeros(3, 2)).sum(1, keepdim=True)
        assert res[s].dtype == torch.bfloat16
        assert ref.calc_diff(res[s].float(), exp) < 1e-5
