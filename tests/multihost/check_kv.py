"""One rank of a job across simulated hosts: KV transfer (push, pull, asynchronous, converting
layouts, bad input, stale versions) between ranks of this host and of others, checked against
the reference (tests/kv_across_hosts_checks.py); then nothing left in this host's /dev/shm.
With --dead-peer: the last rank vanishes and every other rank's wait for it and push to it must
raise well within the timeout."""
import sys

from job import finish, join
from kv_across_hosts_checks import check_kv, check_kv_dead_peer

TIMEOUT_S = 60
rank, world = join(TIMEOUT_S)
if "--dead-peer" in sys.argv:
    how, took, msg = check_kv_dead_peer(rank, world, timeout_s=TIMEOUT_S / 2)
    print(f"rank {rank} raised after {took:.2f} s: {msg[:300]}", flush=True)
    ok = how == "RuntimeError" and took <= TIMEOUT_S / 4 and "| push:" in msg
    finish(rank, [] if ok else [f"the wait for the dead rank {how} after {took:.1f} s: {msg}"],
           group_failed=True)
finish(rank, check_kv(rank, world))
