"""Process harness shared by bench_collectives.py and bench_moe.py: the worker setup (backend
registration, one intra-op thread, optional pinning, a cam world group plus a gloo group over
the same ranks), the gloo reductions that collect results over ranks, the launcher that spawns
one world size under a hard deadline and reads back what rank 0 wrote, and small helpers for
the table headers.

Unlike _common.py (pure Python, shared with bench_mpi.py), this module uses torch.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# ----------------------------------------------------------------------------- launcher side

def prepare_env() -> None:
    """Environment of the spawned workers: one OpenMP thread, gloo on the loopback interface."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def run_world(worker, world: int, cfg: dict, deadline_s: float, prefix: str) -> dict:
    """Runs ``worker(rank, world, store_path, cfg, result_path)`` in ``world`` spawned processes
    for at most ``deadline_s`` seconds (past it, or when a worker fails, the workers are killed)
    and returns the JSON rank 0 last wrote to result_path (see atomic_json), with wall_s,
    load_before / load_after and, on failure, error added. Where the launch itself fails:
    ``{"world", "rows": [], "error": <traceback>}``."""
    try:
        return _run_world(worker, world, cfg, deadline_s, prefix)
    except Exception:
        return {"world": world, "rows": [], "error": traceback.format_exc()[-2000:]}


def _run_world(worker, world: int, cfg: dict, deadline_s: float, prefix: str) -> dict:
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix=f"{prefix}_{world}_")
    store_path = os.path.join(tmp, "store")
    result_path = os.path.join(tmp, "result.json")
    error = None
    t0 = time.time()
    ctx = mp.start_processes(worker, args=(world, store_path, cfg, result_path), nprocs=world,
                             join=False, start_method="spawn")
    try:
        while True:
            try:
                if ctx.join(timeout=1.0):
                    break
            except Exception as e:  # a worker failed; torch has terminated the others
                error = f"worker failed: {type(e).__name__}: {str(e)[-3000:]}"
                break
            if time.time() - t0 > deadline_s:
                error = f"deadline of {deadline_s:.0f}s passed; workers killed"
                break
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(timeout=10)
    result = {"world": world, "rows": [], "complete": False, "current": None}
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    result["wall_s"] = time.time() - t0
    result["load_before"], result["load_after"] = load_before, os.getloadavg()
    if error:
        result["error"] = error
        try:  # remove /dev/shm names of killed cam ranks, if any
            import torch_cam
            torch_cam._C.sweep_stale_segments()
        except Exception:
            pass
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def cam_version() -> str:
    try:
        import torch_cam
        return torch_cam.__version__
    except Exception as e:  # pragma: no cover
        return f"? ({e})"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_line(world: int, quick: bool, pin: bool, single_shot: bool = False) -> str:
    """The date, versions, cores and mode part of a world size's table heading."""
    avail = usable_cores()
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"{date}, torch {torch.__version__}, torch_cam {cam_version()}, "
            f"{os.cpu_count()} cores ({avail} usable, {world / max(avail, 1):.1f} ranks/core), "
            f"python {platform.python_version()}, {'quick' if quick else 'full'} mode, "
            f"{'ranks pinned to core rank % cores' if pin else 'ranks not pinned'}"
            f"{', single-shot samples (one op after a barrier)' if single_shot else ''}, "
            f"{heap_allocator_mode()}")


def heap_allocator_mode() -> str:
    """What cam's plain (ordinary-tensor) rows measure: the heap allocator mode is on by default
    (tensors from 1 MiB read in place); TORCH_CAM_HEAP_ALLOCATOR overrides it for the workers."""
    value = os.environ.get("TORCH_CAM_HEAP_ALLOCATOR", "").strip()
    if not value:
        return "heap allocator mode on by default (ordinary tensors from 1 MiB read in place)"
    if int(value) <= 0:
        return "heap allocator mode off (TORCH_CAM_HEAP_ALLOCATOR=0: ordinary tensors staged)"
    return f"heap allocator mode from {value} B (TORCH_CAM_HEAP_ALLOCATOR)"


# ----------------------------------------------------------------------------- worker side

def setup_worker(rank: int, pin: bool) -> None:
    """Registers backend "cam", silences torch.distributed's FutureWarnings (torch 2.13 deprecates
    all_gather_into_tensor / reduce_scatter_tensor, one warning per call), uses one intra-op
    thread and, with pin, pins rank r to core r % ncores."""
    import warnings

    import torch_cam  # noqa: F401  registers backend "cam"

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    torch.set_num_threads(1)
    if pin:  # before any backend thread exists, so they all inherit it
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def init_groups(rank: int, world: int, store_path: str, op_timeout_s: float, pg_options=None):
    """The cam world group (default group, on a FileStore at store_path) and a gloo group over
    the same ranks, which is returned; both with op_timeout_s."""
    timeout = datetime.timedelta(seconds=op_timeout_s)
    store = dist.FileStore(store_path, world)
    kwargs = {} if pg_options is None else {"pg_options": pg_options}
    dist.init_process_group("cam", store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return dist.new_group(backend="gloo", timeout=timeout)


def finish_worker(gloo) -> None:
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()


def atomic_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def max_over_ranks(values: list[float], gloo) -> list[float]:
    """Element-wise max over the ranks of the gloo group (every rank passes as many values)."""
    t = torch.tensor(values, dtype=torch.float64)
    if t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return t.tolist()


def allreduce_max(x: float, gloo) -> float:
    return float(max_over_ranks([x], gloo)[0])


def timed_slowest(fn, gloo, samples: int, warmup: int = 1) -> float:
    """Median over samples of the slowest rank's time for fn(), each from a gloo barrier."""
    out = []
    for i in range(warmup + samples):
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        fn()
        dt = allreduce_max(time.perf_counter() - t0, gloo)
        if i >= warmup:
            out.append(dt)
    return statistics.median(out)


def timed_from_last_entry(fn, gloo, samples: int, warmup: int = 1) -> float:
    """Median over samples of the time from the last rank's start of fn() to the last rank's
    finish, each sample from a gloo barrier. The op cannot finish before its last rank enters,
    so this leaves out how far apart the ranks leave the barrier (up to a few hundred us on 2
    cores), which timed_slowest counts. Needs one clock for every rank (the ranks of one
    machine, simulated hosts included)."""
    starts, ends = [], []
    for i in range(warmup + samples):
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= warmup:
            starts.append(t0)
            ends.append(t1)
    last = max_over_ranks(starts + ends, gloo)
    return statistics.median(e - s for s, e in zip(last[:samples], last[samples:]))


def all_ok(ok: bool, gloo) -> bool:
    """True where every rank of the gloo group passes ok."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=gloo)
    return bool(t.item())
