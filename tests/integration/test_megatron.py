"""Megatron-core on cam: model-parallel groups and one step of the MoE all-to-all token
dispatcher, run on real processes, compared byte for byte with the same run on gloo.

What runs, on 4 ranks (tensor-parallel 2 x expert-parallel 2, the default order
"tp-cp-ep-dp-pp"), once with expert-tensor-parallel size 2 (Megatron's default, = TP) and once
with 1, in the same processes and process group (``ETP_SIZES``; each is its own test case):

* ``parallel_state.initialize_model_parallel`` builds every Megatron subgroup on the default
  backend (``create_gloo_process_groups=False``, so no side gloo groups); the test checks with
  ``dist.get_backend`` that the TP, EP, expert-TP and TP x EP groups really are on the backend
  under test. With ETP 2 the EP groups are [0, 2] and [1, 3], expert-TP [0, 1] and [2, 3],
  TP x EP all four ranks; with ETP 1 the EP and TP x EP groups are [0, 1] and [2, 3].
* ``MoEAlltoAllTokenDispatcher`` (``moe_token_dispatcher_type="alltoall"``, 4 experts, top-2,
  hidden size 8, 6 tokens per rank) goes through its whole forward path, exactly as
  ``MoELayer`` drives it: ``dispatch_preprocess`` (all-gather of the per-expert token counts
  over TP x EP, permutation), ``token_dispatch`` (two uneven all-to-all-v over EP, rank 3's
  with an empty split), ``dispatch_postprocess`` (uneven all-gather over expert-TP, sort by
  local expert), a stand-in expert computation, ``combine_preprocess`` (uneven reduce-scatter
  over expert-TP), ``token_combine`` (all-to-all-v back over EP) and ``combine_postprocess``
  (unpermute). Every value is a small dyadic rational, so sums are exact whatever order a
  backend reduces in: each rank also checks its combined output against a local reference.

The torch.distributed calls Megatron makes on this path (recorded by wrapping the functions,
and compared between the two backends) are, per rank and in this order:

* ``new_group`` x 39 (ETP 2) / x 41 (ETP 1) in ``initialize_model_parallel`` (every rank calls
  it for every group, member or not; no collective runs there with these settings, not even a
  barrier);
* ``all_gather_into_tensor`` x 1 over TP x EP (int64 per-expert token counts; through the
  alias ``mappings.dist_all_gather_func``, i.e. the backend's ``_allgather_base``);
* ``all_to_all_single`` x 2 over EP (tokens, then probs; uneven splits passed as numpy arrays,
  some of them 0);
* ETP 2 only: ``all_gather`` x 2 over expert-TP (list form, pieces of unequal sizes: tokens,
  probs), and after the experts ``reduce_scatter`` x 1 over expert-TP (list form, unequal
  sizes, SUM, float32);
* ``all_to_all_single`` x 1 over EP (the combine, splits reversed).

So besides all_to_all_single, cam needs _allgather_base (both cases) and, for ETP 2, allgather
with unequal output sizes and reduce_scatter with unequal input sizes. No all_reduce,
broadcast or barrier is called on this path.

gloo's allgather rejects unequal output sizes (NCCL takes them), so the gloo reference run
replaces an uneven list ``all_gather`` with pad, equal all_gather, slice (gloo only; see
``_gloo_uneven_all_gather``). gloo's reduce_scatter takes unequal sizes as is.

CPU workarounds (Megatron-core 0.16.1 assumes CUDA in three places on this path; each is
patched only inside the rank processes, only for the duration of the step):

1. ``megatron.core.tensor_parallel.mappings`` allocates the all-to-all-v and all-gather output
   buffers with ``device=torch.cuda.current_device()``, which raises on a CPU-only torch.
   ``torch.cuda.current_device`` is patched to return ``torch.device("cpu")``.
2. ``MoEAlltoAllTokenDispatcher.__init__`` creates a class-wide ``torch.cuda.Stream()`` for
   device-to-host copies unless ``cuda_dtoh_stream`` is already set; it is set to a placeholder.
3. ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` copies the split sizes to the
   host on that side stream and synchronises on a CUDA event. On CPU there is nothing to copy,
   but the CUDA path also turns ``input_splits``/``output_splits``/``output_splits_tp`` into
   numpy arrays (``maybe_move_tensor_to_cpu(..., as_numpy=True)``, only for CUDA tensors), and
   the later collectives receive those. The replacement does that conversion at the same
   point (``cuda_dtoh_point``) and nothing else.

Needs megatron-core 0.16.1 (its only required dependencies are torch, numpy, packaging):
``pip install -c <file holding "torch==2.13.0"> megatron-core==0.16.1``.
Set CAM_MEGATRON_TEST_BACKEND=gloo to run the whole test gloo against gloo (a check of the
test itself, independent of cam). Skipped only when megatron.core cannot be imported.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cam_testing import run_ranks, same_bytes  # noqa: E402

BACKEND = os.environ.get("CAM_MEGATRON_TEST_BACKEND", "cam")
REFERENCE = "gloo"

WORLD = 4
TP = 2
EP = 2
NUM_EXPERTS = 4
TOPK = 2
HIDDEN = 8
SEQ, MICRO_BATCH = 3, 2  # 6 tokens per rank: hidden states are [S, B, H]
ETP_SIZES = (2, 1)  # expert-tensor-parallel sizes, both run in the same processes
DEADLINE_S = 75.0

# torch.distributed entry points worth recording (collectives, p2p, group creation).
_RECORDED = [
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "broadcast", "barrier", "monitored_barrier", "reduce", "gather", "scatter", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
    "all_gather_single", "reduce_scatter_single",  # newer names (torch 2.13 deprecates the old)
    "new_group",
]


# ---------------------------------------------------------------------------- in the ranks
@contextlib.contextmanager
def _recording_dist_calls(log: list):
    """Wraps the public torch.distributed functions (and the aliases Megatron's mappings module
    took at import time) so every call appends (name, backend of its group, group ranks)."""
    from megatron.core.tensor_parallel import mappings

    def wrap(name, orig):
        sig = inspect.signature(orig)

        def wrapper(*args, **kwargs):
            group = None
            if name != "new_group":
                try:
                    group = sig.bind(*args, **kwargs).arguments.get("group")
                except TypeError:
                    pass
            out = orig(*args, **kwargs)
            if name == "new_group":  # non-members get a placeholder, not a group
                ranks = kwargs.get("ranks", args[0] if args else None)
                ranks = tuple(range(dist.get_world_size()) if ranks is None else ranks)
                member = dist.get_rank() in ranks
                log.append((name, dist.get_backend(out) if member else None, ranks))
            else:
                g = group if group is not None else dist.group.WORLD
                log.append((name, dist.get_backend(g), tuple(dist.get_process_group_ranks(g))))
            return out

        return wrapper

    with contextlib.ExitStack() as stack:
        for name in _RECORDED:
            orig = getattr(dist, name, None)
            if orig is not None:
                stack.enter_context(mock.patch.object(dist, name, wrap(name, orig)))
        for alias in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            orig = getattr(mappings, alias)
            stack.enter_context(mock.patch.object(mappings, alias, wrap(orig.__name__, orig)))
        yield


def _cpu_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    """CPU stand-in for MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: no stream, no
    event; the split sizes become numpy arrays at the same point as on the CUDA path."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for attr in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, attr)
            if torch.is_tensor(value):
                setattr(self, attr, value.numpy())
    return tokens_per_expert


