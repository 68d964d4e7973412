"""RL weight transfer (torch_cam.weights.WeightChannel) on a cam group whose ranks span hosts,
run by every rank of an initialized default group of 2 hosts x 2 ranks or 3 hosts x 1 rank:
trainers and rollouts on different hosts (every byte crosses a link), a replica whose ranks read
one trainer on their host and one on another, replicated trainers read from the rollout's own
host, an int8 target with per-row scales and a partial update, small landing groups; each
rollout tensor checked bit for bit against the same tensors computed in one process
(tests/test_weights.py's model and layouts). Used by tests/test_hierarchical.py (hosts simulated
with TORCH_CAM_HOST_ID) and tests/multihost/check_weights.py (namespaces, multihost.sh)."""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def layouts(world: int) -> list[tuple]:
    """(what, trainers, replicas, trainer layout, rollout dtype, channel options) for the
    shapes the tests use: 2 x 2 (ranks 0, 1 on host 0; 2, 3 on host 1) and 3 x 1."""
    if world == 4:
        return [("trainers on host 0, replicas on host 1", [0, 1], [[2], [3]], "tp", torch.float16, {}),
                ("a TP 2 replica over both hosts, a trainer on each", [0, 2], [[1, 3]], "tp", torch.float32, {}),
                ("whole trainers on both hosts, small landing groups", [0, 2], [[1], [3]], "whole",
                 torch.bfloat16, {"bucket_bytes": 4096})]
    if world == 3:
        return [("one trainer, a replica on each other host", [0], [[1], [2]], "tp", torch.float16, {}),
                ("TP 3 -> TP 1 over three hosts, small landing groups", [0, 1], [[2]], "tp", torch.bfloat16,
                 {"bucket_bytes": 4096})]
    raise ValueError(f"weights across hosts checks take 3 or 4 ranks, got {world}")


def check_weights(rank: int, world: int) -> list[str]:
    """Runs every layout; returns what went wrong (empty when all matched)."""
    from test_weights import (_rollout_expect, _rollout_register, _set_trainer_values, _trainer_register,
                              model)
    from torch_cam.weights import WeightChannel
    bad = []
    for what, trainers, replicas, t_layout, dtype, kw in layouts(world):
        start = time.monotonic()
        try:
            ch = WeightChannel(trainers=trainers, replicas=replicas, **kw)
            m = model(1)
            if rank in trainers:
                held = _trainer_register(ch, rank, trainers, m, t_layout)
                for v in (1, 2):
                    _set_trainer_values(held, model(v), rank, trainers, t_layout)
                    ch.publish(v)
            else:
                rep = next(r for r in replicas if rank in r)
                tensors = _rollout_register(ch, rep, rank, dtype, m)
                for v in (1, 2):
                    ch.update(v)
                    _rollout_expect(tensors, rep, rank, model(v))
                    assert ch.version == v, (ch.version, v)
                if t_layout == "whole":  # replicated trainers: read from this host's, nothing crosses
                    plan = next(iter(ch._plans.values()))
                    assert not plan.remote, f"rank {rank} read {len(plan.remote)} groups from another host"
        except Exception as e:  # noqa: BLE001
            bad.append(f"rank {rank} weights, {what}: {type(e).__name__}: {e}")
        if rank == 0:
            print(f"weights across hosts: {what} {time.monotonic() - start:.2f} s", flush=True)
    bad += _quantized(rank, world)
    dist.barrier()
    return bad


def _quantized(rank: int, world: int) -> list[str]:
    """Rank 0 trains; the last rank (another host) takes w as int8 rows with scales and v as
    bfloat16, then a partial update of w alone."""
    from test_weights import expect_equal
    from torch_cam.weights import Shard, WeightChannel, quantize_rows
    last = world - 1
    replicas = [[r] for r in range(1, world)]
    g = torch.Generator().manual_seed(5)
    w = [torch.randn(40, 64, generator=g) * (1 + torch.arange(40.0))[:, None] for _ in range(3)]
    v = torch.randn(100, generator=g)
    try:
        ch = WeightChannel(trainers=[0], replicas=replicas)
        if rank == 0:
            held = ch.register("w", w[1].clone())
            vt = ch.register("v", v.clone())
            ch.publish(1)
            with torch.no_grad():
                held.copy_(w[2])
                vt.mul_(2)
            ch.publish(2, names=["w"])
            return []
        q = torch.zeros(20, 64, dtype=torch.int8)
        qs = torch.zeros(20, dtype=torch.float32)
        j = 0 if rank != last else 1
        ch.register("w", q, Shard(0, j, 2), shape=(40, 64), scale=qs)
        vb = ch.register("v", torch.zeros(100, dtype=torch.bfloat16))
        for version, want in ((1, w[1]), (2, w[2])):
            ch.update(version, names=None if version == 1 else ["w"])
            rq, rs = quantize_rows(want.chunk(2, 0)[j], torch.int8)
            expect_equal(q, rq, f"rank {rank} int8 rows of version {version}")
            expect_equal(qs, rs, f"rank {rank} int8 scales of version {version}")
            expect_equal(vb, v.bfloat16(), f"rank {rank} v after version {version} (not in the partial update)")
        return []
    except Exception as e:  # noqa: BLE001
        return [f"rank {rank} weights, int8 target and partial update: {type(e).__name__}: {e}"]


def check_weights_dead_trainer(rank: int, world: int, timeout_s: float) -> tuple:
    """Rank 0 (a trainer on host 0) dies while the rollouts of the other hosts wait in
    update(2): every rollout raises well within the timeout and still holds version 1 whole.
    Returns ("raised" | "returned" | "late", seconds, message)."""
    from test_weights import _set_trainer_values, expect_equal, model
    from torch_cam.weights import WeightChannel
    rollouts = [r for r in range(world) if r != 0]
    ch = WeightChannel(trainers=[0], replicas=[[r] for r in rollouts])
    m1 = model(1)
    if rank == 0:
        held = {k: ch.register(k, v.clone()) for k, v in m1.items()}
        ch.publish(1)
        _set_trainer_values(held, model(2), 0, [0], "whole")
        time.sleep(0.5)  # the rollouts are waiting in update(2)
        os._exit(0)  # exit 0: torchrun must not stop this host's other ranks before they see it
    mine = {k: ch.register(k, torch.zeros_like(v)) for k, v in m1.items()}
    ch.update(1)
    start = time.monotonic()
    try:
        ch.update(2)
    except RuntimeError as e:
        took = time.monotonic() - start
        for k, t in mine.items():
            expect_equal(t, m1[k], f"rank {rank} {k} after the failed update")
        assert ch.version == 1, ch.version
        return ("raised" if took < timeout_s else "late", took, str(e))
    return ("returned", time.monotonic() - start, "")
