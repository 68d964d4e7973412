"""MoE dispatch / combine and the DeepEP-style Buffer on a cam group whose ranks span hosts, run
by every rank of an initialized default group: the single-host suites' cases (tests/test_moe.py,
tests/test_moe_buffer.py), each checked against torch_cam.moe_reference bit for bit, run on the
world group. Used by tests/test_hierarchical.py (hosts simulated with TORCH_CAM_HOST_ID) and
tests/multihost/check_moe.py (namespaces, multihost.sh)."""
from __future__ import annotations

import functools
import os
import re
import sys
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The cases that hold on any cam group; the rest read single-host internals (the stage's size,
# staged-byte counters, per-peer wait times).
MOE_CASES = ("test_dispatch_combine_basic", "test_many_local_experts_and_empty_experts", "test_int8_quant",
             "test_masks", "test_global_bs_uneven_batches", "test_expert_token_nums_type0_no_weights",
             "test_shared_expert_ranks", "test_v2_assist_info_and_special_experts", "test_comm_quant_combine",
             "test_group_name_and_cam_names", "test_invalid_inputs_fail_everywhere")
BUFFER_CASES = ("test_layout", "test_normal_dispatch_combine", "test_normal_fp8", "test_low_latency",
                "test_low_latency_too_many_tokens_fails_everywhere")


def _on_world(case_class):
    """case_class's tests as plain calls on the world group of this process."""

    class OnWorld(case_class, unittest.TestCase):
        world_size = dist.get_world_size()
        rank = dist.get_rank()

        @property
        def pg(self):
            return dist.group.WORLD

        def runTest(self):  # noqa: N802 (unittest's name)
            pass

    return OnWorld()


def check_moe(rank: int, world: int) -> list[str]:
    """Runs every case; returns what went wrong (empty when all matched). Every rank runs the
    same cases in the same order, so a failing case fails on all ranks alike."""
    import torch_cam
    from test_moe import MoeCases
    from torch_cam import moe_reference as ref
    from test_moe_buffer import BufferCases

    moe = torch_cam.moe_hosts.moe_backend(dist.group.WORLD)  # held: the inline room set below sticks
    assert isinstance(moe, torch_cam.moe_hosts.HostsMoe)
    bad = []
    # Counts past the room in the header exchange take a second all-gather: run a few cases so.
    room = moe.inline_ints
    direct = moe.two_hop_min_bytes
    runs = [(MoeCases, MOE_CASES, room, direct), (BufferCases, BUFFER_CASES, room, direct),
            (MoeCases, ("test_dispatch_combine_basic", "test_many_local_experts_and_empty_experts",
                        "test_invalid_inputs_fail_everywhere"), 2, direct)]
    if moe.two_hop_possible:  # every dispatch and combine in two hops (through the rail peer and shm)
        runs += [(MoeCases, MOE_CASES, room, 0), (BufferCases, BUFFER_CASES, room, 0)]
    # Combine in two hops sums each token's rows of a host there first: the references sum so too.
    unpatched = {f: getattr(ref, f) for f in ("combine", "normal_combine", "low_latency_combine")}
    for cls, names, inline, two_hop_min in runs:
        moe.inline_ints = inline
        moe.two_hop_min_bytes = two_hop_min
        for f, fn in unpatched.items():
            setattr(ref, f, functools.partial(fn, hosts=moe.host_of) if two_hop_min == 0 else fn)
        hops_before = moe.stats()["two_hop_dispatches"]
        combines_before = moe.stats()["two_hop_combines"]
        case = _on_world(cls)
        for name in names:
            if name == "test_invalid_inputs_fail_everywhere" and world % 3 == 0:
                continue  # it takes moe_expert_num 3 as invalid, which it is not at 3 ranks
            start = time.monotonic()
            try:
                getattr(case, name)()
            except Exception as e:  # noqa: BLE001
                bad.append(f"rank {rank} {cls.__name__}.{name}: {type(e).__name__}: {e}")
            took = time.monotonic() - start
            hops = moe.stats()["two_hop_dispatches"] - hops_before
            combines = moe.stats()["two_hop_combines"] - combines_before
            moves_rows = not any(w in name for w in ("invalid", "fails_everywhere", "layout"))
            if two_hop_min == 0 and moves_rows and hops == 0:
                bad.append(f"rank {rank} {cls.__name__}.{name}: no dispatch took two hops")
            if two_hop_min == 0 and moves_rows and combines == 0 and name != "test_normal_fp8":  # dispatch only
                bad.append(f"rank {rank} {cls.__name__}.{name}: no combine took two hops")
            hops_before += hops
            combines_before += combines
            if rank == 0:
                print(f"moe across hosts: {name}{' (two hops)' if two_hop_min == 0 else ''} {took:.2f} s",
                      flush=True)
    moe.inline_ints, moe.two_hop_min_bytes = room, direct
    for f, fn in unpatched.items():
        setattr(ref, f, fn)
    for two_hop_min in ([direct, 0] if moe.two_hop_possible else [direct]):
        moe.two_hop_min_bytes = two_hop_min
        bad += _check_bad_plan(rank, world, moe)
    moe.two_hop_min_bytes = direct
    return bad


def _check_bad_plan(rank: int, world: int, moe) -> list[str]:
    """Rank 0 combines with an expand_idx that names rows past those its experts serve: it raises
    naming the token and slot, after the other ranks have their rows, and they return outputs equal
    to the reference's; the next combine works everywhere."""
    import torch_cam
    from test_moe import expert_fn, routing, tokens, weights
    from torch_cam import moe_reference as ref

    W, M, K, bs = world, 2 * world, min(4, 2 * world), 6
    xs = [tokens(bs, torch.bfloat16, 700 + g) for g in range(W)]
    ids = [routing(bs, K, M, 800 + g) for g in range(W)]
    ws = [weights(bs, K, 900 + g) for g in range(W)]
    two_hops = moe.two_hop_min_bytes == 0
    want_d = ref.dispatch(xs, ids, M, expert_scales=ws)
    ys = [expert_fn(d["expand_x"], g) for g, d in enumerate(want_d)]
    want = ref.combine(ys, ids, [d["expand_idx"] for d in want_d], [d["ep_recv_counts"] for d in want_d], ws, M,
                       hosts=moe.host_of if two_hops else None)[rank]
    out = torch_cam.moe_distribute_dispatch(xs[rank], ids[rank], dist.group.WORLD, W, rank, M, expert_scales=ws[rank])
    expand_x, _, expand_idx, _, counts = out[:5]
    y = expert_fn(expand_x, rank)
    how = f"bad plan{' (two hops)' if two_hops else ''}"
    bad = []
    for idx in ((expand_idx + 1000) if rank == 0 else expand_idx, expand_idx):
        try:
            got = torch_cam.moe_distribute_combine(y, ids[rank], idx, counts, ws[rank], dist.group.WORLD, W, rank, M)
        except RuntimeError as e:
            if not (rank == 0 and idx is not expand_idx
                    and re.search(r"cam moe_combine on rank 0: token \d+ slot \d+: names row 10\d\d of segment", str(e))):
                bad.append(f"rank {rank} {how}: raised {e}")
            continue
        if rank == 0 and idx is not expand_idx:
            bad.append(f"rank {rank} {how}: a plan naming rows past the served ones did not raise")
        elif not torch.equal(got[: want.shape[0]], want):
            bad.append(f"rank {rank} {how}: combine differs from the reference")
    return bad


def check_moe_dead_peer(rank: int, world: int, timeout_s: float, op: str = "dispatch") -> tuple:
    """The last rank dies before a dispatch (op "dispatch"), or after one and before its combine
    in two hops (op "combine", on hosts of equal size): every other rank raises within the
    timeout. Returns ("raised" | "returned", seconds, message)."""
    import torch_cam

    W, M = world, 2 * world
    x = torch.randn(4, 16)
    ids = torch.stack([torch.randperm(M)[:2] for _ in range(4)]).to(torch.int32)
    if op == "combine":
        moe = torch_cam.moe_hosts.moe_backend(dist.group.WORLD)
        assert moe.two_hop_possible
        moe.two_hop_min_bytes = 0
    out = torch_cam.moe_distribute_dispatch(x, ids, dist.group.WORLD, W, rank, M)  # one that works
    assert out[0].shape[1] == 16
    expand_x, _, expand_idx, _, counts = out[:5]
    if op == "combine":
        torch_cam.moe_distribute_combine(expand_x, ids, expand_idx, counts, None, dist.group.WORLD, W, rank, M)
        assert moe.stats()["two_hop_combines"] == 1
    dist.barrier()
    if rank == W - 1:
        os._exit(0)  # exit 0: torchrun must not stop this host's other ranks before they see it
    start = time.monotonic()
    try:
        for _ in range(100):
            if op == "combine":
                torch_cam.moe_distribute_combine(expand_x, ids, expand_idx, counts, None, dist.group.WORLD, W, rank, M)
            else:
                torch_cam.moe_distribute_dispatch(x, ids, dist.group.WORLD, W, rank, M)
    except RuntimeError as e:
        took = time.monotonic() - start
        return ("raised" if took < timeout_s else "late", took, str(e))
    return ("returned", time.monotonic() - start, "")
