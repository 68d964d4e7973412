"""One rank of a job across simulated hosts: the last rank vanishes after the first all_reduce
(os._exit, no cleanup, as a crash); every other rank, on every host, must raise well within
the group timeout, and nothing of the job may be left in its host's /dev/shm."""
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import torch_cam  # noqa: F401

TIMEOUT_S = 60
dist.init_process_group("cam", timeout=datetime.timedelta(seconds=TIMEOUT_S))
rank, world = dist.get_rank(), dist.get_world_size()
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
    ok = took < TIMEOUT_S / 2
else:
    print(f"rank {rank}: all_reduce kept working after rank {world - 1} died", flush=True)
    ok = False
left = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_cam.{os.getuid()}.")]
if left:
    print(f"rank {rank}: left in {socket.gethostname()}'s /dev/shm: {left}", flush=True)
    ok = False
os._exit(0 if ok else 1)  # the group is failed: skip destroy_process_group's barrier
