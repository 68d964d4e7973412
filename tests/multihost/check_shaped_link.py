"""One rank of a job across simulated hosts whose link is shaped (run with multihost.sh --rate):
large all_gather, all_reduce and all_to_all_single, each followed by a barrier of another group
(gloo), so that no later cam op progresses this rank's sends for it. A put's tail and the done
behind it can still sit in this rank's socket when the op returns (its peer waits for them):
the group's worker must move them between ops, or the peer waits out the deadline while this
rank waits in the gloo barrier (seen at 2 x 2 with 32 MiB at 1 Gbit/s in 2 of 6 runs before the
worker served between ops; not on every run, so this check guards the fix rather than proving
it). Values are checked against the reference."""
import time

import torch
import torch.distributed as dist

from job import finish, join  # first: it puts tests/ on the path
from hierarchical_checks import ints  # noqa: E402

DEADLINE_S = 60
rank, world = join(DEADLINE_S)
gloo = dist.new_group(backend="gloo")
bad = []
n = (32 << 20) // 4  # 32 MiB per rank: the link holds the tail of every exchange
for it in range(3):
    everyone = [ints(n, r, it) for r in range(world)]
    t0 = time.monotonic()
    out = torch.empty(world * n)
    dist.all_gather_into_tensor(out, everyone[rank])
    dist.barrier(group=gloo)
    if not torch.equal(out, torch.cat(everyone)):
        bad.append(f"iteration {it}: all_gather differs from the reference")
    t = everyone[rank].clone()
    dist.all_reduce(t)
    dist.barrier(group=gloo)
    if not torch.equal(t, torch.stack(everyone).sum(0)):
        bad.append(f"iteration {it}: all_reduce differs from the reference")
    got = torch.empty(n)
    dist.all_to_all_single(got, everyone[rank])
    dist.barrier(group=gloo)
    want = torch.cat([e.view(world, -1)[rank] for e in everyone])
    if not torch.equal(got, want):
        bad.append(f"iteration {it}: all_to_all_single differs from the reference")
    took = time.monotonic() - t0
    print(f"rank {rank}: iteration {it} in {took:.2f} s", flush=True)
finish(rank, bad)