@contextlib.contextmanager
def _gloo_uneven_all_gather():
    """ProcessGroupGloo::allgather rejects output tensors of unequal sizes, which Megatron's
    dropless dispatcher passes whenever expert-TP ranks receive different token counts (NCCL
    accepts them). For the gloo reference only, an
    uneven list all_gather becomes: pad to the largest piece, equal all_gather, slice."""
    orig = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if len({t.shape for t in tensor_list}) <= 1 or dist.get_backend(group) != "gloo":
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        assert not async_op
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        orig(gathered, padded, group=group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[: out.shape[0]])

    with mock.patch.object(dist, "all_gather", all_gather):
        yield


@contextlib.contextmanager
def _megatron_on_cpu():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device",
                                              lambda: torch.device("cpu")))
        stack.enter_context(mock.patch.object(D, "cuda_dtoh_stream", object()))
        stack.enter_context(mock.patch.object(D, "_maybe_dtoh_and_synchronize",
                                              _cpu_dtoh_and_synchronize))
        yield


def _inputs(rank: int):
    """Hidden states [S, B, H], routing map [T, E] (bool, exactly TOPK per token) and probs
    [T, E] for this rank; only dyadic values so every sum below is exact. Rank 3 routes
    everything to experts 0 and 1 (EP rank 0), so its split towards EP rank 1 is empty."""
    n = SEQ * MICRO_BATCH
    first = rank * n
    hidden = (torch.arange(first * HIDDEN, (first + n) * HIDDEN, dtype=torch.float32)
              .reshape(SEQ, MICRO_BATCH, HIDDEN) / 8 - 3)
    g = torch.Generator().manual_seed(4242 + rank)
    routing_map = torch.zeros(n, NUM_EXPERTS, dtype=torch.bool)
    probs = torch.zeros(n, NUM_EXPERTS, dtype=torch.float32)
    for t in range(n):
        experts = [0, 1] if rank == 3 else torch.randperm(NUM_EXPERTS, generator=g)[:TOPK].tolist()
        routing_map[t, experts] = True
        probs[t, experts[0]], probs[t, experts[1]] = 0.75, 0.25
    return hidden, routing_map, probs


