"""DeepSpeed on top of cam: ZeRO stage 1 and stage 2 training on CPU must give the same losses
and final parameters with dist_backend="cam" as with dist_backend="gloo".

Each run is N=2 real processes (cam_testing.run_ranks). Every rank builds the same tiny model
from the same seed, trains a few steps on its own deterministic data, and returns its losses and
final parameters; the cam run is then compared with a gloo run.

Environment:
  TORCH_CAM_DS_BACKEND  backend compared against gloo (default "cam"); setting it to "gloo"
                        checks the test itself (gloo vs gloo).

Run ``python tests/integration/test_deepspeed.py [backend]`` to print the torch.distributed
calls DeepSpeed makes (public API functions and ProcessGroup methods) for each stage.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from cam_testing import run_ranks  # noqa: E402


def _import_deepspeed():
    """Imports deepspeed with the CPU accelerator (its auto-detection warns and may probe GPUs)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed  # noqa: F401
    return deepspeed


try:
    _saved_accel = os.environ.get("DS_ACCELERATOR")
    _import_deepspeed()
    DEEPSPEED_MISSING = None
except ImportError as e:  # only a missing/unimportable deepspeed skips
    DEEPSPEED_MISSING = f"deepspeed is not importable: {type(e).__name__}: {e}"
finally:
    if _saved_accel is None:
        os.environ.pop("DS_ACCELERATOR", None)
    else:
        os.environ["DS_ACCELERATOR"] = _saved_accel

BACKEND_UNDER_TEST = os.environ.get("TORCH_CAM_DS_BACKEND", "cam")
WORLD_SIZE = 2
STEPS = 5
MICRO_BATCH = 4
IN, HIDDEN, OUT = 12, 9, 3  # 147 parameters: odd, so ZeRO pads its partitions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- recording which torch.distributed calls DeepSpeed makes (diagnostics only) --------------

_API_FUNCS = [
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "reduce", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single", "new_group",
    "new_subgroups", "split_group",
]
_PG_METHODS = [
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "all_gather_single", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single", "reduce", "broadcast", "barrier",
    "monitored_barrier", "gather", "scatter", "send", "recv", "recv_anysource", "alltoall",
    "alltoall_base", "all_to_all_single", "_start_coalescing", "_end_coalescing", "split_group",
]


def _install_recorder(log: list):
    """Wraps torch.distributed's public functions (outermost call only) and the ProcessGroup
    methods (every call: that is what reaches the backend). Entries: ("api"|"pg", name, detail)."""
    import functools
    import threading

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    depth = threading.local()

    def describe(args, kwargs):
        parts = []
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                parts.append(f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}")
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                parts.append("[" + ",".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                                            for t in a) + "]")
            elif hasattr(a, "reduceOp"):
                parts.append(str(a.reduceOp.op).split(".")[-1])
            elif isinstance(a, dist.ReduceOp.RedOpType):
                parts.append(str(a).split(".")[-1])
        return " ".join(parts)

    def wrap_api(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            d = getattr(depth, "n", 0)
            if d == 0:
                op = kwargs.get("op")
                log.append(("api", name, (str(op).split(".")[-1] if op is not None else "")))
            depth.n = d + 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth.n = d
        return wrapper

    for name in _API_FUNCS:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        w = wrap_api(name, fn)
        setattr(c10d, name, w)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, w)

    def wrap_pg(name, meth):
        def wrapper(self, *args, **kwargs):
            log.append(("pg", name, describe(args, kwargs)))
            return meth(self, *args, **kwargs)
        return wrapper

    for name in _PG_METHODS:
        meth = getattr(dist.ProcessGroup, name, None)
        if meth is not None:
            setattr(dist.ProcessGroup, name, wrap_pg(name, meth))


