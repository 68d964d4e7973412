"""DeepSpeed's CPU shared-memory all-reduce (the kernel behind ``deepspeed.comm.inference_all_reduce``
on CPU, csrc/cpu/comm/shm.cpp, built by ``ShareMemCommBuilder``) as a plain callable, so that a
benchmark can put it next to cam, gloo and MPI.

    import torch.distributed as dist
    dist.init_process_group("gloo", ...)          # any backend with barrier (cam works)
    from _deepspeed_shm import make_ds_allreduce
    allreduce = make_ds_allreduce()               # collective: every rank must call it
    allreduce(t)                                  # in-place SUM over all ranks, returns t

What the DeepSpeed op is, and what this wrapper takes care of:

* It is a JIT-built torch extension (g++ and ninja needed; ~30 s the first time on 2 cores, then
  cached under $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/<py>_cpu/deepspeed_shm_comm).
  Loading it registers ``torch.ops.deepspeed.inference_all_reduce_``.
* Its ``initialize(world_size, rank)`` does nothing unless the environment variable LOCAL_SIZE
  equals world_size; the all-reduce then dereferences an unset workspace and crashes. We set
  LOCAL_SIZE.
* The segments are named /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
  (about 66 MiB each) and DeepSpeed never removes them. We set MASTER_ADDR/MASTER_PORT to a
  per-job token while it initializes (so concurrent jobs cannot share segments), then unlink each
  rank's segment once every rank has mapped it: nothing is left in /dev/shm, even after a crash.
* It is one communicator per process: the state is static, the group is always all
  ``world_size`` ranks, and it can be initialized once (a second call here returns the same
  callable).
* Only float32, bfloat16 and float16, contiguous CPU tensors under 2 GiB. Other dtypes are
  silently NOT reduced by the op, and a non-contiguous tensor is reduced into a temporary copy
  (the input stays unchanged), so the callable raises for those instead. bf16/fp16 accumulate in
  fp32 and round once; the bf16/fp16 kernels need AVX-512BW, fp32 AVX2 (checked: without them
  the kernel faults and the other ranks spin forever).
* Synchronization is pure busy-waiting on flags in shared memory (no yield, no timeout): with
  more ranks than cores each wait costs scheduler time slices, and a rank that dies leaves the
  others spinning. Its reduction loops use OpenMP, in torch's libgomp, so torch.set_num_threads(1)
  (or OMP_NUM_THREADS=1) keeps oversubscribed runs from getting worse.
* Messages under 1 MiB: every rank copies its data to its own buffer and reduces all of them;
  larger ones go in 32 MiB chunks, each reduce-scattered then gathered through shared memory.
"""
from __future__ import annotations

import os
import platform

import torch

