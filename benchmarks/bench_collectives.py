"""cam vs gloo (and optionally Open MPI and DeepSpeed's shm all-reduce) on one machine, side by
side in one run.

Usage::

    timeout 900 .venv/bin/python benchmarks/bench_collectives.py --ranks 2 4 8 [--quick] \\
        [--mpi] [--deepspeed] [--single-shot] [--out results.md] [--json results.json]

For each world size N this spawns N worker processes (torch.multiprocessing, start method
"spawn", rendezvous through a FileStore in a temp dir). Every worker creates a cam world group
(``init_process_group("cam")``) and a gloo group over the same ranks (``new_group(backend=
"gloo")``); the two are measured interleaved, cell by cell, on the same machine state:

* ``roundtrip``: 8-byte (2 x float32) send/recv ping-pong rank 0 <-> rank 1, time per round
  trip as seen by rank 0; ranks >= 2 wait in a (blocking, non-spinning) gloo barrier;
* at 1 KiB, 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB per rank (``--quick``: 1 KiB, 64 KiB, 1 MiB,
  16 MiB and fewer samples): ``broadcast`` from rank 0 (float32), ``all_to_all_single`` (float32,
  equal splits; size = per-rank input), ``all_reduce`` SUM in place on float32 and on bfloat16,
  ``all_gather_into_tensor`` (float32; size = per-rank input, the output is N x that) and
  ``reduce_scatter_tensor`` (float32, SUM; size = per-rank input = N x output);
* ``(heap)`` rows, cam only: broadcast, all_to_all_single, all_reduce fp32,
  all_gather_into_tensor and reduce_scatter_tensor with every rank's input allocated by
  ``torch_cam.empty`` in the cam tensor heap, which peers read in place (the path ordinary
  tensors from 1 MiB take by default, under the heap allocator mode; with
  ``TORCH_CAM_HEAP_ALLOCATOR=0`` in the environment the plain rows measure staged tensors). The check also requires cam's ``heap_read_bytes``
  stat to grow on every rank (``heap read`` in the check column; ``no heap read`` when cam
  staged the op anyway) above ``eager_max_bytes``; inputs up to it go through the eager area
  whatever their memory (``eager``: one synchronisation per op);
* ``(direct)`` rows, cam only: all_reduce fp32 / bf16 through ``torch_cam.all_reduce_`` (no
  torch.distributed Python layer, no Work object), the fair comparison with DeepSpeed's op;
* ``memcpy bound`` at 16 MiB and 64 MiB: every rank copies that many bytes of its own at the
  same moment (``out.copy_(inp)``), timed like a collective (barrier, then the copy on every rank,
  max over ranks): the single-copy bound of an all-to-all of that size. With more ranks than
  cores it is a loose bound (a rank's clock does not run while it waits for a core, whereas a
  collective waits for its slowest peer), so the ratio is pessimistic there. The notes give bound / time for the all_to_all and all_reduce rows
  (the heap all_to_all target is >= 0.70).

Timed all-reduces run on zeros (an in-place SUM loop would otherwise grow the values to inf);
the check refills the input.

Timing (identical for cam, gloo and bench_mpi.py; details in _common.py): warmup, then K
samples; a sample = barrier on the measured backend, then a batch of B back-to-back ops timed on
every rank and divided by B; the sample value is the max over ranks (gathered through gloo after
the timed loop). B and K come from the warmup cost, so they shrink with size and oversubscription.
``--single-shot`` makes B = 1 for every cell (MPI included): one op right after the barrier, as a
training step issues ops, paying whatever a batch hides (waking, cold lines, the engine's first
pass). From 1 MiB up B is 1 anyway.
Median and p90 of the K samples are reported. After timing, each (op, size) result is checked
once with fresh data (``check`` column).

Every world size runs under a hard deadline (``--timeout``, default 600 s); past it the workers
are killed and the partial table is printed with the cell that was running.

``--mpi`` also runs bench_mpi.py (mpirun, Open MPI vader shared memory) for the world sizes in
``--mpi-ranks`` (default: same as ``--ranks``) and adds ``mpi median`` and ``mpi/cam`` columns;
the columns are omitted when mpirun is not on PATH. MPI has no bfloat16: those cells are n/a.

``--oneccl`` also runs bench_oneccl.py (Intel oneCCL's CPU collectives from a C++ worker, each
cell the best of a few settings; the wheels are fetched and the worker built on first use) and
adds ``ccl median`` and ``ccl/cam`` columns for the ops oneCCL has.

``--deepspeed`` (off by default) adds DeepSpeed's CPU shared-memory all-reduce
(benchmarks/_deepspeed_shm.py) as ``ds-shm`` columns of the all_reduce rows, measured in the same
workers, interleaved with cam and gloo. It is JIT-built the first time (~30-50 s, done once in the
launcher before any deadline starts, then cached). Its waits busy-spin, so with more ranks than
cores every op costs scheduler time slices: it gets half the sample budget and each cell is capped
at ``--ds-cap`` seconds (default 2 with ``--quick``, else 5; the untimed first op is timed, and a
cell whose first op alone passes the cap reports that op) so that it cannot eat the world size's
deadline. ``(capped)`` marks cells that got fewer samples than the plan asked for.

Ratios are time ratios: ``x gloo (gloo/cam)`` is gloo's median over cam's (> 1: cam is faster),
likewise ``mpi/cam`` and ``ds/cam``.

Ranks are not pinned unless ``--pin`` (rank r -> core r % ncores, for cam, gloo and MPI alike).
Unpinned, the kernel sometimes places two ranks on one core for a whole run; spinning waiters
then pay scheduler time slices, which shows up as bimodal small-message latencies.

Workers use ``torch.set_num_threads(1)``; gloo is pinned to the loopback interface
(``GLOO_SOCKET_IFNAME=lo`` unless already set).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _p in (_HERE, _REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _common as C  # noqa: E402
import _harness as H  # noqa: E402
import bench_oneccl  # noqa: E402

BACKENDS = ("cam", "gloo")


# ----------------------------------------------------------------------------- worker side

def _roundtrip_cell(backend: str, group, gloo, plan: C.Plan):
    rank = dist.get_rank()
    buf = torch.zeros(C.PINGPONG_BYTES // 4, dtype=torch.float32)
    times: list[float] = []
    batch = samples = 0
    ok = True
    if rank <= 1:
        if rank == 0:
            def rt():
                dist.send(buf, 1, group=group)
                dist.recv(buf, 1, group=group)
        else:
            def rt():
                dist.recv(buf, 0, group=group)
                dist.send(buf, 0, group=group)

        w = plan.warmup(C.PINGPONG_BYTES) * 10
        for _ in range(w):
            rt()
        t0 = time.perf_counter()
        for _ in range(w):
            rt()
        est = torch.tensor([(time.perf_counter() - t0) / w], dtype=torch.float64)
        # rank 1 adopts rank 0's estimate so both run the same number of round trips
        if rank == 0:
            dist.send(est, 1, group=gloo)
        else:
            dist.recv(est, 0, group=gloo)
        batch, samples = plan.choose(float(est.item()))
        times = [C.time_batch(rt, batch) for _ in range(samples)]
        # correctness: echo a distinctive payload through the measured backend
        if rank == 0:
            buf.copy_(torch.tensor([1234.5, -6.25]))
            dist.send(buf, 1, group=group)
            buf.zero_()
            dist.recv(buf, 1, group=group)
            ok = buf.tolist() == [1234.5, -6.25]
        else:
            buf.zero_()
            dist.recv(buf, 0, group=group)
            dist.send(buf, 0, group=group)
    dist.barrier(group=gloo)  # ranks >= 2 wait here the whole time (gloo blocks, no spinning)
    ok = H.all_ok(ok, gloo)
    return times, batch, samples, ok


def _dtype(op: str) -> torch.dtype:
    return torch.bfloat16 if op == "all_reduce_bf16" else torch.float32


def _buffers(op: str, nbytes: int, world: int, heap: bool) -> dict:
    """The tensors of one cell. For heap cells the input lives in the cam tensor heap."""
    dtype = _dtype(op)
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    if op == "reduce_scatter_tensor":
        n -= n % world  # input = world x output

    def alloc(count):
        if heap:
            import torch_cam
            return torch_cam.empty(count, dtype=dtype)
        return torch.empty(count, dtype=dtype)

    b = {"n": n, "inp": alloc(n)}
    b["inp"].fill_(0 if op.startswith("all_reduce") else dist.get_rank())  # zeros stay zeros in a loop of SUMs
    out_n = {"all_to_all_single": n, "memcpy": n, "all_gather_into_tensor": n * world,
             "reduce_scatter_tensor": n // world}.get(op)
    if out_n is not None:
        b["out"] = torch.empty(out_n, dtype=dtype)
        b["out"].fill_(0)  # fault the pages in before timing
    return b


def _op_fn(op: str, b: dict, group, ds=None, direct=False):
    inp, out = b["inp"], b.get("out")
    if op == "broadcast":
        return lambda: dist.broadcast(inp, 0, group=group)
    if op == "all_to_all_single":
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if op == "memcpy":
        return lambda: out.copy_(inp)
    if op.startswith("all_reduce"):
        if ds is not None:
            return lambda: ds(inp)
        if direct:
            import torch_cam
            return lambda: torch_cam.all_reduce_(inp, group=group)
        return lambda: dist.all_reduce(inp, group=group)
    if op == "all_gather_into_tensor":
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if op == "reduce_scatter_tensor":
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    raise ValueError(op)


def _check(op: str, b: dict, fn, rank: int, world: int) -> bool:
    """Runs fn once on values the timed loop never wrote; True when this rank's result is exact.
    Every value (and every partial sum, in any order) is an integer that fp32 / bf16 hold exactly."""
    n, inp, out = b["n"], b["inp"], b.get("out")
    idx = torch.arange(n, dtype=torch.int64)
    f32 = torch.float32
    if op == "broadcast":
        expect = ((idx % 97) * 100 + 7).to(f32)
        if rank == 0:
            inp.copy_(expect)
        else:
            inp.fill_(-1)
        fn()
        return torch.equal(inp, expect)
    if op in ("all_to_all_single", "memcpy"):
        chunk = n // world
        k, dst = idx % chunk, idx // chunk
        inp.copy_(((rank * world + dst + 1) + (k % 97) * 100).to(f32))
        out.fill_(-1)
        fn()
        if op == "memcpy":
            return torch.equal(out, inp)
        return torch.equal(out, ((dst * world + rank + 1) + (k % 97) * 100).to(f32))
    if op == "all_reduce":
        inp.copy_(((idx % 97) * 4 + rank + 1).to(f32))
        fn()
        return torch.equal(inp, ((idx % 97) * 4 * world + world * (world + 1) // 2).to(f32))
    if op == "all_reduce_bf16":  # sums stay <= 256: exact in bf16 whatever the order
        inp.copy_((idx % 4 + rank).to(inp.dtype))
        fn()
        return torch.equal(inp, ((idx % 4) * world + world * (world - 1) // 2).to(inp.dtype))
    if op == "all_gather_into_tensor":
        base = ((idx % 97) * 4 + 1).to(f32)
        inp.copy_(base + 1000 * rank)
        out.fill_(-1)
        fn()
        return all(torch.equal(out[r * n:(r + 1) * n], base + 1000 * r) for r in range(world))
    if op == "reduce_scatter_tensor":
        chunk = n // world
        k, d = idx % chunk, idx // chunk
        inp.copy_(((k % 97) * 4 + rank + 1000 * d + 1).to(f32))
        out.fill_(-1)
        fn()
        kk = idx[:chunk] % 97
        return torch.equal(out, (world * (kk * 4 + 1000 * rank + 1) + world * (world - 1) // 2).to(f32))
    raise ValueError(op)


def _collective_cell(backend: str, op: str, nbytes: int, group, gloo, plan: C.Plan,
                     heap: bool = False, ds=None, cap_s: float | None = None, direct: bool = False):
    """Times one (op, size) on one backend; returns (times, batch, samples, ok, extra).
    heap: input in the cam tensor heap (extra["heap_read"]: heap_read_bytes grew in the check);
    ds: DeepSpeed's allreduce callable instead of dist.all_reduce; cap_s: time cap of the cell."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = _buffers(op, nbytes, world, heap)
    fn = _op_fn(op, b, group, ds, direct)
    extra = {}

    def barrier():
        dist.barrier(group=group)

    w = plan.warmup(nbytes)
    if cap_s is None:
        for _ in range(w):
            fn()
        barrier()
    else:  # the untimed op is timed, so that one slow op cannot blow the cap unnoticed
        barrier()
        t0 = time.perf_counter()
        fn()
        first = H.allreduce_max(time.perf_counter() - t0, gloo)
        if first > cap_s:
            w = 0
            extra["capped"] = True
        else:
            w = max(1, min(w, int(0.25 * cap_s / first)))
        barrier()
    if w:
        t0 = time.perf_counter()
        for _ in range(w):
            fn()
        est = H.allreduce_max((time.perf_counter() - t0) / w, gloo)
        if cap_s is None:
            batch, samples = plan.choose(est)
        else:
            batch, samples = plan.choose_capped(est, cap_s - first - w * est)
            if (batch, samples) != plan.choose(est):
                extra["capped"] = True
        times = [C.time_batch(fn, batch, before=barrier) for _ in range(samples)]
        times = H.max_over_ranks(times, gloo)
    else:  # the first op alone took longer than the cap: it is the only sample
        batch, samples, times = 1, 1, [first]

    # correctness, once per size, with values the timed loop never wrote
    if heap:
        import torch_cam
        stats = torch_cam.get_cam_backend(group)
        before = stats.stats()["heap_read_bytes"]
    ok = _check(op, b, fn, rank, world)
    ok = H.all_ok(ok, gloo)
    if heap:
        # A broadcast root is read, it reads nothing. Inputs that fit the eager area go through
        # it instead (one synchronisation beats reading in place), so they read nothing either.
        if nbytes <= torch_cam.Options().eager_max_bytes:
            extra["eager"] = True
        else:
            read = stats.stats()["heap_read_bytes"] > before or (op == "broadcast" and rank == 0)
            extra["heap_read"] = H.all_ok(read, gloo)
    return times, batch, samples, ok, extra


