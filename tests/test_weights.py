"""RL weight transfer (torch_cam.weights): trainer ranks publish versions of a model, rollout ranks
take them in place, resharded and cast, checked bit for bit against the same tensors computed in
one process; bad metadata refused on every rank before a byte moves; a dead trainer or rollout
noticed on every rank, with the rollouts' tensors still at the previous version."""
import datetime
import os
import sys
import threading
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import assert_all_ok, cam_segments, run_ranks  # noqa: E402

ALL_OK = "ok"


def _init(rank, world, init_file, timeout_s=60):
    import torch_cam  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def model(version, seed=0):
    """The whole model of a version: {name: tensor}, every rank builds the same."""
    g = torch.Generator().manual_seed(1000 * seed + version)
    return {
        "wq": torch.randn(12, 10, generator=g),                        # TP along dim 0 or 1
        "w2": torch.randn(10, 7, generator=g),                         # uneven chunks of 7 and 10
        "norm": torch.randn(10, generator=g).double(),                 # replicated
        "emb": torch.randn(9, 5, 3, generator=g).to(torch.bfloat16),   # 3-d, FSDP flat shards
        "step": torch.tensor([version, 7 * version], dtype=torch.int64),
    }


def outcome(call, on_error=None):
    """(message, seconds) of ``call()``: "no error" when it returns; when it raises, ``on_error()``
    (the checks of what the rank holds after the failure) runs first."""
    t0 = time.monotonic()
    try:
        call()
        return ("no error", time.monotonic() - t0)
    except Exception as e:
        if on_error is not None:
            on_error()
        return (f"{type(e).__name__}: {e}", time.monotonic() - t0)


def expect_equal(got, want, what):
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)}\n{got}\nwant {want.dtype} "
                             f"{tuple(want.shape)}\n{want}")


