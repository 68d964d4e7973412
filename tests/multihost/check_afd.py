"""One rank of a job across simulated hosts: attention-FFN disaggregation with attention and FFN
ranks on different hosts (and mixed), several layers with two micro-batches in flight, checked
bit for bit against the reference (tests/afd_across_hosts_checks.py); then nothing left in this
host's /dev/shm. With --dead-ffn (2 x 2): FFN rank 2 vanishes and both attention ranks (the other
host) must raise well within the channel's timeout."""
import sys

from job import finish, join
from afd_across_hosts_checks import check_afd, check_afd_dead_ffn

TIMEOUT_S = 60
rank, world = join(TIMEOUT_S)
if "--dead-ffn" in sys.argv:
    out = check_afd_dead_ffn(rank, world)
    if rank in (0, 1):
        msg, took, again = out
        print(f"rank {rank} raised after {took:.2f} s: {msg[:300]}", flush=True)
        ok = "rank 2" in msg and took < 8 and "the channel is broken" in again
        finish(rank, [] if ok else [f"with FFN rank 2 dead the attention side got, after {took:.1f} s: {msg}"],
               group_failed=True)
    finish(rank, [], group_failed=True)
finish(rank, check_afd(rank, world))