def _backends(op: str, cfg: dict) -> list[str]:
    if op == "memcpy":
        return ["local"]
    names = list(BACKENDS)
    if op in C.HEAP_OPS:
        names.append("cam-heap")
    if op in C.DS_OPS:
        names.append("cam-direct")
    if op in C.DS_OPS and cfg["deepspeed"]:
        names.append("ds-shm")
    return names


def _worker(rank: int, world: int, store_path: str, cfg: dict, result_path: str):
    H.setup_worker(rank, cfg["pin"])
    gloo = H.init_groups(rank, world, store_path, cfg["op_timeout"])
    groups = {"cam": None, "gloo": gloo, "cam-heap": None, "cam-direct": None, "local": None,
              "ds-shm": None}
    plan = C.plan_for(cfg["quick"], cfg["single_shot"])
    rows = []
    t_start = time.time()
    ds, ds_error = None, None
    if cfg["deepspeed"]:
        from _deepspeed_shm import DeepSpeedShmUnavailable, make_ds_allreduce
        try:
            ds = make_ds_allreduce()  # collective; the ranks agree on failure
        except DeepSpeedShmUnavailable as e:
            ds_error = str(e)
            cfg = dict(cfg, deepspeed=False)

    def dump(current=None, complete=False):
        if rank == 0:
            H.atomic_json(result_path, {"world": world, "rows": rows, "current": current,
                                        "complete": complete, "elapsed_s": time.time() - t_start,
                                        "ds_error": ds_error})

    for op in C.OPS:
        for nbytes in C.op_sizes(op, cfg["quick"]):
            for backend in _backends(op, cfg):
                current = f"{C.label(op)} {C.fmt_size(nbytes)} {backend}"
                dump(current)
                c0 = time.time()
                extra = {}
                if op == "roundtrip":
                    times, batch, samples, ok = _roundtrip_cell(backend, groups[backend], gloo, plan)
                elif backend == "ds-shm":
                    try:
                        times, batch, samples, ok, extra = _collective_cell(
                            backend, op, nbytes, None, gloo, plan.slow(), ds=ds, cap_s=cfg["ds_cap"])
                    except (TypeError, ValueError) as e:  # e.g. a dtype this CPU's kernels lack
                        times, batch, samples, ok, extra = [], 0, 0, True, {"error": str(e)}
                else:
                    times, batch, samples, ok, extra = _collective_cell(
                        backend, op, nbytes, groups[backend], gloo, plan, heap=backend == "cam-heap",
                        direct=backend == "cam-direct")
                if rank == 0:
                    row = {"op": op, "size": nbytes, "backend": backend, "batch": batch,
                           "samples": samples, "ok": ok, "cell_s": time.time() - c0}
                    row.update(extra)
                    row.update(C.summarize(times))
                    rows.append(row)
                    flags = ("" if ok else "  CHECK FAILED") + \
                        ("  (no heap read)" if row.get("heap_read") is False else "") + \
                        ("  capped" if row.get("capped") else "") + \
                        (f"  {row['error']}" if row.get("error") else "")
                    print(f"  [N={world}] {current:42s} median {C.fmt_time(row['median_us']):>10s}"
                          f"  p90 {C.fmt_time(row['p90_us']):>10s}  {samples}x{batch}"
                          f"{flags}  ({row['cell_s']:.1f}s)", file=sys.stderr, flush=True)
    dump(None, complete=True)
    H.finish_worker(gloo)


