"""One rank of a job across simulated hosts: the last rank vanishes after the first all_reduce
(os._exit, no cleanup, as a crash); every other rank, on every host, must raise well within
the group timeout, and nothing of the job may be left in its host's /dev/shm."""
import os
import time

import torch
import torch.distributed as dist

from job import finish, join

TIMEOUT_S = 60
rank, world = join(TIMEOUT_S)
t = torch.ones(1 << 12)
dist.all_reduce(t)
if rank == world - 1:
    os._exit(0)  # exit 0: torchrun must not stop this host's other ranks before they see it
start = time.monotonic()
try:
    for _ in range(100000):
        dist.all_reduce(t)
except RuntimeError as e:
    took = time.monotonic() - start
    print(f"rank {rank} raised after {took:.2f} s: {str(e)[:300]}", flush=True)
    bad = [] if took < TIMEOUT_S / 2 else [f"raised only after {took:.1f} s"]
else:
    bad = [f"all_reduce kept working after rank {world - 1} died"]
finish(rank, bad, group_failed=True)