__all__ = ["make_ds_allreduce", "DeepSpeedShmUnavailable", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHM_PREFIX = "deepspeed_allreduce_buffer"
_state: dict = {}


class DeepSpeedShmUnavailable(RuntimeError):
    """DeepSpeed's shm all-reduce cannot be used here; the message says why."""


def _load_op(verbose: bool):
    if platform.system() != "Linux":
        raise DeepSpeedShmUnavailable(f"DeepSpeed's shm all-reduce is Linux-only (this is {platform.system()})")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else deepspeed probes for GPUs and may pick one
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError as e:
        raise DeepSpeedShmUnavailable(
            f"deepspeed is not importable ({type(e).__name__}: {e}); pip install deepspeed") from e
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except RuntimeError as e:
        raise DeepSpeedShmUnavailable("building DeepSpeed's shm op needs ninja: pip install ninja") from e
    builder = ShareMemCommBuilder()
    if not builder.is_compatible(verbose=False):
        raise DeepSpeedShmUnavailable("DeepSpeed reports its ShareMemCommBuilder as incompatible here")
    try:
        return builder.load(verbose=verbose)
    except Exception as e:  # compiler missing, build error, ...
        raise DeepSpeedShmUnavailable(
            f"building/loading DeepSpeed's shm op failed: {type(e).__name__}: {e}") from e


def _agree(dist, rank: int, world_size: int, error):
    """Through the default group's store (so this works whatever the backend implements): every
    rank learns every rank's load error, and all get one name part that no other job uses."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("cam_ds_shm/token", f"{os.getpid()}x{int.from_bytes(os.urandom(4), 'little'):08x}")
    store.set(f"cam_ds_shm/error/{rank}", error or "")
    errors = {r: store.get(f"cam_ds_shm/error/{r}").decode() for r in range(world_size)}
    return store.get("cam_ds_shm/token").decode(), {r: e for r, e in errors.items() if e}


def make_ds_allreduce(verbose: bool = False):
    """Returns ``allreduce(tensor) -> tensor``: in-place SUM over all ranks through DeepSpeed's
    shm op. Collective: call it on every rank after torch.distributed.init_process_group (it
    uses the default group's store and barrier during setup, never afterwards).
    Raises DeepSpeedShmUnavailable with the reason when the op cannot be built or used."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("make_ds_allreduce: call torch.distributed.init_process_group first")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if "allreduce" in _state:
        if _state["key"] != (rank, world_size):
            raise RuntimeError(f"DeepSpeed's shm op was initialized as rank/world {_state['key']}; "
                               "it cannot be re-initialized in the same process")
        return _state["allreduce"]

    # Every rank attempts the build, and the ranks agree on the outcome before anyone enters the
    # op's initialize (which spins until every peer's segment exists).
    op, error = None, None
    try:
        op = _load_op(verbose)
    except DeepSpeedShmUnavailable as e:
        error = str(e)
    token, failed = _agree(dist, rank, world_size, error)
    if failed:
        raise DeepSpeedShmUnavailable("; ".join(f"rank {r}: {e}" for r, e in failed.items()))

    level = op.vector_kernel_level()  # 2: avx512bw (all dtypes), 1: avx2 (fp32 only), 0: none
    usable = {torch.float32} if level == 1 else set(SUPPORTED_DTYPES) if level >= 2 else set()
    if not usable:
        raise DeepSpeedShmUnavailable("this CPU has neither AVX2 nor AVX-512BW, which the shm reduce kernels need")

    saved = {k: os.environ.get(k) for k in ("LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(LOCAL_SIZE=str(world_size), MASTER_ADDR="cam-bench", MASTER_PORT=token)
    try:
        op.initialize(world_size, rank)  # creates its segment, maps every peer's (spins until they exist)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    dist.barrier()  # every rank has mapped every segment: the names are no longer needed
    own = f"/dev/shm/{_SHM_PREFIX}_{os.getuid()}_cam-bench_{token}_{rank}"
    try:
        os.unlink(own)
    except FileNotFoundError:
        pass
    dist.barrier()

    def allreduce(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise ValueError(f"DeepSpeed's shm all-reduce takes CPU tensors, got {tensor.device}")
        if tensor.dtype not in usable:
            raise TypeError(f"DeepSpeed's shm all-reduce supports {sorted(map(str, usable))} here, "
                            f"not {tensor.dtype} (the op would silently leave it unreduced)")
        if not tensor.is_contiguous():
            raise ValueError("DeepSpeed's shm all-reduce needs a contiguous tensor "
                             "(it would reduce a temporary copy and leave this one unchanged)")
        if tensor.numel() * tensor.element_size() >= 2**31:
            raise ValueError("DeepSpeed's shm all-reduce counts bytes in an int: tensors must be < 2 GiB")
        if world_size > 1:
            torch.ops.deepspeed.inference_all_reduce_(tensor)
        return tensor

    _state.update(allreduce=allreduce, key=(rank, world_size))
    return allreduce


# --- self-check: python benchmarks/_deepspeed_shm.py [world_size ...] ------------------------


def _check_rank(rank, world_size, init_file, sizes):
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    allreduce = make_ds_allreduce()
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith(_SHM_PREFIX)]
    for dtype in (torch.float32, torch.bfloat16):
        for nbytes in sizes:
            n = nbytes // torch.empty((), dtype=dtype).element_size()
            inputs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * r + n)).to(dtype)
                      for r in range(world_size)]
            t = inputs[rank].clone()
            assert allreduce(t) is t
            acc = inputs[0].float()  # fp32 accumulation, one rounding, as the kernel does
            for x in inputs[1:]:
                acc = acc + x.float()
            ref = acc.to(dtype)
            if world_size <= 2:  # two addends: order cannot matter, expect bit equality
                assert torch.equal(t, ref), (dtype, nbytes, (t.float() - ref.float()).abs().max())
            else:  # the vector kernel adds rank 0, N-1, ..., 1; the tail 0, 1, ..., N-1
                torch.testing.assert_close(t, ref, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5)
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(4, 4).t()):
        try:
            allreduce(bad)
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"accepted {bad.dtype} contiguous={bad.is_contiguous()}")
    dist.barrier()
    dist.destroy_process_group()
    return leftover


if __name__ == "__main__":
    import sys
    import time

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from cam_testing import run_ranks

    KiB, MiB = 1 << 10, 1 << 20
    sizes = [4, 1 * KiB, 64 * KiB, 1 * MiB - 4, 1 * MiB, 5 * MiB + 12, 33 * MiB, 64 * MiB]
    for ws in [int(a) for a in sys.argv[1:]] or [2]:
        t0 = time.monotonic()
        res = run_ranks(_check_rank, ws, sizes, deadline_s=600)
        bad = {r: v for r, (s, v) in res.items() if s != "ok"}
        if bad:
            print("\n".join(f"rank {r}: {v}" for r, v in bad.items()))
            sys.exit(1)
        left = [n for n in os.listdir("/dev/shm") if n.startswith(_SHM_PREFIX)]
        print(f"world {ws}: OK in {time.monotonic() - t0:.1f} s; "
              f"segments seen by rank 0 after setup: {res[0][1]}; left in /dev/shm now: {left}")