# ----------------------------------------------------------------------------- launcher side

def run_world(world: int, args) -> dict:
    cfg = {"quick": args.quick, "single_shot": args.single_shot, "op_timeout": args.op_timeout, "pin": args.pin,
           "deepspeed": args.deepspeed and not args.ds_unavailable, "ds_cap": args.ds_cap}
    return H.run_world(_worker, world, cfg, args.timeout, "bench_cam")


def header(world: int, args) -> str:
    return f"## world size {world} — {H.machine_line(world, args.quick, args.pin, args.single_shot)}"


_FLOOR_SCRIPT = """
import statistics, time, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
x = torch.zeros(2)
def rt():
    dist.send(x, 1)
    dist.recv(x, 1)
for _ in range(2000):
    rt()
samples = []
for _ in range(21):
    t0 = time.perf_counter()
    for _ in range(1000):
        rt()
    samples.append((time.perf_counter() - t0) / 1000)
print(statistics.median(samples) * 1e6)
"""


def do_nothing_floor_us() -> float | None:
    """What one rank pays for a send + a recv from Python on a backend that does nothing
    (torch's own "fake" backend): the Python floor the round-trip target is measured against."""
    try:
        out = subprocess.run([sys.executable, "-c", _FLOOR_SCRIPT], capture_output=True, text=True,
                             timeout=120, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def table(world: int, res: dict, refs: dict[str, dict | None], args, floor_us: float | None = None) -> str:
    """refs: the libraries measured in processes of their own ("mpi": bench_mpi.py, "ccl":
    bench_oneccl.py), each a run_world result or None where not run."""
    by = {(r["op"], r["size"], r["backend"]): r for r in res["rows"]}
    refs = {name: ref for name, ref in refs.items() if ref is not None}
    ref_rows = {name: {(r["op"], r["size"]): r for r in ref.get("rows", [])} for name, ref in refs.items()}
    with_ds = bool(getattr(args, "deepspeed", False)) or any(r["backend"] == "ds-shm" for r in res["rows"])
    cols = ["op", "size", "cam median", "cam p90", "gloo median", "gloo p90", "x gloo (gloo/cam)"]
    for name in refs:
        cols += [f"{name} median", f"{name}/cam"]
    if with_ds:
        cols += ["ds-shm median", "ds-shm p90", "ds/cam"]
    cols += ["samples×batch (cam / gloo" + "".join(f" / {name}" for name in refs) + (" / ds" if with_ds else "") +
             ")", "check"]
    lines = [header(world, args), "",
             "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    med = lambda r: r["median_us"] if r else None  # noqa: E731
    p90 = lambda r: r["p90_us"] if r else None  # noqa: E731
    sb = lambda r: f"{r['samples']}×{r['batch']}" if r and r.get("samples") else "–"  # noqa: E731
    no_heap_read = []
    for op in C.OPS:
        variants = [("local", "")] if op == "memcpy" else \
            [("cam", "")] + ([("cam-heap", " (heap)")] if op in C.HEAP_OPS else []) + \
            ([("cam-direct", " (direct)")] if op in C.DS_OPS else [])
        for size in C.op_sizes(op, args.quick):
            gloo = by.get((op, size, "gloo"))
            ref = {name: rows.get((op, size)) for name, rows in ref_rows.items()}
            d = by.get((op, size, "ds-shm"))
            if d is not None and d.get("error"):
                d = None
            for key, suffix in variants:
                cam = by.get((op, size, key))
                if cam is None and (key != "cam" or gloo is None):
                    continue
                name = C.label(op) + suffix + (" (rank0↔1)" if op == "roundtrip" else "")
                cells = [name, C.fmt_size(size), C.fmt_time(med(cam)), C.fmt_time(p90(cam))]
                if key == "local":  # reference row: nothing to compare with
                    cells += ["–", "–", "–"] + ["–", "–"] * len(refs) + (["–", "–", "–"] if with_ds else [])
                    cells.append(sb(cam))
                else:
                    cells += [C.fmt_time(med(gloo)), C.fmt_time(p90(gloo)), C.fmt_ratio(med(gloo), med(cam))]
                    for r in ref.values():
                        cells += [C.fmt_time(med(r)), C.fmt_ratio(med(r), med(cam))]
                    if with_ds:
                        ds_cells = [C.fmt_time(med(d)), C.fmt_time(p90(d)), C.fmt_ratio(med(d), med(cam))]
                        if d is not None and d.get("capped"):
                            ds_cells[0] += " (capped)"
                        cells += ds_cells if op in C.DS_OPS else ["–", "–", "–"]
                    if key in ("cam-heap", "cam-direct"):  # cam variants: the other columns repeat the row above
                        cells.append(sb(cam))
                    else:
                        parts = [sb(cam), sb(gloo)] + [sb(r) for r in ref.values()] + ([sb(d)] if with_ds else [])
                        cells.append(" / ".join(parts))
                if key == "cam-heap":
                    check = "ok" if cam["ok"] else "WRONG: cam-heap"
                    if cam.get("heap_read") is False:
                        check += ", no heap read"
                        no_heap_read.append(f"{C.label(op)} {C.fmt_size(size)}")
                    elif cam.get("heap_read"):
                        check += ", heap read"
                    elif cam.get("eager"):
                        check += ", eager"
                    cells.append(check)
                else:
                    named = (("cam" if key == "cam" else "memcpy", cam), ("gloo", gloo), *ref.items(), ("ds", d))
                    bad = [nm for nm, r in named if r and not r["ok"]]
                    cells.append("WRONG: " + ",".join(bad) if bad else "ok")
                lines.append("| " + " | ".join(cells) + " |")
    notes = ["`(direct)` rows: the same all_reduce through `torch_cam.all_reduce_`, which skips "
             "torch.distributed's Python layer and Work object (as DeepSpeed's op skips them); the "
             "other columns repeat the row above.",
             "`(heap)` rows: cam with every rank's input in its tensor heap (`torch_cam.empty`), which "
             "peers read in place; gloo/mpi/ds-shm have no such memory, so their columns (and the ratios) "
             "repeat the ordinary-tensor measurement of the same op. `heap read`: the check saw cam's "
             "`heap_read_bytes` grow on every rank (the in-place path ran); `eager`: the input fits "
             "the eager area (`eager_max_bytes`), which every op takes instead."]
    if no_heap_read:
        notes.append("no heap read (cam staged these although the inputs were heap-resident): " +
                     ", ".join(no_heap_read))
    for size in C.MEMCPY_SIZES:
        bound = by.get(("memcpy", size, "local"))
        if not bound:
            continue
        ratio = lambda op, key: (bound["median_us"] / by[(op, size, key)]["median_us"]  # noqa: E731
                                 if (op, size, key) in by else None)
        a2a_heap, a2a = ratio("all_to_all_single", "cam-heap"), ratio("all_to_all_single", "cam")
        ar_heap, ar = ratio("all_reduce", "cam-heap"), ratio("all_reduce", "cam")
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        note = (f"memcpy bound at {C.fmt_size(size)}: every rank copies {C.fmt_size(size)} at once "
                f"(`out.copy_(inp)`, max over ranks) in {C.fmt_time(bound['median_us'])}"
                f"{' (loose with more ranks than cores)' if world > H.usable_cores() else ''}. "
                f"bound / all_to_all_single time: heap {fmt(a2a_heap)}")
        if a2a_heap is not None:
            note += f" (target ≥ 0.70: {'met' if a2a_heap >= 0.7 else 'NOT met'})"
        note += (f", ordinary {fmt(a2a)}; same ratio for all_reduce fp32 (a reference there, not a "
                 f"bound: a two-shot all-reduce copies less than the whole tensor per rank): heap "
                 f"{fmt(ar_heap)}, ordinary {fmt(ar)}")
        notes.append(note)
    if with_ds:
        ds_rows = [r for r in res["rows"] if r["backend"] == "ds-shm"]
        capped = [f"{C.label(r['op'])} {C.fmt_size(r['size'])}" for r in ds_rows if r.get("capped")]
        errs = [f"{C.label(r['op'])} {C.fmt_size(r['size'])}: {r['error']}" for r in ds_rows if r.get("error")]
        notes.append(f"ds-shm: DeepSpeed's shm all-reduce (benchmarks/_deepspeed_shm.py, busy-waiting), "
                     f"smaller sample budget and at most {args.ds_cap:g} s per cell" +
                     (f"; capped cells: {', '.join(capped)}" if capped else ""))
        if errs:
            notes.append("ds-shm not measured: " + "; ".join(errs))
        if res.get("ds_error"):
            notes.append(f"**ds-shm unavailable:** {res['ds_error']}")
        elif getattr(args, "ds_unavailable", None):
            notes.append(f"**ds-shm unavailable:** {args.ds_unavailable}")
    cam_rt = by.get(("roundtrip", C.PINGPONG_BYTES, "cam"))
    if floor_us and cam_rt:
        notes.append(f"do-nothing floor: one send + one recv from Python on torch's 'fake' backend costs "
                     f"{C.fmt_time(floor_us)}; the cam 8 B round trip is "
                     f"{cam_rt['median_us'] / floor_us:.2f}x that")
    if res.get("error"):
        notes.append(f"**error:** {res['error']}" +
                     (f" (running: {res['current']})" if res.get("current") else ""))
    for name, ref in refs.items():
        if ref.get("error"):
            notes.append(f"**{name} error:** {ref['error']}")
    if "mpi" in refs:
        notes.append(f"mpi: `{refs['mpi'].get('cmd', '')}` (no bf16 in MPI: its all_reduce bf16 cells are n/a)")
    if "ccl" in refs:
        won = collections.Counter(r.get("setting", "?") for r in refs["ccl"].get("rows", []))
        notes.append(f"ccl: Intel oneCCL {bench_oneccl.VERSION} (benchmarks/bench_oneccl.py, C++ worker), each cell "
                     f"the best median over its settings (cells won: " +
                     ", ".join(f"{k} {v}" for k, v in sorted(won.items())) + f"); `{refs['ccl'].get('cmd', '')}`")
    notes.append(f"torch workers wall time for this world size: {res.get('wall_s', math.nan):.1f} s")
    if res.get("load_before"):
        lb, la = res["load_before"], res["load_after"]
        notes.append(f"load average (1/5/15 min) before: {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f}, "
                     f"after: {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} (the previous world size's ranks "
                     f"count in it; load beyond that is other jobs sharing the cores)")
    lines += [""] + notes
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    ap.add_argument("--single-shot", action="store_true",
                    help="every sample is one op right after a barrier (default: a batch of back-to-back ops)")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--json", help="also write every measured row here (what plot_results.py draws)")
    ap.add_argument("--timeout", type=float, default=600, help="hard deadline per world size (s)")
    ap.add_argument("--op-timeout", type=float, default=120,
                    help="timeout given to the process groups (s)")
    ap.add_argument("--pin", action="store_true",
                    help="pin rank r to core r %% ncores (all backends, MPI included); default: unpinned")
    ap.add_argument("--mpi", action="store_true", help="add Open MPI columns (needs mpirun, mpi4py)")
    ap.add_argument("--mpi-ranks", type=int, nargs="+", default=None,
                    help="world sizes to run MPI for (default: --ranks)")
    ap.add_argument("--mpi-single-copy", default=None, help="see bench_mpi.py --mpi-single-copy")
    ap.add_argument("--oneccl", action="store_true",
                    help="add Intel oneCCL columns (bench_oneccl.py: fetched and built on first use)")
    ap.add_argument("--deepspeed", action="store_true",
                    help="add DeepSpeed's shm all-reduce (ds-shm columns) to the all_reduce rows; off by "
                         "default (needs deepspeed, ninja, g++; JIT-builds once, ~30-50 s, then cached)")
    ap.add_argument("--ds-cap", type=float, default=None,
                    help="time cap of one ds-shm cell in seconds (default: 2 with --quick, else 5)")
    args = ap.parse_args()
    if args.ds_cap is None:
        args.ds_cap = 2.0 if args.quick else 5.0
    args.ds_unavailable = None

    H.prepare_env()

    use_mpi = args.mpi and shutil.which("mpirun") is not None
    if args.mpi and not use_mpi:
        print("note: --mpi given but mpirun is not on PATH; omitting the MPI columns", file=sys.stderr)
    mpi_ranks = set(args.mpi_ranks if args.mpi_ranks is not None else args.ranks)

    t_all = time.time()
    if args.deepspeed:  # build (or load the cached) extension once here, outside any deadline
        print("== DeepSpeed shm all-reduce: loading (JIT-built the first time, ~30-50 s)", file=sys.stderr,
              flush=True)
        try:
            import _deepspeed_shm
            _deepspeed_shm._load_op(verbose=False)
        except Exception as e:  # DeepSpeedShmUnavailable, or anything deepspeed's import raises
            args.ds_unavailable = f"{type(e).__name__}: {e}"
            print(f"note: --deepspeed: {args.ds_unavailable}; omitting the ds-shm measurements",
                  file=sys.stderr, flush=True)
    floor_us = do_nothing_floor_us()
    out_parts = [f"# torch_cam collectives benchmark\n\ncommand: `{' '.join([sys.executable] + sys.argv)}`\n"]
    if args.out:
        with open(args.out, "w") as f:
            f.write(out_parts[0])
    measured = {"command": " ".join([sys.executable] + sys.argv), "machine": {}, "rows": []}
    for world in args.ranks:
        print(f"== world size {world}: torch workers (cam + gloo)", file=sys.stderr, flush=True)
        res = run_world(world, args)  # a failed launch comes back as an error
        mpi = ccl = None
        if use_mpi and world in mpi_ranks:
            print(f"== world size {world}: Open MPI", file=sys.stderr, flush=True)
            import bench_mpi
            mpi = bench_mpi.run_world(world, args.quick, args.timeout, args.mpi_single_copy, args.pin,
                                      single_shot=args.single_shot)
        if args.oneccl:
            print(f"== world size {world}: oneCCL", file=sys.stderr, flush=True)
            ccl = bench_oneccl.run_world(world, args.quick, args.timeout, args.pin, single_shot=args.single_shot)
        md = table(world, res, {"mpi": mpi, "ccl": ccl}, args, floor_us)
        print(md + "\n", flush=True)
        if args.json:
            measured["machine"][str(world)] = H.machine_line(world, args.quick, args.pin, args.single_shot)
            for r in res.get("rows", []):
                measured["rows"].append({"world": world, "op": r["op"], "size": r["size"],
                                         "backend": r["backend"], "median_us": r.get("median_us")})
            for r in [dict(r, lib="mpi") for r in (mpi or {}).get("rows", [])] + \
                    [dict(r, lib="ccl") for r in (ccl or {}).get("rows", [])]:
                measured["rows"].append({"world": world, "op": r["op"], "size": r["size"], "backend": r["lib"],
                                         "median_us": r.get("median_us")})
            with open(args.json, "w") as f:
                json.dump(measured, f, indent=1)
        out_parts.append(md + "\n")
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(out_parts))
    total = f"total wall time: {time.time() - t_all:.1f} s"
    print(total)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(out_parts + [total + "\n"]))


if __name__ == "__main__":
    main()