# --- one rank of a DeepSpeed training run ---------------------------------------------------


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        # torch_adam: plain torch.optim.Adam, no JIT-built FusedAdam/CPUAdam
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": stage,
            # small buckets so that a step takes several collectives
            "reduce_bucket_size": 64,
            "allgather_bucket_size": 64,
            "overlap_comm": False,
            "contiguous_gradients": True,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _train(rank, world_size, init_file, backend, stage, port, record):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    os.environ.pop("LOCAL_SIZE", None)  # keeps DeepSpeed's shm all-reduce off
    torch.set_num_threads(1)
    import logging

    if backend not in ("gloo", "mpi"):
        import torch_cam  # noqa: F401  (registers "cam"; the gloo reference runs without it)
    deepspeed = _import_deepspeed()
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    # TorchBackend JIT-builds DeepSpeed's CPU shm all-reduce op (~30 s, cached afterwards) that
    # only inference_all_reduce uses, and only when LOCAL_SIZE == world size; training never
    # does, so skip the build.
    # (Not `import deepspeed.comm.torch as m`: deepspeed.comm's attribute `torch` is torch itself.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    log: list = []
    if record:
        _install_recorder(log)

    deepspeed.init_distributed(dist_backend=backend, init_method=f"file://{init_file}", rank=rank,
                               world_size=world_size, timeout=datetime.timedelta(seconds=60),
                               auto_mpi_discovery=False, verbose=False)
    import torch.distributed as dist
    assert dist.get_backend() == backend, dist.get_backend()
    marks = {"after_init_distributed": len(log)}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_config(stage))
    marks["after_initialize"] = len(log)

    g = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(MICRO_BATCH, IN, generator=g)
        y = torch.randn(MICRO_BATCH, OUT, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    marks["after_steps"] = len(log)

    params = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    dist.barrier()
    dist.destroy_process_group()
    # plain lists: tensors sent through the result queue would be shared by file descriptor,
    # which breaks once this process has exited (float32 -> Python float is exact)
    return {"losses": torch.stack(losses).tolist(), "params": params.tolist(), "ops": log, "marks": marks}


def _run(backend: str, stage: int, record: bool = False) -> dict:
    results = run_ranks(_train, WORLD_SIZE, backend, stage, _free_port(), record, deadline_s=100)
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not errors, f"backend {backend!r}, ZeRO stage {stage}:\n" + "\n".join(
        f"rank {r}: {v}" for r, v in sorted(errors.items()))
    out = {r: v for r, (_, v) in results.items()}
    for v in out.values():
        v["losses"] = torch.tensor(v["losses"], dtype=torch.float32)
        v["params"] = torch.tensor(v["params"], dtype=torch.float32)
    return out


def _compare(stage: int):
    if DEEPSPEED_MISSING:
        pytest.skip(DEEPSPEED_MISSING)
    reference = _run("gloo", stage)
    tested = _run(BACKEND_UNDER_TEST, stage)
    for rank in range(WORLD_SIZE):
        ref, got = reference[rank], tested[rank]
        assert torch.isfinite(ref["losses"]).all(), ref["losses"]
        # exact: two fp32 addends sum the same in either order, and everything else is local
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=0,
                                   msg=lambda m: f"rank {rank} losses, {BACKEND_UNDER_TEST} vs gloo: {m}")
        torch.testing.assert_close(got["params"], ref["params"], rtol=0, atol=0,
                                   msg=lambda m: f"rank {rank} parameters, {BACKEND_UNDER_TEST} vs gloo: {m}")
    # ZeRO keeps the model replicated: every rank must end with the same parameters
    torch.testing.assert_close(tested[1]["params"], tested[0]["params"], rtol=0, atol=0)
    # and training must have moved them (the run did something)
    assert not torch.equal(reference[0]["losses"][0], reference[0]["losses"][-1])


def test_zero_stage1_matches_gloo():
    _compare(1)


def test_zero_stage2_matches_gloo():
    _compare(2)


if __name__ == "__main__":  # print the torch.distributed calls DeepSpeed makes
    from collections import Counter

    backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"
    for stage in (1, 2):
        out = _run(backend, stage, record=True)
        ops, marks = out[0]["ops"], out[0]["marks"]
        bounds = [("init_distributed", 0, marks["after_init_distributed"]),
                  ("deepspeed.initialize", marks["after_init_distributed"], marks["after_initialize"]),
                  (f"{STEPS} train steps", marks["after_initialize"], marks["after_steps"]),
                  ("teardown (test's own barrier)", marks["after_steps"], len(ops))]
        print(f"=== ZeRO stage {stage}, backend {backend}, rank 0 losses {out[0]['losses'].tolist()}")
        for phase, lo, hi in bounds:
            print(f"--- {phase}")
            for (kind, name, detail), n in sorted(Counter(ops[lo:hi]).items()):
                print(f"  {kind:3} {name:32} {detail:40} x{n}")
