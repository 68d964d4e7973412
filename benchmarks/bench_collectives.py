"""cam vs gloo (and optionally Open MPI) on one machine, side by side in one run.

Usage::

    timeout 900 .venv/bin/python benchmarks/bench_collectives.py --ranks 2 4 8 [--quick] \\
        [--mpi] [--out results.md]

For each world size N this spawns N worker processes (torch.multiprocessing, start method
"spawn", rendezvous through a FileStore in a temp dir). Every worker creates a cam world group
(``init_process_group("cam")``) and a gloo group over the same ranks (``new_group(backend=
"gloo")``); the two are measured interleaved, cell by cell, on the same machine state:

* ``roundtrip``: 8-byte (2 x float32) send/recv ping-pong rank 0 <-> rank 1, time per round
  trip as seen by rank 0; ranks >= 2 wait in a (blocking, non-spinning) gloo barrier;
* ``broadcast`` from rank 0 and ``all_to_all_single`` (equal splits; size = per-rank input
  tensor) of float32 tensors of 1 KiB, 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB (``--quick``:
  1 KiB, 64 KiB, 1 MiB, 16 MiB and fewer samples).

Timing (identical for cam, gloo and bench_mpi.py; details in _common.py): warmup, then K
samples; a sample = barrier on the measured backend, then a batch of B back-to-back ops timed on
every rank and divided by B; the sample value is the max over ranks (gathered through gloo after
the timed loop). B and K come from the warmup cost, so they shrink with size and oversubscription.
Median and p90 of the K samples are reported. After timing, each (op, size) result is checked
once with fresh data (``check`` column).

Every world size runs under a hard deadline (``--timeout``, default 300 s); past it the workers
are killed and the partial table is printed with the cell that was running.

``--mpi`` also runs bench_mpi.py (mpirun, Open MPI vader shared memory) for the world sizes in
``--mpi-ranks`` (default: same as ``--ranks``) and adds ``mpi median`` and ``mpi/cam`` columns;
the columns are omitted when mpirun is not on PATH.

Ranks are not pinned unless ``--pin`` (rank r -> core r % ncores, for cam, gloo and MPI alike).
Unpinned, the kernel sometimes places two ranks on one core for a whole run; spinning waiters
then pay scheduler time slices, which shows up as bimodal small-message latencies.

Workers use ``torch.set_num_threads(1)``; gloo is pinned to the loopback interface
(``GLOO_SOCKET_IFNAME=lo`` unless already set).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _p in (_HERE, _REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _common as C  # noqa: E402

BACKENDS = ("cam", "gloo")


# ----------------------------------------------------------------------------- worker side

def _atomic_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _allreduce_max(x: float, gloo) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return float(t.item())


def _all_ok(ok: bool, gloo) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=gloo)
    return bool(t.item())


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
    ok = _all_ok(ok, gloo)
    return times, batch, samples, ok


def _collective_cell(backend: str, op: str, nbytes: int, group, gloo, plan: C.Plan):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = nbytes // 4
    if op == "broadcast":
        buf = torch.full((n,), float(rank), dtype=torch.float32)

        def fn():
            dist.broadcast(buf, 0, group=group)
    else:
        inp = torch.full((n,), float(rank), dtype=torch.float32)
        out = torch.empty(n, dtype=torch.float32)
        out.fill_(0)  # fault the pages in before timing

        def fn():
            dist.all_to_all_single(out, inp, group=group)

    def barrier():
        dist.barrier(group=group)

    w = plan.warmup(nbytes)
    for _ in range(w):
        fn()
    barrier()
    t0 = time.perf_counter()
    for _ in range(w):
        fn()
    est = _allreduce_max((time.perf_counter() - t0) / w, gloo)
    batch, samples = plan.choose(est)
    times = [C.time_batch(fn, batch, before=barrier) for _ in range(samples)]
    tt = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=gloo)

    # correctness, once per size, with values the timed loop never wrote
    idx = torch.arange(n, dtype=torch.int64)
    if op == "broadcast":
        expect = ((idx % 97) * 100 + 7).to(torch.float32)
        if rank == 0:
            buf.copy_(expect)
        else:
            buf.fill_(-1)
        fn()
        ok = torch.equal(buf, expect)
    else:
        chunk = n // world
        k, dst = idx % chunk, idx // chunk
        inp.copy_(((rank * world + dst + 1) + (k % 97) * 100).to(torch.float32))
        out.fill_(-1)
        fn()
        expect = ((dst * world + rank + 1) + (k % 97) * 100).to(torch.float32)
        ok = torch.equal(out, expect)
    ok = _all_ok(ok, gloo)
    return tt.tolist(), batch, samples, ok


def _worker(rank: int, world: int, store_path: str, cfg: dict, result_path: str):
    import torch_cam  # noqa: F401  registers backend "cam"

    torch.set_num_threads(1)
    if cfg["pin"]:  # before any backend thread exists, so they all inherit it
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    timeout = datetime.timedelta(seconds=cfg["op_timeout"])
    store = dist.FileStore(store_path, world)
    dist.init_process_group("cam", store=store, rank=rank, world_size=world, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    groups = {"cam": None, "gloo": gloo}  # None = the cam world group
    plan = C.plan_for(cfg["quick"])
    rows = []
    t_start = time.time()

    def dump(current=None, complete=False):
        if rank == 0:
            _atomic_json(result_path, {"world": world, "rows": rows, "current": current,
                                       "complete": complete, "elapsed_s": time.time() - t_start})

    for op in C.OPS:
        sizes = [C.PINGPONG_BYTES] if op == "roundtrip" else C.sizes_for(cfg["quick"])
        for nbytes in sizes:
            for backend in BACKENDS:
                current = f"{op} {C.fmt_size(nbytes)} {backend}"
                dump(current)
                c0 = time.time()
                if op == "roundtrip":
                    times, batch, samples, ok = _roundtrip_cell(backend, groups[backend], gloo, plan)
                else:
                    times, batch, samples, ok = _collective_cell(
                        backend, op, nbytes, groups[backend], gloo, plan)
                if rank == 0:
                    row = {"op": op, "size": nbytes, "backend": backend, "batch": batch,
                           "samples": samples, "ok": ok, "cell_s": time.time() - c0}
                    row.update(C.summarize(times))
                    rows.append(row)
                    print(f"  [N={world}] {current:32s} median {C.fmt_time(row['median_us']):>10s}"
                          f"  p90 {C.fmt_time(row['p90_us']):>10s}  {samples}x{batch}"
                          f"{'' if ok else '  CHECK FAILED'}  ({row['cell_s']:.1f}s)",
                          file=sys.stderr, flush=True)
    dump(None, complete=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher side

def run_world(world: int, args) -> dict:
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix=f"bench_cam_{world}_")
    store_path = os.path.join(tmp, "store")
    result_path = os.path.join(tmp, "result.json")
    cfg = {"quick": args.quick, "op_timeout": args.op_timeout, "pin": args.pin}
    error = None
    t0 = time.time()
    ctx = mp.start_processes(_worker, args=(world, store_path, cfg, result_path), nprocs=world,
                             join=False, start_method="spawn")
    try:
        while True:
            try:
                if ctx.join(timeout=1.0):
                    break
            except Exception as e:  # a worker failed; torch has terminated the others
                error = f"worker failed: {type(e).__name__}: {str(e)[-3000:]}"
                break
            if time.time() - t0 > args.timeout:
                error = f"deadline of {args.timeout:.0f}s passed; workers killed"
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


def _cam_version() -> str:
    try:
        import torch_cam
        return torch_cam.__version__
    except Exception as e:  # pragma: no cover
        return f"? ({e})"


def header(world: int, args) -> str:
    cores = os.cpu_count()
    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:
        avail = cores
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"## world size {world} — {date}, torch {torch.__version__}, torch_cam {_cam_version()}, "
            f"{cores} cores ({avail} usable, {world / max(avail, 1):.1f} ranks/core), "
            f"python {platform.python_version()}, {'quick' if args.quick else 'full'} mode, "
            f"{'ranks pinned to core rank % cores' if args.pin else 'ranks not pinned'}")


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


def table(world: int, res: dict, mpi: dict | None, args, floor_us: float | None = None) -> str:
    by = {(r["op"], r["size"], r["backend"]): r for r in res["rows"]}
    mpi_rows = {(r["op"], r["size"]): r for r in (mpi or {}).get("rows", [])}
    with_mpi = mpi is not None
    cols = ["op", "size", "cam median", "cam p90", "gloo median", "gloo p90", "gloo/cam (speedup)"]
    if with_mpi:
        cols += ["mpi median", "mpi/cam"]
    cols += ["samples×batch (cam / gloo" + (" / mpi)" if with_mpi else ")"), "check"]
    lines = [header(world, args), "",
             "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    keys = []
    for op in C.OPS:
        sizes = [C.PINGPONG_BYTES] if op == "roundtrip" else C.sizes_for(args.quick)
        keys += [(op, s) for s in sizes]
    for op, size in keys:
        cam, gloo = by.get((op, size, "cam")), by.get((op, size, "gloo"))
        if cam is None and gloo is None:
            continue
        m = mpi_rows.get((op, size))
        med = lambda r: r["median_us"] if r else None  # noqa: E731
        p90 = lambda r: r["p90_us"] if r else None  # noqa: E731
        sb = lambda r: f"{r['samples']}×{r['batch']}" if r else "–"  # noqa: E731
        cells = [op + (" (rank0↔1)" if op == "roundtrip" else ""), C.fmt_size(size),
                 C.fmt_time(med(cam)), C.fmt_time(p90(cam)), C.fmt_time(med(gloo)),
                 C.fmt_time(p90(gloo)), C.fmt_ratio(med(gloo), med(cam))]
        if with_mpi:
            cells += [C.fmt_time(med(m)), C.fmt_ratio(med(m), med(cam))]
        parts = [sb(cam), sb(gloo)] + ([sb(m)] if with_mpi else [])
        cells.append(" / ".join(parts))
        bad = [name for name, r in (("cam", cam), ("gloo", gloo), ("mpi", m)) if r and not r["ok"]]
        cells.append("WRONG: " + ",".join(bad) if bad else "ok")
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    cam_rt = by.get(("roundtrip", C.PINGPONG_BYTES, "cam"))
    if floor_us and cam_rt:
        notes.append(f"do-nothing floor: one send + one recv from Python on torch's 'fake' backend costs "
                     f"{C.fmt_time(floor_us)}; the cam 8 B round trip is "
                     f"{cam_rt['median_us'] / floor_us:.2f}x that")
    if res.get("error"):
        notes.append(f"**error:** {res['error']}" +
                     (f" (running: {res['current']})" if res.get("current") else ""))
    if mpi is not None and mpi.get("error"):
        notes.append(f"**mpi error:** {mpi['error']}")
    if mpi is not None:
        notes.append(f"mpi: `{mpi.get('cmd', '')}`")
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
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--timeout", type=float, default=300, help="hard deadline per world size (s)")
    ap.add_argument("--op-timeout", type=float, default=120,
                    help="timeout given to the process groups (s)")
    ap.add_argument("--pin", action="store_true",
                    help="pin rank r to core r %% ncores (all backends, MPI included); default: unpinned")
    ap.add_argument("--mpi", action="store_true", help="add Open MPI columns (needs mpirun, mpi4py)")
    ap.add_argument("--mpi-ranks", type=int, nargs="+", default=None,
                    help="world sizes to run MPI for (default: --ranks)")
    ap.add_argument("--mpi-single-copy", default=None, help="see bench_mpi.py --mpi-single-copy")
    args = ap.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"

    use_mpi = args.mpi and shutil.which("mpirun") is not None
    if args.mpi and not use_mpi:
        print("note: --mpi given but mpirun is not on PATH; omitting the MPI columns", file=sys.stderr)
    mpi_ranks = set(args.mpi_ranks if args.mpi_ranks is not None else args.ranks)

    t_all = time.time()
    floor_us = do_nothing_floor_us()
    out_parts = [f"# torch_cam collectives benchmark\n\ncommand: `{' '.join([sys.executable] + sys.argv)}`\n"]
    if args.out:
        with open(args.out, "w") as f:
            f.write(out_parts[0])
    for world in args.ranks:
        print(f"== world size {world}: torch workers (cam + gloo)", file=sys.stderr, flush=True)
        try:
            res = run_world(world, args)
        except Exception:
            res = {"world": world, "rows": [], "error": traceback.format_exc()[-2000:]}
        mpi = None
        if use_mpi and world in mpi_ranks:
            print(f"== world size {world}: Open MPI", file=sys.stderr, flush=True)
            import bench_mpi
            mpi = bench_mpi.run_world(world, args.quick, args.timeout, args.mpi_single_copy, args.pin)
        md = table(world, res, mpi, args, floor_us)
        print(md + "\n", flush=True)
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
