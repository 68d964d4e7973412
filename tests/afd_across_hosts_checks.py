"""Attention-FFN disaggregation (torch_cam.afd.AfdChannel) on a cam group whose ranks span
hosts, run by every rank of an initialized default group of 2 hosts x 2 ranks or 3 hosts x 1
rank: attention and FFN ranks on different hosts (every message crosses a link), mixed (each
side has a peer on its host and one on the other), weights given at recv (expert rows travel
back unsummed), int8 rows; several layers with two micro-batches in flight, every output and
every FFN rank's grouped rows checked bit for bit against torch_cam.afd_reference
(tests/test_afd.py's cases). Used by tests/test_hierarchical.py (hosts simulated with
TORCH_CAM_HOST_ID) and tests/multihost/check_afd.py (namespaces, multihost.sh)."""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def specs(world: int) -> list[tuple[str, dict]]:
    """The cases for 2 x 2 (ranks 0, 1 on host 0; 2, 3 on host 1) and 3 x 1."""
    from test_afd import BASE
    if world == 4:
        return [("attention on host 0, FFN on host 1", dict(BASE, attn=[0, 1], ffn=[2, 3], dtype=torch.bfloat16,
                                                             shared=True, bs=[[16, 5], [3, 16]], topk=3)),
                ("both sides on both hosts, weights at recv", dict(BASE, attn=[0, 2], ffn=[1, 3], dtype=torch.bfloat16,
                                                                   shared=True, bs=[[16, 3], [0, 9]],
                                                                   weights_at_recv=True, unrouted=0.2)),
                ("both sides on both hosts, int8", dict(BASE, attn=[1, 3], ffn=[0, 2], dtype=torch.bfloat16,
                                                        shared=True, quant=True, bs=[[16, 9], [12, 1]],
                                                        zero_copy=True))]
    if world == 3:
        return [("2 attention : 1 FFN on three hosts", dict(BASE, attn=[0, 1], ffn=[2], dtype=torch.float16,
                                                            bs=[[16, 2], [7, 0]], unrouted=0.3, experts_per_rank=6,
                                                            topk=4)),
                ("1 attention : 2 FFN on three hosts, int8", dict(BASE, attn=[0], ffn=[1, 2], shared=True, quant=True,
                                                                  bs=[[16, 5]], layers=2))]
    raise ValueError(f"AFD across hosts checks take 3 or 4 ranks, got {world}")


def check_afd(rank: int, world: int) -> list[str]:
    """Runs every case; returns what went wrong (empty when all matched)."""
    from test_afd import run_exchange
    bad = []
    for what, spec in specs(world):
        start = time.monotonic()
        try:
            checked = run_exchange(rank, spec)
            want = spec["layers"] * spec["micro_batches"]
            if checked != want:
                bad.append(f"rank {rank} AFD, {what}: checked {checked} exchanges, expected {want}")
        except Exception as e:  # noqa: BLE001
            bad.append(f"rank {rank} AFD, {what}: {type(e).__name__}: {e}")
        dist.barrier()
        if rank == 0:
            print(f"afd across hosts: {what} {time.monotonic() - start:.2f} s", flush=True)
    return bad


def check_afd_dead_ffn(rank: int, world: int) -> tuple:
    """2 x 2: FFN rank 2 (host 1) dies before message 2; both attention ranks (host 0) raise
    within the channel's 4 s timeout, naming it, and their channel is broken after.
    Returns (message, seconds, what a later call raised) on ranks 0 and 1."""
    from test_afd import BASE, run_dead
    return run_dead(rank, dict(BASE, attn=[0, 1], ffn=[2, 3], bs=[[8, 8], [8, 8]]), "ffn", "dies")