def _trainer_register(ch, rank, trainers, m, layout):
    """Trainer ``rank``'s registrations of model m: TP (chunk along dim 0 of wq, dim 1 of w2),
    replicated norm/step, and emb as FSDP flat shards; or everything whole ("whole")."""
    from torch_cam.weights import FlatShard, Shard
    i, n = trainers.index(rank), len(trainers)
    held = {}
    if layout == "whole" or n == 1:
        for k, v in m.items():
            held[k] = ch.register(k, torch.nn.Parameter(v.clone(), requires_grad=False)
                                  if v.is_floating_point() else v.clone())
        return held
    held["wq"] = ch.register("wq", torch.nn.Parameter(m["wq"].chunk(n, 0)[i].clone()), Shard(0, i, n),
                             shape=m["wq"].shape)
    held["w2"] = ch.register("w2", m["w2"].chunk(n, 1)[i].clone(), Shard(1, i, n), shape=m["w2"].shape)
    held["norm"] = ch.register("norm", m["norm"].clone())
    held["step"] = ch.register("step", m["step"].clone())
    flat = m["emb"].reshape(-1)
    bounds = [len(flat) * j // n for j in range(n + 1)]
    held["emb"] = ch.register("emb", flat[bounds[i]:bounds[i + 1]].clone(), FlatShard(bounds[i], bounds[i + 1] - bounds[i]),
                              shape=m["emb"].shape)
    return held


def _set_trainer_values(held, m, rank, trainers, layout):
    """Writes model m into the trainer's registered tensors in place (as an optimizer step does)."""
    i, n = trainers.index(rank), len(trainers)
    with torch.no_grad():
        if layout == "whole" or n == 1:
            for k, v in m.items():
                held[k].copy_(v)
            return
        held["wq"].copy_(m["wq"].chunk(n, 0)[i])
        held["w2"].copy_(m["w2"].chunk(n, 1)[i])
        held["norm"].copy_(m["norm"])
        held["step"].copy_(m["step"])
        flat = m["emb"].reshape(-1)
        bounds = [len(flat) * j // n for j in range(n + 1)]
        held["emb"].copy_(flat[bounds[i]:bounds[i + 1]])


def _rollout_register(ch, rep, rank, dtype, m):
    """A rollout rank of replica ``rep`` (a list of ranks): TP along dim 1 of wq and dim 0 of w2
    (the trainers split the other way), in ``dtype`` for floats; returns {name: (tensor, reference
    of it from model m)}."""
    from torch_cam.weights import Shard
    j, n = rep.index(rank), len(rep)
    out = {}

    def reg(name, full, spec_dim, cast=True):
        ref = full.chunk(n, spec_dim)[j] if spec_dim is not None and n > 1 else full
        t = torch.zeros(ref.shape, dtype=dtype if cast and full.is_floating_point() else full.dtype)
        spec = Shard(spec_dim, j, n) if spec_dim is not None and n > 1 else None
        ch.register(name, t, spec, shape=full.shape)
        out[name] = t

    reg("wq", m["wq"], 1)
    reg("w2", m["w2"], 0)
    reg("norm", m["norm"], None)
    reg("emb", m["emb"], 2)
    reg("step", m["step"], None)
    return out


def _rollout_expect(tensors, rep, rank, m):
    j, n = rep.index(rank), len(rep)
    dims = {"wq": 1, "w2": 0, "norm": None, "emb": 2, "step": None}
    for name, t in tensors.items():
        full = m[name]
        ref = full.chunk(n, dims[name])[j] if dims[name] is not None and n > 1 else full
        expect_equal(t, ref.to(t.dtype), f"rank {rank} {name}")


def layout_run(rank, world, init_file, trainers, replicas, t_layout, dtype, versions, kw):
    _init(rank, world, init_file)
    from torch_cam.weights import WeightChannel
    ch = WeightChannel(trainers=trainers, replicas=replicas, **kw)
    m = model(1)
    if rank in trainers:
        held = _trainer_register(ch, rank, trainers, m, t_layout)
        import torch_cam
        for k, t in held.items():
            assert torch_cam.is_heap_tensor(t), f"{k} was not moved into the heap"
        for v in range(1, versions + 1):
            _set_trainer_values(held, model(v), rank, trainers, t_layout)
            ch.publish(v)
        return ALL_OK
    rep = next(r for r in replicas if rank in r)
    tensors = _rollout_register(ch, rep, rank, dtype, m)
    for v in range(1, versions + 1):
        ch.update(v)
        _rollout_expect(tensors, rep, rank, model(v))
        assert ch.version == v
    return ALL_OK


class Layouts(unittest.TestCase):
    def check(self, trainers, replicas, t_layout="tp", dtype=torch.float32, versions=2, **kw):
        world = len(trainers) + sum(len(r) for r in replicas)
        res = run_ranks(layout_run, world, trainers, replicas, t_layout, dtype, versions, kw, deadline_s=120)
        assert_all_ok(self, res)

    def test_one_to_one(self):
        self.check([0], [[1]], versions=3)

    def test_one_to_one_bf16(self):
        self.check([0], [[1]], dtype=torch.bfloat16)

    def test_tp2_to_two_replicas(self):
        # Trainers TP 2 (and FSDP flat shards of emb); replicas TP 1 in fp16: a whole model each.
        self.check([0, 1], [[2], [3]], dtype=torch.float16)

    def test_tp2_to_tp2_reshard(self):
        # Trainers split wq on dim 0, the rollout replica on dim 1: every rollout rank takes a
        # part from both trainers.
        self.check([0, 1], [[2, 3]])

    def test_tp3_to_tp2(self):
        # Uneven chunks (dim 10 in 4 + 4 + 2, dim 7 in 3 + 3 + 1) and flat shards across rows.
        self.check([0, 1, 2], [[3, 4]], dtype=torch.bfloat16)

    def test_one_to_three_replicas(self):
        self.check([0], [[1], [2], [3]], versions=2)

    def test_whole_trainers_replicated(self):
        # Every trainer holds the whole model: each replica reads it from one of them.
        self.check([0, 1], [[2], [3, 4]], t_layout="whole")

    def test_small_buckets_and_threads(self):
        # Buckets of one page cut every tensor; two copy threads share them.
        self.check([0, 1], [[2, 3]], bucket_bytes=4096, copy_threads=2)


# ---- options: quantization, staging, partial updates, the read lock, the adapter -----------

def options_run(rank, world, init_file):
    _init(rank, world, init_file)
    import torch_cam
    from torch_cam.weights import FlatShard, Shard, WeightChannel, quantize_rows
    ch = WeightChannel(trainers=[0], replicas=[[1, 2]], bucket_bytes=4096)
    g = torch.Generator().manual_seed(5)
    W = [torch.randn(40, 64, generator=g) * (1 + torch.arange(40.0))[:, None] for _ in range(4)]
    W[0][3] = 0  # an all-zero row: scale 1/qmax
    flat = torch.randn(100, generator=g)
    if rank == 0:
        w = torch.nn.Parameter(W[1].clone())
        ch.register("w", w)
        ch.register("w8", W[1].clone() + 1)
        ch.register("fl", flat[:60].reshape(6, 10).clone())  # rollouts take flat halves
        ch.register("pg", flat[40:100].reshape(6, 10).clone())
        base = torch.randn(300, generator=g)
        view = base[100:200]        # a view: refused unless staged
        try:
            ch.register("v", view)
            raise AssertionError("a view was registered without stage=True")
        except ValueError as e:
            assert "stage=True" in str(e) and "it is a view" in str(e), e
        param = torch.nn.Parameter(torch.ones(3))
        try:
            ch.register("p", param.data)   # would leave the parameter on its old storage
            raise AssertionError("a parameter's .data was registered without stage=True")
        except ValueError as e:
            assert "the .data of a parameter" in str(e), e
        ch.register("v", view, stage=True)
        assert not torch_cam.is_heap_tensor(view)
        with torch.no_grad():
            view.copy_(flat)
        ch.publish(1)
        with torch.no_grad():
            w.copy_(W[2])
            view.mul_(2)
        ch.publish(2, names=["w", "v"])       # partial: w8 keeps version 1's values
        # The optimizer's object is the registered one, now heap-resident.
        opt = torch.optim.SGD([w], lr=1.0)
        w.grad = torch.ones_like(w)
        opt.step()
        assert torch_cam.is_heap_tensor(w)
        ch.publish(3, names=["w"])
        metas = ch.gather_metas()
        return sorted((m.name, m.rank, m.quant) for m in metas)
    j = rank - 1
    q = torch.zeros(20, 64, dtype=torch.int8)
    qs2 = torch.zeros(20, 1, dtype=torch.float32)            # (rows, 1) scales are written in place too
    qs = qs2.view(-1)
    f8 = torch.zeros(40, 32, dtype=torch.float8_e4m3fn)
    f8s = torch.zeros(40, dtype=torch.float32)
    v = torch.zeros(100, dtype=torch.bfloat16)
    try:
        ch.register("w", q, Shard(0, j, 2), shape=(40, 64), scale=torch.zeros(5, 4).t())
        raise AssertionError("a scale that no 1-d view covers was accepted")
    except ValueError as e:
        assert "viewable as one dim" in str(e), e
    ch.register("w", q, Shard(0, j, 2), shape=(40, 64), scale=qs2)
    ch.register("w8", f8, Shard(1, j, 2), shape=(40, 64), scale=f8s)
    ch.register("v", v)
    p = torch.nn.Parameter(torch.zeros(60))       # an engine parameter that requires grad
    ch.register("pg", p, FlatShard(0, 60), shape=(6, 10))
    fl = torch.zeros(30, dtype=torch.float8_e5m2)          # a FlatShard target, plain float8 cast
    ch.register("fl", fl, FlatShard(30 * j, 30), shape=(6, 10))

    def check_q(version_w, version_w8):
        rq, rs = quantize_rows(version_w.chunk(2, 0)[j], torch.int8)
        expect_equal(q, rq, "int8 values")
        expect_equal(qs, rs, "int8 scales")
        part = version_w.chunk(2, 0)[j]
        err = (q.float() * qs[:, None] - part).abs().max(dim=1).values
        assert torch.all(err <= qs / 2 + 1e-6), "int8 error beyond half a step"
        r8, r8s = quantize_rows(version_w8.chunk(2, 1)[j], torch.float8_e4m3fn)
        expect_equal(f8.view(torch.uint8), r8.view(torch.uint8), "fp8 values")
        expect_equal(f8s, r8s, "fp8 scales")

    ch.update(1)
    check_q(W[1], W[1] + 1)
    expect_equal(v, flat.bfloat16(), "staged view")
    expect_equal(p.detach(), flat[40:100], "a parameter that requires grad, written in place")
    expect_equal(fl.view(torch.uint8), flat[30 * j:30 * j + 30].to(torch.float8_e5m2).view(torch.uint8),
                 "flat-shard float8 target")
    # An inference thread holding reading() keeps update from writing until it lets go.
    entered, seen = threading.Event(), {}

    def step():
        with ch.reading():
            entered.set()
            time.sleep(0.5)
            seen["v"] = v.clone()
    th = threading.Thread(target=step)
    th.start()
    entered.wait()
    ch.update(2, names=["w", "v"])
    th.join()
    expect_equal(seen["v"], flat.bfloat16(), "what the step saw (version 1, whole)")
    expect_equal(v, (flat * 2).bfloat16(), "staged view after update 2")
    check_q(W[2], W[1] + 1)
    ch.update(3, names=["w"])
    check_q(W[2] - 1, W[1] + 1)
    metas = ch.gather_metas()
    return sorted((m.name, m.rank, m.quant) for m in metas)


def adapter_run(rank, world, init_file):
    _init(rank, world, init_file)
    from torch_cam.weights import ParameterServer, Shard
    ps = ParameterServer(trainers=[0, 1], replicas=[[2]])
    m = model(1)
    loaded = []
    if rank < 2:
        mine = {"wq": m["wq"].chunk(2, 0)[rank].clone(), "norm": m["norm"].clone()}
        ps.register_checkpoint("policy", named_tensors=mine, shards={"wq": Shard(0, rank, 2)},
                               shapes={"wq": m["wq"].shape})
    else:
        mine = {"wq": torch.zeros(12, 10, dtype=torch.bfloat16), "norm": torch.zeros(10, dtype=torch.float64)}
        ps.register_checkpoint("policy", named_tensors=mine)
    metas = ps.gather_metas("policy")
    assert sorted({x.name for x in metas}) == ["norm", "wq"], metas
    assert {x.shape for x in metas if x.name == "wq"} == {(12, 10)}
    for v in (1, 2):
        if rank < 2:
            with torch.no_grad():
                mine["wq"].copy_(model(v)["wq"].chunk(2, 0)[rank])
                mine["norm"].copy_(model(v)["norm"])
        got = ps.update("policy", req_func=loaded.append)
        assert got == v, got
        if rank == 2:
            expect_equal(mine["wq"], model(v)["wq"].bfloat16(), "adapter wq")
            expect_equal(mine["norm"], model(v)["norm"], "adapter norm")
    if rank == 2:
        assert loaded == [["wq", "norm"], ["wq", "norm"]], loaded
    # A checkpoint that one rank lacks is refused on every rank.
    try:
        ps.update("other")
        raise AssertionError("update of an unknown checkpoint passed")
    except ValueError as e:
        assert "'other' is not registered" in str(e), e
    ps.unregister_checkpoint("policy")
    return ALL_OK


class Options(unittest.TestCase):
    def test_quantized_staged_partial_lock(self):
        res = run_ranks(options_run, 3, deadline_s=120)
        assert_all_ok(self, res)
        want = sorted([(n, r, q) for r in range(3) for n, q in
                       (("w", "int8" if r else None), ("w8", "fp8" if r else None), ("v", None), ("fl", None),
                        ("pg", None))])
        for r in range(3):
            self.assertEqual(res[r][1], want)

    def test_parameter_server_adapter(self):
        res = run_ranks(adapter_run, 3, deadline_s=120)
        assert_all_ok(self, res)


# ---- bad metadata: refused on every rank before any byte moves -----------------------------

BAD = {
    # case: (what the trainer (rank 0) does differently, what the rollout (rank 1) does, regex)
    "missing_on_rollout": r"'b' is registered on trainer rank 0 but not on rollout rank 1",
    "missing_on_trainer": r"'c' is registered on no trainer rank",
    "shape_mismatch": r"'a' has whole shape \[4, 6\] on rank 1 and \[4, 5\] on trainer rank 0: it cannot be resharded",
    "uncastable": r"'a' is torch.float32 on the trainers and torch.int32 on rollout rank 1: no cast",
    "complex_to_real": r"'z' is torch.complex64 on the trainers and torch.float32 on rollout rank 1: no cast",
    "shards_do_not_tile": r"the trainers' shards of 'a' \(.*\) cover 12 of its 20 elements",
    "shards_overlap": r"the trainers' shards of 'a' \(.*\) overlap",
    "version_mismatch": r"rank 1 passed version 2, this rank 1|rank 0 passed version 1, this rank 2",
    "version_not_increasing": r"versions must increase; the channel committed to version 1",
    "wrong_role": r"rank 1 \(rollout\) refused: RuntimeError: publish called on a rollout rank",
    "names_differ": r"asked for names",
    "unknown_name": r"rank 0 \(trainer\) refused: KeyError: .*names not registered on this rank: \['nope'\]",
}


def bad_case(rank, case, g2, g3):
    from torch_cam.weights import FlatShard, WeightChannel
    tiling = case in ("shards_do_not_tile", "shards_overlap")
    if rank == 2 and not tiling:
        return None
    ch = WeightChannel(g3 if tiling else g2, trainers=[0, 2] if tiling else [0], replicas=[[1]])
    a = torch.arange(20.0).view(4, 5)
    if rank in (0, 2):
        if tiling:
            lo, hi = ((0, 8), (8, 12)) if case == "shards_do_not_tile" else ((0, 12), (8, 20))
            lo, hi = lo if rank == 0 else hi
            ch.register("a", a.reshape(-1)[lo:hi].clone(), FlatShard(lo, hi - lo), shape=(4, 5))
        else:
            ch.register("a", a.clone())
            ch.register("z", torch.ones(3, dtype=torch.complex64))
        if case == "missing_on_rollout":
            ch.register("b", torch.ones(2))
    else:
        dst = torch.zeros(4, 6) if case == "shape_mismatch" else torch.zeros(4, 5, dtype=torch.int32) \
            if case == "uncastable" else torch.zeros(4, 5)
        ch.register("a", dst)
        if not tiling:
            ch.register("z", torch.zeros(3, dtype=torch.float32 if case == "complex_to_real" else torch.complex64))
        if case == "missing_on_trainer":
            ch.register("c", torch.zeros(2))
    trainer = rank in (0, 2)
    call = ch.publish if trainer else ch.update
    version, names = 1, None
    if case == "version_not_increasing":  # a good first version, then the same version again
        call(1)
    before = {k: e.tensor.clone() for k, e in ch._entries.items()}
    if case == "version_mismatch":
        version = 1 if trainer else 2
    if case == "wrong_role" and not trainer:
        call = ch.publish
    if case == "names_differ":
        names = ["a"] if trainer else ["a", "z"]
    if case == "unknown_name":
        names = ["nope"] if trainer else ["a"]
    def unchanged():
        for k, e in ch._entries.items():
            expect_equal(e.tensor, before[k], f"{k} after the refusal")
    return outcome(lambda: call(version, names=names), unchanged)


def bad_run(rank, world, init_file):
    _init(rank, world, init_file)
    g2, g3 = dist.new_group([0, 1]), dist.group.WORLD
    return {case: bad_case(rank, case, g2, g3) for case in BAD}


class BadMetadata(unittest.TestCase):
    def test_refused_on_every_rank(self):
        res = run_ranks(bad_run, 3, deadline_s=120)
        for r in range(3):
            self.assertEqual(res[r][0], "ok", res[r][1])
        for case, regex in BAD.items():
            with self.subTest(case=case):
                for r in range(3):
                    if res[r][1][case] is None:
                        continue
                    msg, elapsed = res[r][1][case]
                    self.assertRegex(msg, regex, f"rank {r}")
                    self.assertIn(f"on rank {r}", msg)
                    self.assertLess(elapsed, 10, "a refusal must not wait for a timeout")


# ---- a peer that dies mid-update -----------------------------------------------------------

def death_run(rank, world, init_file, who):
    _init(rank, world, init_file, timeout_s=60)
    from torch_cam.weights import WeightChannel
    ch = WeightChannel(trainers=[0], replicas=[[1], [2]])
    m1, m2 = model(1), model(2)
    if rank == 0:
        held = {k: ch.register(k, v.clone()) for k, v in m1.items()}
        ch.publish(1)
        _set_trainer_values(held, m2, 0, [0], "whole")
        if who == "trainer":
            time.sleep(0.5)   # the rollouts are waiting in update(2)
            os._exit(1)
        return outcome(lambda: ch.publish(2))
    mine = {k: ch.register(k, torch.zeros_like(v)) for k, v in m1.items()}
    ch.update(1)
    if who == "rollout" and rank == 2:
        time.sleep(0.5)
        os._exit(1)

    def still_version_1():
        for k, t in mine.items():
            expect_equal(t, m1[k], f"rank {rank} {k} after the failed update")
        assert ch.version == 1
    return outcome(lambda: ch.update(2), still_version_1)


def reader_run(rank, world, init_file):
    """An inference thread holds reading() too long: update gives up at half the group's timeout
    with the previous version intact, and the trainer's publish raises naming that rollout. The
    channel stays usable: the same version again is refused on every rank (it was committed), the
    next one lands."""
    _init(rank, world, init_file, timeout_s=3)
    from torch_cam.weights import WeightChannel
    ch = WeightChannel(trainers=[0], replicas=[[1]])
    t = ch.register("w", torch.ones(4) if rank == 0 else torch.zeros(4))
    call = ch.publish if rank == 0 else ch.update
    release = threading.Event()
    if rank == 1:
        held = threading.Event()

        def step():
            with ch.reading():
                held.set()
                release.wait(20)
        threading.Thread(target=step, daemon=True).start()
        held.wait()

    def abandoned():
        release.set()
        if rank == 1:
            expect_equal(t, torch.zeros(4), "after the abandoned update")
            assert ch.version is None
    first = outcome(lambda: call(1), abandoned)
    again = outcome(lambda: call(1))
    call(2)
    if rank == 1:
        expect_equal(t, torch.ones(4), "after the next version")
        assert ch.version == 2
    return first, again


def after_commit_run(rank, world, init_file):
    """The trainer dies right after the commit point, while the rollouts copy from its pages:
    they finish with version 2 whole (the pages outlive it) and then raise, saying so."""
    _init(rank, world, init_file, timeout_s=60)
    from torch_cam.weights import WeightChannel
    ch = WeightChannel(trainers=[0], replicas=[[1], [2]])
    big = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(16)}   # 16 MiB
    if rank == 0:
        held = {k: ch.register(k, v.clone()) for k, v in big.items()}
        ch.publish(1)
        with torch.no_grad():
            for t in held.values():
                t.add_(1)
        plan = ch._check_and_plan

        def die_after_commit(*a):
            out = plan(*a)
            os._exit(1)
            return out
        ch._check_and_plan = die_after_commit
        return outcome(lambda: ch.publish(2))
    mine = {k: ch.register(k, torch.zeros_like(v)) for k, v in big.items()}
    ch.update(1)

    def version_2_whole():
        for k, t in mine.items():
            expect_equal(t, big[k] + 1, f"rank {rank} {k} after the trainer died past the commit point")
        assert ch.version == 2
    return outcome(lambda: ch.update(2), version_2_whole)


def copy_fails_run(rank, world, init_file):
    """A rollout's copy fails part way (injected): it raises saying its tensors may be mixed, and
    the trainer and the other replica raise naming it, instead of waiting for a timeout."""
    _init(rank, world, init_file, timeout_s=60)
    import torch_cam.weights as W
    ch = W.WeightChannel(trainers=[0], replicas=[[1], [2]])
    ch.register("w", torch.ones(8) if rank == 0 else torch.zeros(8))
    if rank == 1:
        def broken(part):
            raise MemoryError("injected")
        W._run = broken
    return outcome(lambda: (ch.publish if rank == 0 else ch.update)(1))


class Death(unittest.TestCase):
    def failures(self, fn, world, *args, dead=None, limit_s=20):
        """{rank: message} of the surviving ranks, each of which must have raised within
        ``limit_s``; nothing of the group may be left in /dev/shm."""
        before = set(cam_segments())
        res = run_ranks(fn, world, *args, deadline_s=90, allow_died=() if dead is None else (dead,))
        self.assertEqual(set(cam_segments()) - before, set(), "segments left in /dev/shm")
        out = {}
        for r in range(world):
            if r == dead:
                continue
            self.assertEqual(res[r][0], "ok", res[r][1])
            msg, elapsed = res[r][1]
            self.assertLess(elapsed, limit_s, f"rank {r} took {elapsed:.1f} s to raise: {msg}")
            out[r] = msg
        return out

    def test_copy_fails_on_one_rollout(self):
        for r, msg in self.failures(copy_fails_run, 3, limit_s=10).items():
            self.assertRegex(msg, r"MemoryError: injected \(the copy stopped part way")
            if r != 1:
                self.assertRegex(msg, r"rollout rank\(s\) \[1\] did not apply it")

    def test_trainer_dies_after_commit(self):
        for r, msg in self.failures(after_commit_run, 3, dead=0).items():
            self.assertRegex(msg, r"after the commit point \(this rank's tensors hold version 2 complete\)")
            self.assertRegex(msg, r"peer rank 0 died|peer rank \d failed")

    def test_reader_past_the_timeout(self):
        res = run_ranks(reader_run, 2, deadline_s=60)
        assert_all_ok(self, res)
        for r in range(2):
            (msg, elapsed), (again, again_s) = res[r][1]
            self.assertRegex(msg, r"held reading\(\) for longer than [\d.]+ s \(half the group's timeout\)")
            if r == 0:
                self.assertRegex(msg, r"rollout rank\(s\) \[1\] did not apply it")
            self.assertLess(elapsed, 15)
            self.assertRegex(again, r"versions must increase; the channel committed to version 1", f"rank {r}")
            self.assertLess(again_s, 10)

    def test_trainer_dies_before_publish(self):
        for r, msg in self.failures(death_run, 3, "trainer", dead=0).items():
            self.assertRegex(msg, r"peer rank 0 died|peer rank \d failed", f"rank {r}")

    def test_rollout_dies_before_update(self):
        for r, msg in self.failures(death_run, 3, "rollout", dead=2).items():
            self.assertRegex(msg, r"peer rank 2 died|peer rank \d failed", f"rank {r}")


if __name__ == "__main__":
    unittest.main()
