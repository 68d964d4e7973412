"""Checks of KV transfer (torch_cam.kv.KVTransfer) over a cam group whose ranks span hosts, run
by every rank of an initialized default group: push, pull, asynchronous per-layer push, layout
conversion between the two sides, bad input told to the peer, stale versions refused; every
payload compared with torch_cam.kv_reference's reading of the pools. Peers are on this host
(mapped heap) or on another (UCX); each check covers both where the group has both. Used by
tests/test_hierarchical.py (hosts simulated with TORCH_CAM_HOST_ID) and tests/multihost/
(hosts simulated with namespaces)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from torch_cam.kv import KVTransfer
from torch_cam.kv_reference import KVLayout, gather_tokens, scatter_tokens

HEADS, D, LAYERS, TOKENS = 4, 8, 3, 13


def layout(rank: int) -> KVLayout:
    # Neighbours differ in order and block size, so every transfer converts (per-head moves).
    if rank % 2 == 0:
        return KVLayout("mha", LAYERS, 32, 4, HEADS, D, torch.bfloat16, "NHD")
    return KVLayout("mha", LAYERS, 32, 8, HEADS, D, torch.bfloat16, "HND")


def model_kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, TOKENS, HEADS, D, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def blocks(lay: KVLayout, first: int) -> list[int]:
    """The blocks a request of TOKENS tokens uses, scattered from `first` on."""
    used = (TOKENS + lay.block_size - 1) // lay.block_size
    return [(first + 7 * i) % lay.num_blocks for i in range(used)]


def check_kv(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    kv = KVTransfer()
    mine = layout(rank)
    pools = kv.allocate(mine)
    own_ids = blocks(mine, 1)  # this rank's own request (seed = rank)
    scatter_tokens(pools, mine, own_ids, model_kv(rank))
    version = kv.register(pools, mine)
    if kv.version(rank) != version or kv.peer_layout(rank) != mine:
        bad.append(f"this rank's own registration reads back as {kv.version(rank)}, {kv.peer_layout(rank)}")
    dist.barrier()

    def expect(what, ids, seed, layers=None):
        got = gather_tokens(pools, mine, ids, TOKENS, layers)
        want = model_kv(seed)
        want = want if layers is None else [want[l] for l in layers]
        for l, (g, w) in enumerate(zip(got, want)):
            if not torch.equal(g, w):
                bad.append(f"{what}: layer {l} differs ({(g != w).sum().item()} elements)")

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # Push: this rank's request into the next rank's blocks 2.. (rank r receives from r - 1).
    kv.push(nxt, own_ids, blocks(layout(nxt), 2), TOKENS, request_id=b"push%d" % rank, version=kv.version(nxt))
    n = kv.wait_notification(b"push%d" % prv, peer=prv)
    if not n.ok or n.kind != "push" or n.nbytes <= 0:
        bad.append(f"push notification from rank {prv}: {n}")
    expect(f"push from rank {prv}", blocks(mine, 2), prv)

    # Pull: the next rank's own request into this rank's blocks 3..; the next rank hears of it.
    kv.pull(nxt, blocks(layout(nxt), 1), blocks(mine, 3), TOKENS, request_id=b"pull%d" % rank)
    n = kv.wait_notification(b"pull%d" % prv, peer=prv)
    if not n.ok or n.kind != "pull":
        bad.append(f"pull notification from rank {prv}: {n}")
    expect(f"pull from rank {nxt}", blocks(mine, 3), nxt)

    # Asynchronous push of two layers to the rank two ahead (another host at 2 x 2).
    far, back = (rank + 2) % world, (rank - 2) % world
    if far != rank:
        work = kv.push(far, own_ids, blocks(layout(far), 4), TOKENS, layers=[2, 0], request_id=b"async%d" % rank,
                       async_op=True)
        work.wait(timeout=60)
        if not (work.layer_done(2) and work.layer_done(0)) or work.layer_done(1):
            bad.append(f"async push to rank {far}: layers done {[work.layer_done(l) for l in range(LAYERS)]}")
        n = kv.wait_notification(b"async%d" % back, peer=back)
        if not n.ok:
            bad.append(f"async notification from rank {back}: {n}")
        expect(f"async push from rank {back}", blocks(mine, 4), back, layers=[2, 0])

    # Bad input: a block id past the peer's pool raises here, and the peer is told.
    try:
        kv.push(nxt, own_ids, [99] + blocks(layout(nxt), 5)[1:], TOKENS, request_id=b"bad%d" % rank)
        bad.append("a push into block 99 of a 32-block pool did not raise")
    except IndexError as e:
        if "99" not in str(e) or f"rank {nxt}" not in str(e):
            bad.append(f"the bad push's error names neither block nor peer: {e}")
    n = kv.wait_notification(b"bad%d" % prv, peer=prv)
    if n.ok or "99" not in n.message:
        bad.append(f"the failed push from rank {prv} was not told as a failure naming block 99: {n}")

    # A re-registration bumps the version: a plan against the old one is refused.
    dist.barrier()
    new_version = kv.register(pools, mine)
    dist.barrier()
    if new_version <= version:
        bad.append(f"re-registration kept version {version} -> {new_version}")
    try:
        kv.push(nxt, own_ids, blocks(layout(nxt), 6), TOKENS, request_id=b"stale%d" % rank, version=version)
        bad.append("a push planned against a stale version was not refused")
    except RuntimeError as e:
        if "re-registered" not in str(e):
            bad.append(f"the stale push's error does not say why: {e}")
    kv.wait_notification(b"stale%d" % prv, peer=prv)  # told as failed; nothing more to check
    if kv.poll_notifications():
        bad.append("notifications arrived that no transfer sent")
    dist.barrier()
    return bad


def check_kv_dead_peer(rank: int, world: int, timeout_s: float) -> tuple[str, float, str]:
    """The last rank vanishes (os._exit) after the transfers are set up; every other rank's
    wait for it, and a push to it, must raise well within the timeout. Returns (how, seconds,
    message) of the wait."""
    import os

    kv = KVTransfer()
    mine = layout(rank)
    pools = kv.allocate(mine)
    kv.register(pools, mine)
    dead = world - 1
    for peer in range(world):
        if peer != rank:
            kv.version(peer)
    dist.barrier()
    if rank == dead:
        os._exit(0)
    start = time.monotonic()
    try:
        kv.wait_notification(b"never", peer=dead, timeout_s=timeout_s)
        how, msg = "returned", ""
    except (RuntimeError, TimeoutError) as e:
        how, msg = type(e).__name__, str(e)
    took = time.monotonic() - start
    try:
        kv.push(dead, blocks(mine, 1), blocks(layout(dead), 1), TOKENS, request_id=b"late")
        msg += " | the push to the dead rank returned"
        how = "push returned"
    except (RuntimeError, TimeoutError) as e:
        msg += f" | push: {e}"
    return how, took, msg
