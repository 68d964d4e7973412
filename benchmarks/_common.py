"""Shared pieces of bench_collectives.py and bench_mpi.py: the size list, the iteration plan,
statistics and formatting. Pure Python (no torch, no mpi4py) so either side can import it.

Timing method used by both benchmarks (so the numbers are comparable):

* for each (op, size): one untimed op, then ``W`` warmup ops timed as a whole to estimate the
  per-op cost ``t`` (max over ranks);
* from ``t`` choose a batch ``B`` (ops per sample, so that a sample lasts ~``target_batch_s``)
  and a sample count ``K`` (so that the cell takes ~``cell_budget_s``, clamped to
  ``[min_samples, max_samples]``): iteration counts therefore shrink with size and with
  oversubscription automatically;
* each sample: barrier on the backend being measured, then ``B`` back-to-back ops timed on
  every rank, divided by ``B``; the sample value is the MAX over ranks (one all-reduce MAX of the
  ``K`` per-rank values after the timed loop, outside the timed region);
* report the median and p90 (linear interpolation) of the ``K`` samples.

Round trip (8-byte send/recv ping-pong between rank 0 and rank 1): the ping-pong synchronizes
itself, so there is no barrier per sample; the value is rank 0's time per round trip. Ranks
>= 2 wait meanwhile in a blocking (non-spinning) barrier so that they use no CPU.

Capped cells (DeepSpeed's busy-spinning shm all-reduce, which gets very slow with more ranks
than cores): the untimed op is timed too (max over ranks); if it alone exceeds the cap the cell
reports that one value, otherwise the warmup count, batch and sample count are cut so that the
whole cell stays within the cap (``Plan.choose_capped``), with at least one sample. Every
decision uses values agreed by all ranks (max over ranks), so every rank runs the same ops.
"""
from __future__ import annotations

import dataclasses
import math
import time

KiB = 1 << 10
MiB = 1 << 20

FULL_SIZES = [1 * KiB, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]

PINGPONG_BYTES = 8
# "memcpy" is a reference row, not a collective: every rank copies `size` bytes of its own at
# the same moment (out.copy_(inp)), the single-copy bound of an all-to-all of that size.
OPS = ["roundtrip", "broadcast", "all_to_all_single", "memcpy", "all_reduce", "all_reduce_bf16",
       "all_gather_into_tensor", "reduce_scatter_tensor"]
LABELS = {"all_reduce": "all_reduce fp32", "all_reduce_bf16": "all_reduce bf16",
          "memcpy": "memcpy bound (copy_)"}
# ops that also run on heap-resident inputs (torch_cam.empty), cam only
HEAP_OPS = ("broadcast", "all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
# ops that also run through DeepSpeed's shm all-reduce (--deepspeed)
DS_OPS = ("all_reduce", "all_reduce_bf16")
# ops bench_mpi.py measures (MPI has no bfloat16 type)
MPI_OPS = ("roundtrip", "broadcast", "all_to_all_single", "all_reduce", "all_gather_into_tensor",
           "reduce_scatter_tensor")
MEMCPY_SIZES = (16 * MiB, 64 * MiB)


def label(op: str) -> str:
    return LABELS.get(op, op)


def op_sizes(op: str, quick: bool) -> list[int]:
    if op == "roundtrip":
        return [PINGPONG_BYTES]
    if op == "memcpy":
        return [s for s in sizes_for(quick) if s in MEMCPY_SIZES]
    return sizes_for(quick)


@dataclasses.dataclass
class Plan:
    target_batch_s: float   # a sample (batch of B ops) should last about this long
    cell_budget_s: float    # timed part of one (op, size, backend) cell
    min_samples: int
    max_samples: int
    max_batch: int
    barrier_overhead_s: float = 5e-4

    def warmup(self, nbytes: int) -> int:
        if nbytes <= 64 * KiB:
            w = 10
        elif nbytes <= 1 * MiB:
            w = 4
        elif nbytes <= 16 * MiB:
            w = 2
        else:
            w = 1
        return max(1, w // 2) if self.max_samples <= 15 else w

    def choose(self, per_op_s: float) -> tuple[int, int]:
        """(batch, samples) for an op that costs about per_op_s."""
        per_op_s = max(per_op_s, 1e-7)
        batch = int(min(self.max_batch, max(1, self.target_batch_s // per_op_s)))
        per_sample = batch * per_op_s + self.barrier_overhead_s
        samples = int(min(self.max_samples, max(self.min_samples, self.cell_budget_s // per_sample)))
        return batch, samples

    def choose_capped(self, per_op_s: float, budget_s: float) -> tuple[int, int]:
        """Like choose, but the samples must fit in budget_s (at least one sample of one op)."""
        batch, samples = self.choose(per_op_s)
        per_op_s = max(per_op_s, 1e-7)
        batch = int(max(1, min(batch, budget_s // per_op_s)))
        per_sample = batch * per_op_s + self.barrier_overhead_s
        return batch, int(max(1, min(samples, budget_s // per_sample)))

    def slow(self) -> "Plan":
        """A smaller sample budget, for a backend that is expensive to run (DeepSpeed's shm)."""
        return dataclasses.replace(self, cell_budget_s=self.cell_budget_s / 2, min_samples=3,
                                   max_samples=min(self.max_samples, 15))


FULL_PLAN = Plan(target_batch_s=2e-3, cell_budget_s=2.0, min_samples=5, max_samples=50, max_batch=16)
QUICK_PLAN = Plan(target_batch_s=1e-3, cell_budget_s=0.4, min_samples=3, max_samples=15, max_batch=8)


def plan_for(quick: bool, single_shot: bool = False) -> Plan:
    """single_shot: every sample is one op right after the barrier, as a training step issues
    ops (waking, cold lines and the first pass of the engine are paid by every sample)."""
    plan = QUICK_PLAN if quick else FULL_PLAN
    return dataclasses.replace(plan, max_batch=1) if single_shot else plan


def sizes_for(quick: bool) -> list[int]:
    return QUICK_SIZES if quick else FULL_SIZES


def time_batch(fn, batch: int, before=None) -> float:
    """Seconds per call of fn over one batch of back-to-back calls (before() runs untimed)."""
    if before is not None:
        before()
    t0 = time.perf_counter()
    for _ in range(batch):
        fn()
    return (time.perf_counter() - t0) / batch


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples_s: list[float]) -> dict:
    return {
        "median_us": percentile(samples_s, 0.5) * 1e6,
        "p90_us": percentile(samples_s, 0.9) * 1e6,
        "min_us": min(samples_s) * 1e6 if samples_s else math.nan,
        "max_us": max(samples_s) * 1e6 if samples_s else math.nan,
    }


def fmt_size(nbytes: int) -> str:
    if nbytes >= MiB and nbytes % MiB == 0:
        return f"{nbytes // MiB} MiB"
    if nbytes >= KiB and nbytes % KiB == 0:
        return f"{nbytes // KiB} KiB"
    return f"{nbytes} B"


def fmt_time(us: float | None) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "n/a"
    if us < 1000:
        return f"{us:.1f} µs"
    if us < 1_000_000:
        return f"{us / 1000:.2f} ms"
    return f"{us / 1e6:.2f} s"


def fmt_ratio(num: float | None, den: float | None) -> str:
    if not num or not den or math.isnan(num) or math.isnan(den):
        return "n/a"
    return f"{num / den:.2f}x"


def row_key(op: str, nbytes: int) -> str:
    return f"{op}:{nbytes}"