def _expert(e: int, x: torch.Tensor) -> torch.Tensor:
    """The full output of stand-in expert e; each expert-TP rank computes an exact 1/etp of it."""
    return (e + 1) * x + e


def _one_step(rank, backend, etp):
    """initialize_model_parallel with expert-tensor-parallel size etp, one dispatch/combine."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    calls: list = []
    shim = _gloo_uneven_all_gather() if backend == "gloo" else contextlib.nullcontext()
    try:
        with shim, _recording_dist_calls(calls), _megatron_on_cpu():
            ps.initialize_model_parallel(tensor_model_parallel_size=TP,
                                         expert_model_parallel_size=EP,
                                         expert_tensor_parallel_size=etp,
                                         create_gloo_process_groups=False)
            pgs = get_default_pg_collection()
            groups = {name: getattr(pgs, name) for name in ("tp", "ep", "expt_tp", "tp_ep")}
            group_info = {name: (dist.get_backend(g), tuple(dist.get_process_group_ranks(g)))
                          for name, g in groups.items()}
            for name, (b, _) in group_info.items():
                assert b == backend, f"{name} group is on {b!r}, not {backend!r}"
            assert ps.get_expert_model_parallel_world_size() == EP
            assert ps.get_expert_tensor_parallel_world_size() == etp

            config = TransformerConfig(
                num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                tensor_model_parallel_size=TP, expert_model_parallel_size=EP,
                expert_tensor_parallel_size=etp, sequence_parallel=True,
                add_bias_linear=False, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK,
                moe_token_dispatcher_type="alltoall")
            ep_rank = ps.get_expert_model_parallel_rank()
            num_local = NUM_EXPERTS // EP
            local_experts = [ep_rank * num_local + i for i in range(num_local)]
            dispatcher = MoEAlltoAllTokenDispatcher(num_local, local_experts, config,
                                                    pg_collection=pgs)

            hidden, routing_map, probs = _inputs(rank)
            x, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
            x, p = dispatcher.token_dispatch(x, p)
            tokens, tokens_per_expert, token_probs = dispatcher.dispatch_postprocess(x, p)

            # Stand-in experts; with expert-TP each rank contributes an exact 1/etp share,
            # which the reduce-scatter in combine_preprocess adds back up.
            counts = [int(c) for c in tokens_per_expert]
            pieces = torch.split(tokens, counts)
            prob_pieces = torch.split(token_probs, counts)
            expert_out = torch.cat([_expert(e, piece) * pp.unsqueeze(-1) / etp
                                    for e, piece, pp in zip(local_experts, pieces, prob_pieces)])

            y = dispatcher.combine_preprocess(expert_out)
            y = dispatcher.token_combine(y)
            combined = dispatcher.combine_postprocess(y)
    finally:
        ps.destroy_model_parallel()

    expected = torch.zeros_like(hidden).reshape(-1, HIDDEN)
    flat = hidden.reshape(-1, HIDDEN)
    for t in range(flat.shape[0]):
        for e in routing_map[t].nonzero().flatten().tolist():
            expected[t] += probs[t, e] * _expert(e, flat[t])
    assert combined.shape == hidden.shape, (combined.shape, hidden.shape)
    assert torch.equal(combined.reshape(-1, HIDDEN), expected), (combined, expected)

    # numpy, not tensors: a tensor put on the result queue travels as a shared-memory handle
    # that dies with this process.
    return {
        "groups": group_info,
        "local_experts": local_experts,
        "dispatched_tokens": tokens.numpy().copy(),
        "dispatched_probs": token_probs.numpy().copy(),
        "tokens_per_expert": torch.as_tensor(tokens_per_expert).numpy().copy(),
        "combined": combined.numpy().copy(),
        "calls": calls,
    }


def _moe_alltoall_steps(rank, world_size, init_file, backend):
    """One process group, then one step per expert-TP size; a failing configuration is
    reported as ("error", text) without hiding the others."""
    warnings.filterwarnings("ignore")  # Megatron warns about missing Apex/TE on import
    import torch_cam  # noqa: F401  registers "cam"

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    out = {}
    try:
        for etp in ETP_SIZES:
            try:
                out[etp] = ("ok", _one_step(rank, backend, etp))
            except Exception as e:  # noqa: BLE001  reported to the parent
                out[etp] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------- the tests
_runs: dict = {}


def _run(role):
    """{etp: {rank: ("ok", result) | ("error", text)}} for role "reference" (gloo) or "tested"
    (BACKEND), computed once per role: with BACKEND=gloo these are two independent runs."""
    backend = REFERENCE if role == "reference" else BACKEND
    if role not in _runs:
        results = run_ranks(_moe_alltoall_steps, WORLD, backend, deadline_s=DEADLINE_S)
        errors = {r: v for r, (s, v) in results.items() if s != "ok"}
        assert not errors, f"on {backend}:\n" + "\n".join(f"rank {r}: {v}"
                                                           for r, v in errors.items())
        _runs[role] = {etp: {r: v[etp] for r, (_, v) in results.items()}
                          for etp in ETP_SIZES}
    return _runs[role]


def _ok(per_rank, what):
    errors = {r: v for r, (s, v) in per_rank.items() if s != "ok"}
    assert not errors, f"{what}:\n" + "\n".join(f"rank {r}: {v}" for r, v in errors.items())
    return {r: v for r, (_, v) in per_rank.items()}


@pytest.fixture(scope="module")
def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # missing Apex / Transformer Engine
        return pytest.importorskip("megatron.core")


# Expected (backend-free) groups of rank 0 for each expert-TP size.
RANK0_GROUPS = {
    2: {"tp": (0, 1), "ep": (0, 2), "expt_tp": (0, 1), "tp_ep": (0, 1, 2, 3)},
    1: {"tp": (0, 1), "ep": (0, 1), "expt_tp": (0,), "tp_ep": (0, 1)},
}


@pytest.mark.parametrize("etp", ETP_SIZES)
def test_reference_run_is_sane(megatron, etp):
    """The gloo run on its own: the expected groups, and tokens really crossed ranks."""
    ref = _ok(_run("reference")[etp], f"gloo, expert-TP {etp}")
    assert {k: v[1] for k, v in ref[0]["groups"].items()} == RANK0_GROUPS[etp]
    # Every token goes to TOPK experts and lands on etp ranks (gathered over expert-TP).
    total = sum(int(ref[r]["tokens_per_expert"].sum()) for r in range(WORLD))
    assert total == etp * WORLD * SEQ * MICRO_BATCH * TOPK
    ops = {name for name, _, _ in ref[0]["calls"]}
    assert {"all_to_all_single", "all_gather_into_tensor"} <= ops, ops
    if etp > 1:
        assert {"all_gather", "reduce_scatter"} <= ops, ops


@pytest.mark.parametrize("etp", ETP_SIZES)
def test_moe_alltoall_dispatch_matches_gloo(megatron, etp):
    """Same groups, same calls, byte-identical dispatched tokens, counts and combined output."""
    want_all = _ok(_run("reference")[etp], f"gloo, expert-TP {etp}")
    got_all = _ok(_run("tested")[etp], f"{BACKEND}, expert-TP {etp}")
    for r in range(WORLD):
        want, have = want_all[r], got_all[r]
        assert {k: v[1] for k, v in have["groups"].items()} == \
            {k: v[1] for k, v in want["groups"].items()}, r
        assert all(b == BACKEND for b, _ in have["groups"].values()), have["groups"]
        assert have["local_experts"] == want["local_experts"], r
        strip = lambda calls: [(name, ranks) for name, _, ranks in calls]  # noqa: E731
        assert strip(have["calls"]) == strip(want["calls"]), (r, have["calls"])
        assert {b for _, b, _ in have["calls"]} <= {BACKEND, None}, have["calls"]
        for key in ("dispatched_tokens", "dispatched_probs", "tokens_per_expert", "combined"):
            a, b = torch.from_numpy(have[key]), torch.from_numpy(want[key])
            assert same_bytes(a, b), (r, key, a, b)
