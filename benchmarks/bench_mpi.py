"""Open MPI shared-memory reference for bench_collectives.py, through mpi4py.

Measures the same ops as bench_collectives.py with the same timing method (see _common.py):
8-byte Send/Recv ping-pong round trip between rank 0 and rank 1, ``Bcast`` from rank 0,
``Alltoall`` (equal splits; size = per-rank send buffer), in-place ``Allreduce`` (SUM),
``Allgather`` (size = per-rank send buffer) and ``Reduce_scatter_block`` (SUM; size = per-rank
send buffer = N x receive buffer) on numpy float32 buffers. MPI has no bfloat16 datatype, so
the bf16 all-reduce of bench_collectives.py has no MPI counterpart.

Setup (Debian 12 here: Open MPI 4.1.4, mpi4py 4.1.2)::

    apt-get update && apt-get install -y openmpi-bin libopenmpi-dev
    .venv/bin/pip install mpi4py

Launcher mode (not under mpirun): runs one ``mpirun`` per world size and prints a markdown
table per world size::

    timeout 600 .venv/bin/python benchmarks/bench_mpi.py --ranks 2 4 [--quick] [--json out.json]

which executes, per world size N, exactly (OMPI 4; with OMPI >= 5 ``vader`` becomes ``sm``)::

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np N \\
        --mca pml ob1 --mca btl self,vader \\
        .venv/bin/python benchmarks/bench_mpi.py --worker --json /tmp/....json

``--mca pml ob1 --mca btl self,vader`` pins the shared-memory BTL (no UCX, no TCP).
vader's default single-copy mechanism (CMA, process_vm_readv) works in this container; where
it does not (ptrace restricted), add ``--mpi-single-copy none`` (sets
``--mca btl_vader_single_copy_mechanism none``). ``--bind-to none`` matches the torch workers,
which are not pinned either; ``--pin`` uses ``--map-by core --bind-to core:overload-allowed``
instead (rank r on core r % ncores, as bench_collectives.py --pin does). Idle ranks in the round trip wait in ``Ibarrier`` polled with
1 ms sleeps so they do not spin (MPI_Barrier would busy-poll).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


# ----------------------------------------------------------------------------- worker (under mpirun)

def _idle_wait(comm):
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def _roundtrip(comm, plan, MPI, np):
    rank = comm.rank
    buf = np.zeros(C.PINGPONG_BYTES // 4, dtype=np.float32)
    est = np.zeros(1)
    times = []
    batch = samples = 0
    ok = True
    if rank <= 1:
        peer = 1 - rank

        def rt():
            if rank == 0:
                comm.Send(buf, dest=1, tag=7)
                comm.Recv(buf, source=1, tag=7)
            else:
                comm.Recv(buf, source=0, tag=7)
                comm.Send(buf, dest=0, tag=7)

        w = plan.warmup(C.PINGPONG_BYTES) * 10
        for _ in range(w):
            rt()
        t0 = time.perf_counter()
        for _ in range(w):
            rt()
        est[0] = (time.perf_counter() - t0) / w
        # both sides agree on the plan: rank 0's estimate
        if rank == 0:
            comm.Send(est, dest=1, tag=8)
        else:
            comm.Recv(est, source=0, tag=8)
        batch, samples = plan.choose(float(est[0]))
        times = [C.time_batch(rt, batch) for _ in range(samples)]
        # correctness: echo a distinctive payload
        if rank == 0:
            buf[:] = [1234.5, -6.25]
            comm.Send(buf, dest=1, tag=9)
            buf[:] = 0
            comm.Recv(buf, source=1, tag=9)
            ok = bool(buf[0] == 1234.5 and buf[1] == -6.25)
        else:
            comm.Recv(buf, source=0, tag=9)
            comm.Send(buf, dest=0, tag=9)
        _ = peer
    _idle_wait(comm)
    ok = comm.allreduce(ok, op=MPI.LAND)
    return times if rank == 0 else None, batch, samples, ok


def _buffers(op, nbytes, world, rank, np):
    n = nbytes // 4
    if op == "reduce_scatter_tensor":
        n -= n % world  # send = world x recv
    send = np.full(n, 0.0 if op == "all_reduce" else float(rank), dtype=np.float32)
    recv_n = {"all_to_all_single": n, "all_gather_into_tensor": n * world,
              "reduce_scatter_tensor": n // world}.get(op)
    recv = None
    if recv_n is not None:
        recv = np.empty(recv_n, dtype=np.float32)
        recv[:] = 0  # fault the pages in before timing
    return n, send, recv


def _op_fn(op, comm, send, recv, MPI):
    if op == "broadcast":
        return lambda: comm.Bcast(send, root=0)
    if op == "all_to_all_single":
        return lambda: comm.Alltoall(send, recv)
    if op == "all_reduce":  # in place, as dist.all_reduce (zeros stay zeros)
        return lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM)
    if op == "all_gather_into_tensor":
        return lambda: comm.Allgather(send, recv)
    if op == "reduce_scatter_tensor":
        return lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
    raise ValueError(op)


def _check(op, n, send, recv, fn, rank, world, np):
    """Once per size, after timing, with fresh values; the same values as bench_collectives.py."""
    idx = np.arange(n, dtype=np.int64)
    if op == "broadcast":
        expect = ((idx % 97) * 100 + 7).astype(np.float32)
        if rank == 0:
            send[:] = expect
        else:
            send[:] = -1
        fn()
        return bool(np.array_equal(send, expect))
    if op == "all_to_all_single":
        chunk = n // world
        k = idx % chunk
        dst = idx // chunk
        send[:] = ((rank * world + dst + 1) + (k % 97) * 100).astype(np.float32)
        recv[:] = -1
        fn()
        expect = ((dst * world + rank + 1) + (k % 97) * 100).astype(np.float32)
        return bool(np.array_equal(recv, expect))
    if op == "all_reduce":
        send[:] = ((idx % 97) * 4 + rank + 1).astype(np.float32)
        fn()
        return bool(np.array_equal(send, ((idx % 97) * 4 * world + world * (world + 1) // 2).astype(np.float32)))
    if op == "all_gather_into_tensor":
        base = ((idx % 97) * 4 + 1).astype(np.float32)
        send[:] = base + 1000 * rank
        recv[:] = -1
        fn()
        return all(bool(np.array_equal(recv[r * n:(r + 1) * n], base + 1000 * r)) for r in range(world))
    if op == "reduce_scatter_tensor":
        chunk = n // world
        k = idx % chunk
        d = idx // chunk
        send[:] = ((k % 97) * 4 + rank + 1000 * d + 1).astype(np.float32)
        recv[:] = -1
        fn()
        kk = idx[:chunk] % 97
        return bool(np.array_equal(recv, (world * (kk * 4 + 1000 * rank + 1) + world * (world - 1) // 2)
                                   .astype(np.float32)))
    raise ValueError(op)


def _collective(comm, op, nbytes, plan, MPI, np):
    rank, world = comm.rank, comm.size
    n, send, recv = _buffers(op, nbytes, world, rank, np)
    fn = _op_fn(op, comm, send, recv, MPI)

    w = plan.warmup(nbytes)
    for _ in range(w):
        fn()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(w):
        fn()
    est = comm.allreduce((time.perf_counter() - t0) / w, op=MPI.MAX)
    batch, samples = plan.choose(est)
    times = np.array([C.time_batch(fn, batch, before=comm.Barrier) for _ in range(samples)])
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)

    ok = _check(op, n, send, recv, fn, rank, world, np)
    ok = comm.allreduce(ok, op=MPI.LAND)
    return list(times), batch, samples, ok


def worker_main(args):
    from mpi4py import MPI
    import numpy as np

    comm = MPI.COMM_WORLD
    plan = C.plan_for(args.quick, args.single_shot)
    rows = []
    for op in C.MPI_OPS:
        for nbytes in C.op_sizes(op, args.quick):
            if op == "roundtrip":
                times, batch, samples, ok = _roundtrip(comm, plan, MPI, np)
            else:
                times, batch, samples, ok = _collective(comm, op, nbytes, plan, MPI, np)
            if comm.rank == 0:
                row = {"op": op, "size": nbytes, "batch": batch, "samples": samples, "ok": ok}
                row.update(C.summarize(times))
                rows.append(row)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"world": comm.size, "rows": rows, "complete": False}, f)
    if comm.rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].strip()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": comm.size, "rows": rows, "complete": True, "library": lib}, f)
        else:
            print(json.dumps({"world": comm.size, "rows": rows, "library": lib}))


# ----------------------------------------------------------------------------- launcher

def ompi_major() -> int | None:
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
    except Exception:
        return None
    m = re.search(r"Open MPI\)?\s*(\d+)\.", out)
    return int(m.group(1)) if m else None


def mpirun_command(world: int, json_path: str, quick: bool, single_copy: str | None = None,
                   pin: bool = False, single_shot: bool = False) -> list[str]:
    major = ompi_major() or 4
    sm = "sm" if major >= 5 else "vader"
    cmd = ["mpirun"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    binding = ["--map-by", "core", "--bind-to", "core:overload-allowed"] if pin else ["--bind-to", "none"]
    cmd += ["--oversubscribe", *binding, "-np", str(world),
            "--mca", "pml", "ob1", "--mca", "btl", f"self,{sm}"]
    if single_copy:
        cmd += ["--mca", f"btl_{sm}_single_copy_mechanism", single_copy]
    cmd += [sys.executable, os.path.abspath(__file__), "--worker", "--json", json_path]
    if quick:
        cmd.append("--quick")
    if single_shot:
        cmd.append("--single-shot")
    return cmd


def run_world(world: int, quick: bool, deadline_s: float, single_copy: str | None = None,
              pin: bool = False, single_shot: bool = False) -> dict:
    """Runs one mpirun for `world` ranks; returns {"world", "rows", "complete", "error"?, "cmd"}."""
    fd, path = tempfile.mkstemp(prefix=f"bench_mpi_{world}_", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = mpirun_command(world, path, quick, single_copy, pin, single_shot)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    error = None
    try:
        out, _ = proc.communicate(timeout=deadline_s)
        if proc.returncode != 0:
            error = f"mpirun exited {proc.returncode}: {out[-2000:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        error = f"deadline of {deadline_s:.0f}s passed; mpirun killed"
    result = {"world": world, "rows": [], "complete": False}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        os.unlink(path)
    if error:
        result["error"] = error
    result["cmd"] = " ".join(cmd)
    return result


def table(result: dict) -> str:
    lines = [f"### Open MPI ({result.get('library', 'Open MPI')}), world size {result['world']}",
             "",
             f"`{result.get('cmd', '')}`",
             "",
             "| op | size | mpi median | mpi p90 | samples×batch | check |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {C.label(r['op'])} | {C.fmt_size(r['size'])} | {C.fmt_time(r['median_us'])} | "
                     f"{C.fmt_time(r['p90_us'])} | {r['samples']}×{r['batch']} | "
                     f"{'ok' if r['ok'] else 'WRONG'} |")
    if result.get("error"):
        lines += ["", f"**error:** {result['error']}"]
    return "\n".join(lines)


def launcher_main(args):
    if shutil.which("mpirun") is None:
        sys.exit("mpirun not found on PATH (apt-get install -y openmpi-bin libopenmpi-dev)")
    results = {}
    t0 = time.time()
    for world in args.ranks:
        res = run_world(world, args.quick, args.timeout, args.mpi_single_copy, args.pin, args.single_shot)
        results[str(world)] = res
        print(table(res), flush=True)
        print(flush=True)
    print(f"total wall time: {time.time() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--single-shot", action="store_true", help="every sample is one op right after a barrier")
    ap.add_argument("--json", help="write results as JSON here")
    ap.add_argument("--timeout", type=float, default=240, help="deadline per world size (s)")
    ap.add_argument("--mpi-single-copy", choices=["cma", "xpmem", "knem", "none"], default=None,
                    help="vader/sm single-copy mechanism (default: Open MPI's)")
    ap.add_argument("--pin", action="store_true",
                    help="bind rank r to core r %% ncores (--map-by core --bind-to core:overload-allowed)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    in_mpirun = "OMPI_COMM_WORLD_SIZE" in os.environ or "PMIX_RANK" in os.environ
    if args.worker or in_mpirun:
        worker_main(args)
    else:
        launcher_main(args)


if __name__ == "__main__":
    main()
