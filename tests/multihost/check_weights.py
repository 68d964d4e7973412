"""One rank of a job across simulated hosts: RL weight transfer with trainers and rollouts on
different hosts (resharding, casts, an int8 target, a partial update), checked bit for bit
against the reference (tests/weights_across_hosts_checks.py); then nothing left in this host's
/dev/shm. With --dead-trainer: rank 0 (a trainer) vanishes while the rollouts wait for version
2, and every rollout must raise well within the timeout still holding version 1."""
import sys

from job import finish, join
from weights_across_hosts_checks import check_weights, check_weights_dead_trainer

TIMEOUT_S = 60
rank, world = join(TIMEOUT_S)
if "--dead-trainer" in sys.argv:
    how, took, msg = check_weights_dead_trainer(rank, world, timeout_s=TIMEOUT_S / 4)
    print(f"rank {rank} raised after {took:.2f} s: {msg[:300]}", flush=True)
    finish(rank, [] if how == "raised" else [f"the update with a dead trainer {how} after {took:.1f} s: {msg}"],
           group_failed=True)
finish(rank, check_weights(rank, world))
