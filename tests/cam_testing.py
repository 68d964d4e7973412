"""Helpers shared by the tests: deterministic data of any dtype, byte-exact comparison, a
launcher that runs a function on N fresh processes with a hard deadline, and the cam settings
of MultiProcContinuousTest classes (CamProcessGroupCase)."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

# Every dtype a CPU tensor can have that cam must carry byte-exactly.
ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
]


def born_in_heap(nbytes: int) -> bool:
    """Whether an ordinary tensor of nbytes allocated now is heap-resident: the heap allocator
    mode is on by default once a group forms, and tests/run_all.sh reruns some suites with it
    off (TORCH_CAM_HEAP_ALLOCATOR=0) so the staged paths stay covered."""
    import torch_cam
    s = torch_cam.heap_allocator_stats()
    return bool(s["installed"]) and nbytes >= s["min_bytes"]


def make(shape, dtype, seed: int) -> torch.Tensor:
    """A tensor whose bytes depend only on (shape, dtype, seed), so every rank can build the
    data any other rank holds. Floats get arbitrary bit patterns (NaNs included): compare with
    same_bytes, not ==."""
    if isinstance(shape, int):
        shape = (shape,)
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def cam_segments() -> list[str]:
    """Names this user's cam processes hold in /dev/shm."""
    prefix = f"torch_cam.{os.getuid()}."
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def _child(fn, rank, world_size, init_file, args, results):
    try:
        results.put((rank, "ok", fn(rank, world_size, init_file, *args)))
    except BaseException as e:  # report everything, including assertion failures
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn, world_size: int, *args, deadline_s: float = 120.0, env: dict | None = None,
              allow_died: tuple[int, ...] = ()):
    """Runs fn(rank, world_size, init_file, *args) on world_size spawned processes and returns
    {rank: ("ok", value) | ("error", text)}. Every process is killed once deadline_s passes;
    ranks listed in allow_died may exit without reporting."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="cam_init_")
    os.close(fd)
    os.unlink(init_file)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, init_file, args, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out: dict[int, tuple[str, object]] = {}
    end = time.monotonic() + deadline_s
    expected = world_size - len(allow_died)
    try:
        while len([r for r in out if r not in allow_died]) < expected and time.monotonic() < end:
            try:
                rank, status, value = results.get(timeout=0.2)
                out[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, end - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    missing = [r for r in range(world_size) if r not in out and r not in allow_died]
    if missing:
        raise AssertionError(f"ranks {missing} did not report within {deadline_s} s: {out}")
    return out


def assert_all_ok(testcase, results):
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    testcase.assertFalse(errors, "\n".join(f"rank {r}: {v}" for r, v in errors.items()))


class CamProcessGroupCase:
    """Mixin for torch's MultiProcContinuousTest on cam: backend "cam" on CPU, with the class's
    ``cam_options`` as the default group's pg_options, and ``self.pg``, the default group.
    List it (or a class built on it) before MultiProcContinuousTest; set ``timeout`` and
    ``cam_options`` per class (``opts()`` returns a fresh copy of ``cam_options``)."""

    cam_options: dict = {"window_bytes": 1 << 20}

    @classmethod
    def backend_str(cls):
        return "cam"

    @classmethod
    def opts(cls, high_priority_stream=False):
        return dict(cls.cam_options)

    # A string, not a method: torch's TestCase.assertRaisesRegex ignores the regex whenever
    # device_type is not one of its native device names (a method never is).
    device_type = "cpu"

    @property
    def pg(self):
        return dist.distributed_c10d._get_default_group()

