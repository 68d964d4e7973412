"""MoE dispatch / combine and the DeepEP-style Buffer on a cam group whose ranks span hosts, run
by every rank of an initialized default group: the single-host suites' cases (tests/test_moe.py,
tests/test_moe_buffer.py), each checked against torch_cam.moe_reference bit for bit, run on the
world group. Used by tests/test_hierarchical.py (hosts simulated with TORCH_CAM_HOST_ID) and
tests/multihost/check_moe.py (namespaces, multihost.sh)."""
from __future__ import annotations

import os
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
    if moe.two_hop_possible:  # every dispatch in two hops (rows cross to the rail peer, then shm)
        runs += [(MoeCases, MOE_CASES, room, 0), (BufferCases, BUFFER_CASES, room, 0)]
    for cls, names, inline, two_hop_min in runs:
        moe.inline_ints = inline
        moe.two_hop_min_bytes = two_hop_min
        hops_before = moe.stats()["two_hop_dispatches"]
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
            moves_rows = not any(w in name for w in ("invalid", "fails_everywhere", "layout"))
            if two_hop_min == 0 and moves_rows and hops == 0:
                bad.append(f"rank {rank} {cls.__name__}.{name}: no dispatch took two hops")
            hops_before += hops
            if rank == 0:
                print(f"moe across hosts: {name}{' (two hops)' if two_hop_min == 0 else ''} {took:.2f} s",
                      flush=True)
    moe.inline_ints, moe.two_hop_min_bytes = room, direct
    return bad


def check_moe_dead_peer(rank: int, world: int, timeout_s: float) -> tuple:
    """The last rank dies before a dispatch: every other rank raises within the timeout.
    Returns ("raised" | "returned", seconds, message)."""
    import torch_cam

    W, M = world, 2 * world
    x = torch.randn(4, 16)
    ids = torch.stack([torch.randperm(M)[:2] for _ in range(4)]).to(torch.int32)
    out = torch_cam.moe_distribute_dispatch(x, ids, dist.group.WORLD, W, rank, M)  # one that works
    assert out[0].shape[1] == 16
    dist.barrier()
    if rank == W - 1:
        os._exit(0)  # exit 0: torchrun must not stop this host's other ranks before they see it
    start = time.monotonic()
    try:
        for _ in range(100):
            torch_cam.moe_distribute_dispatch(x, ids, dist.group.WORLD, W, rank, M)
    except RuntimeError as e:
        took = time.monotonic() - start
        return ("raised" if took < timeout_s else "late", took, str(e))
    return ("returned", time.monotonic() - start, "")
