"""Groups that span hosts, with hosts simulated on this machine by TORCH_CAM_HOST_ID (one key
per simulated host): cam inside each host; between hosts UCX (UcxHierarchicalTest, where the
build has it) and the gloo fallback (GlooHierarchicalTest). tests/multihost/ runs the same
checks across hosts made of namespaces (needs root)."""
import datetime
import os
import time
import unittest

import torch
import torch.distributed as dist

from afd_across_hosts_checks import check_afd, check_afd_dead_ffn
from cam_testing import assert_all_ok, cam_segments, run_ranks
from hierarchical_checks import check_all
from kv_across_hosts_checks import check_kv, check_kv_dead_peer
from moe_across_hosts_checks import check_moe, check_moe_dead_peer
from weights_across_hosts_checks import check_weights, check_weights_dead_trainer

DEADLINE_S = 240


def _init(rank, world, init_file, hosts, timeout_s=60):
    os.environ["TORCH_CAM_HOST_ID"] = f"simhost{hosts[rank]}"
    import torch_cam  # noqa: F401

    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _checks(rank, world, init_file, hosts, engine):
    _init(rank, world, init_file, hosts)
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        import torch_cam
        assert isinstance(backend, torch_cam._C.HierarchicalBackend), type(backend)
        assert backend.inter_host_engine == {"ucx": "cam-ucx", "gloo": "gloo"}[engine], backend.inter_host_engine
        want = [[r for r in range(world) if hosts[r] == h] for h in dict.fromkeys(hosts)]
        assert backend.host_ranks == want, (backend.host_ranks, want)
        return check_all(rank, world)
    finally:
        dist.destroy_process_group()


def _subgroup(rank, world, init_file, hosts):
    """A cam subgroup whose ranks are not contiguous per host, inside a world group."""
    _init(rank, world, init_file, hosts)
    try:
        members = [0, 1, 2]  # on hosts 0, 1, 0 of the interleaved layout
        sub = dist.new_group(members, backend="cam")
        if rank in members:
            t = torch.full((5,), float(rank + 1))
            dist.all_reduce(t, group=sub)
            assert torch.all(t == sum(m + 1 for m in members)), t
            out = [torch.empty(3) for _ in members]
            dist.all_gather(out, torch.full((3,), float(rank)), group=sub)
            assert [o[0].item() for o in out] == [float(m) for m in members], out
        dist.barrier()
        return "ok"
    finally:
        dist.destroy_process_group()


def _extensions(rank, world, init_file, hosts):
    """torch_cam.empty allocates in the host's heap; torch_cam.all_reduce_ runs the group's own
    all_reduce (SUM, MAX given as an int code, a strided tensor); get_cam_backend (direct views
    of peers' memory) refuses, naming the hosts."""
    _init(rank, world, init_file, hosts)
    import torch_cam
    try:
        t = torch_cam.empty(4)  # in this host's heap
        assert torch_cam.is_heap_tensor(t), "torch_cam.empty on a group across hosts is not in the host's heap"
        t = torch.full((5,), float(rank + 1))
        assert torch_cam.all_reduce_(t) is t
        assert torch.all(t == world * (world + 1) / 2), t
        t = torch.full((3,), float(rank))
        torch_cam.all_reduce_(t, op=dist.ReduceOp.MAX.value)  # the int code, as the single-host form takes
        assert torch.all(t == world - 1), t
        wide = torch.zeros(4, 2)
        wide[:, 1] = rank + 1
        torch_cam.all_reduce_(wide[:, 1])
        assert torch.all(wide[:, 1] == world * (world + 1) / 2) and torch.all(wide[:, 0] == 0), wide
        try:  # direct views of peers' memory need one host
            torch_cam.get_cam_backend()
        except RuntimeError as e:
            assert "spans 2 hosts" in str(e) and "UCX" in str(e), str(e)
        else:
            raise AssertionError("get_cam_backend gave a backend for a group that spans hosts")
        return "ok"
    finally:
        dist.destroy_process_group()


def _timed_raise(call):
    """("raised" | "returned", seconds, message) of call()."""
    start = time.monotonic()
    try:
        call()
    except RuntimeError as e:
        return ("raised", time.monotonic() - start, str(e))
    return ("returned", time.monotonic() - start, "")


def _mismatch(rank, world, init_file, hosts):
    """Rank 3 (host 1) passes a different size: every rank, on both hosts, raises fast."""
    _init(rank, world, init_file, hosts, timeout_s=60)
    try:
        return _timed_raise(lambda: dist.all_reduce(torch.ones(8 if rank == 3 else 4)))
    finally:
        dist.destroy_process_group()


def _one_rank_bad_list(rank, world, init_file, hosts):
    """Only rank 1 passes an all_gather output list one short: every rank raises fast."""
    _init(rank, world, init_file, hosts, timeout_s=60)
    try:
        outs = [torch.empty(4) for _ in range(world - (1 if rank == 1 else 0))]
        return _timed_raise(lambda: dist.all_gather(outs, torch.ones(4)))
    finally:
        dist.destroy_process_group()


def _uneven_sizes_disagree(rank, world, init_file, hosts):
    """Rank 3 (host 1) expects one element more from rank 0 in an uneven all_gather, and rank 1
    (host 0) splits an uneven reduce_scatter otherwise: every rank raises fast, naming the sizes."""
    _init(rank, world, init_file, hosts, timeout_s=60)
    try:
        sizes = [1 + r + (1 if rank == 3 and r == 0 else 0) for r in range(world)]
        outs = [torch.empty(k) for k in sizes]
        first = _timed_raise(lambda: dist.all_gather(outs, torch.ones(1 + rank)))
        return first
    finally:
        dist.destroy_process_group()


def _uneven_reduce_scatter_disagree(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts, timeout_s=60)
    try:
        sizes = [2, 1, 3, 1] if rank == 1 else [1, 2, 3, 1]
        return _timed_raise(lambda: dist.reduce_scatter(torch.empty(sizes[rank]), [torch.ones(k) for k in sizes]))
    finally:
        dist.destroy_process_group()


def _monitored_barrier_missing(rank, world, init_file, hosts):
    """Ranks 1 (host 0) and 3 (host 1) never reach the monitored barrier: rank 0 names both,
    rank 2 says that rank 0 did not release it; both within the barrier's timeout."""
    import torch_cam
    _init(rank, world, init_file, hosts, timeout_s=60)
    try:
        dist.barrier()
        if rank in (1, 3):
            time.sleep(4)
            return ("absent", 0.0, "")
        return _timed_raise(lambda: torch_cam.monitored_barrier(timeout=datetime.timedelta(seconds=2),
                                                                wait_all_ranks=True))
    finally:
        dist.destroy_process_group()


def _killed(rank, world, init_file, hosts):
    """Rank 3 (host 1) dies mid-job: every other rank raises well within the timeout."""
    _init(rank, world, init_file, hosts, timeout_s=60)
    t = torch.ones(1 << 10)
    dist.all_reduce(t)
    if rank == 3:
        os._exit(1)
    start = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
            time.sleep(0.01)
    except RuntimeError as e:
        return ("raised", time.monotonic() - start, str(e))
    return ("returned", time.monotonic() - start, "")


def _kv(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts)
    try:
        return check_kv(rank, world)
    finally:
        dist.destroy_process_group()


def _afd(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts)
    try:
        return check_afd(rank, world)
    finally:
        dist.destroy_process_group()


def _afd_dead_ffn(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts, timeout_s=30)
    return check_afd_dead_ffn(rank, world)


def _weights(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts)
    try:
        return check_weights(rank, world)
    finally:
        dist.destroy_process_group()


def _weights_dead_trainer(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts, timeout_s=30)
    return check_weights_dead_trainer(rank, world, timeout_s=15)


def _moe(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts, timeout_s=120)
    try:
        return check_moe(rank, world)
    finally:
        dist.destroy_process_group()


def _moe_dead_peer(rank, world, init_file, hosts, op="dispatch"):
    _init(rank, world, init_file, hosts, timeout_s=20)
    return check_moe_dead_peer(rank, world, timeout_s=20, op=op)


def _moe_dead_peer_in_combine(rank, world, init_file, hosts):
    return _moe_dead_peer(rank, world, init_file, hosts, op="combine")


def _kv_dead_peer(rank, world, init_file, hosts):
    _init(rank, world, init_file, hosts, timeout_s=60)
    return check_kv_dead_peer(rank, world, timeout_s=30)


def _p2p_across_hosts(rank, world, init_file, hosts):
    """Point-to-point between hosts over UCX: strided tensors, a message longer and one shorter
    than the receiving tensor (the receiver raises naming both sizes, the group stays usable),
    then a receive from a rank that dies."""
    _init(rank, world, init_file, hosts, timeout_s=60)
    out = {}
    if rank == 0:
        dist.send(torch.arange(12.0).view(3, 4).t(), 2)  # strided on the sending side
        dist.send(torch.ones(8), 2, tag=1)
        dist.send(torch.ones(2), 2, tag=2)
    elif rank == 2:
        got = torch.empty(3, 8)[:, :4].t()  # strided on the receiving side
        dist.recv(got, 0)
        out["strided"] = torch.equal(got, torch.arange(12.0).view(3, 4).t())
        for tag in (1, 2):
            out[tag] = _timed_raise(lambda: dist.recv(torch.empty(4), 0, tag=tag))
    t = torch.ones(3)
    dist.all_reduce(t)  # still usable
    out["usable"] = bool(torch.all(t == world))
    if rank == 3:
        os._exit(1)
    if rank == 1:
        out["dead"] = _timed_raise(lambda: dist.recv(torch.empty(4), 3, tag=9))
    if rank == 0:  # from any source: the rank lost on another host ends it too
        out["dead_any"] = _timed_raise(lambda: dist.recv(torch.empty(4), tag=10))
    return out


def _have_ucx():
    import torch_cam
    return torch_cam._C.ucx_version is not None


def _split_mismatch(rank, world, init_file, hosts, hops="direct"):
    """Rank 3 (host 1) expects 2 elements from rank 0 where rank 0 sends 1: every rank raises
    fast, and the rank that saw it names both lengths."""
    os.environ["TORCH_CAM_ALL_TO_ALL_HOPS"] = hops
    _init(rank, world, init_file, hosts, timeout_s=60)
    try:
        out_splits = [2 if rank == 3 and p == 0 else 1 for p in range(world)]
        out = torch.empty(sum(out_splits))
        first = _timed_raise(lambda: dist.all_to_all_single(out, torch.ones(world), out_splits, [1] * world))
        return first, _timed_raise(lambda: dist.all_reduce(torch.ones(1)))
    finally:
        dist.destroy_process_group()


def _dtype_differs_between_hosts(rank, world, init_file, hosts):
    """Host 1's ranks all_reduce int32 where host 0's reduce float32 of the same bytes: inside a
    host the ranks agree, so only the hosts' leaders can see it; every rank raises."""
    _init(rank, world, init_file, hosts, timeout_s=60)
    try:
        t = torch.ones(8, dtype=torch.int32 if rank >= 2 else torch.float32)
        return _timed_raise(lambda: dist.all_reduce(t))
    finally:
        dist.destroy_process_group()


def _frozen(rank, world, init_file, hosts):
    """Rank 3 (host 1) stops (SIGSTOP: alive, silent): every other rank raises at the group's
    deadline, not later, naming the timeout."""
    import signal
    _init(rank, world, init_file, hosts, timeout_s=4)
    t = torch.ones(1 << 10)
    dist.all_reduce(t)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    return _timed_raise(lambda: [dist.all_reduce(t) for _ in range(1000)])


def _option_differs(rank, world, init_file, hosts, name, value):
    """Rank 2 sets a group-wide option where the others leave it (say gloo between hosts where
    the others ask for UCX): every rank refuses the group at init, naming the option (the two
    engines, or all_to_all's two paths, would never meet), rather than hang."""
    import time
    if rank == 2:
        os.environ["TORCH_CAM_" + name.upper()] = value
    start = time.monotonic()
    try:
        _init(rank, world, init_file, hosts, timeout_s=30)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    dist.destroy_process_group()
    return "no error", time.monotonic() - start


class _HierarchicalCases:
    ENGINE = ""

    def run_ranks(self, fn, world, *args, **kw):
        return run_ranks(fn, world, *args, env={"TORCH_CAM_INTER_HOST_ENGINE": self.ENGINE}, **kw)

    def _run(self, hosts, fn=None):
        """Runs fn (default: every collective) on the hosts; each rank returns what went wrong."""
        before = set(cam_segments())
        args = (self.ENGINE,) if fn is None else ()
        results = self.run_ranks(fn or _checks, len(hosts), hosts, *args, deadline_s=DEADLINE_S)
        assert_all_ok(self, results)
        bad = {r: v for r, (_, v) in results.items() if v}
        self.assertFalse(bad, "\n".join(f"rank {r}: {m}" for r, ms in bad.items() for m in ms))
        self.assertEqual(set(cam_segments()) - before, set())

    def test_two_hosts_of_two(self):
        self._run([0, 0, 1, 1])

    def test_two_hosts_interleaved(self):
        self._run([0, 1, 0, 1])  # hosts' ranks not contiguous

    def test_three_hosts_of_one(self):
        self._run([0, 1, 2])

    def test_hosts_of_unequal_size(self):
        self._run([0, 0, 1])  # leaders, no rails

    def test_subgroup_across_hosts(self):
        assert_all_ok(self, self.run_ranks(_subgroup, 4, [0, 1, 0, 1], deadline_s=120))

    def test_extensions_on_a_group_across_hosts(self):
        assert_all_ok(self, self.run_ranks(_extensions, 4, [0, 0, 1, 1], deadline_s=120))

    def test_mismatch_raises_on_every_host(self):
        results = self.run_ranks(_mismatch, 4, [0, 0, 1, 1], deadline_s=120)
        assert_all_ok(self, results)
        for r, (_, (how, took, msg)) in results.items():
            self.assertEqual(how, "raised", f"rank {r}")
            self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
            self.assertIn("all_reduce", msg)
        # Host 1 refuses the op itself; host 0's leader names that cause, not a closed socket.
        for r in (2, 3):
            self.assertIn("contributes", results[r][1][2])
        self.assertIn("a rank of another host failed", results[0][1][2])
        self.assertIn("contributes", results[0][1][2])

    def test_one_rank_alone_bad_arguments_fail_every_rank(self):
        results = self.run_ranks(_one_rank_bad_list, 4, [0, 0, 1, 1], deadline_s=120)
        assert_all_ok(self, results)
        for r, (_, (how, took, msg)) in results.items():
            self.assertEqual(how, "raised", f"rank {r}")
            self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
        self.assertIn("needs one list of 4 output tensors", results[1][1][2])
        self.assertIn("rank 1", results[0][1][2])

    def test_uneven_sizes_that_disagree_raise_on_every_host(self):
        for fn, what, odd in ((_uneven_sizes_disagree, "all_gather output sizes", 3),
                              (_uneven_reduce_scatter_disagree, "reduce_scatter input sizes", 1)):
            results = self.run_ranks(fn, 4, [0, 0, 1, 1], deadline_s=120)
            assert_all_ok(self, results)
            for r, (_, (how, took, msg)) in results.items():
                self.assertEqual(how, "raised", f"rank {r}")
                self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
                peer = 0 if r == odd else odd
                self.assertRegex(msg, rf"on rank {r} of group .*: rank {peer} passes {what} \[[\d, ]+\] while this "
                                      r"rank passes \[[\d, ]+\]; every rank must pass the same sizes")

    def test_monitored_barrier_names_the_missing_ranks_on_every_host(self):
        results = self.run_ranks(_monitored_barrier_missing, 4, [0, 0, 1, 1], deadline_s=120)
        assert_all_ok(self, results)
        how, took, msg = results[0][1]
        self.assertEqual(how, "raised", msg)
        self.assertRegex(msg, r"cam monitored_barrier \(seq \d+\) on rank 0 of group .*: timeout after 2000 ms waiting "
                              r"for ranks \[1, 3\] to reach the barrier \(2 ranks have not arrived\): Ranks 1, 3 "
                              r"failed to pass monitoredBarrier in 2000 ms")
        self.assertGreaterEqual(took, 1.9)
        self.assertLess(took, 6.0)
        how, took, msg = results[2][1]
        self.assertEqual(how, "raised", msg)
        self.assertIn("Rank 2 successfully reached monitoredBarrier, but received errors while waiting for "
                      "send/recv from rank 0", msg)
        self.assertLess(took, 6.0)

    def test_split_mismatch_raises_on_every_host(self):
        if self.ENGINE == "gloo":
            self.skipTest("gloo sees disagreeing all_to_all splits only where the bytes arrive, and ranks "
                          "whose own blocks matched complete (docs/multihost.md)")
        self._split_mismatch("direct")

    def test_split_mismatch_in_two_hops_raises_on_every_host(self):
        # Every receiver learns each source's sizes before any data moves: with either engine.
        self._split_mismatch("two_hops")

    def _split_mismatch(self, hops):
        results = self.run_ranks(_split_mismatch, 4, [0, 0, 1, 1], hops, deadline_s=120)
        assert_all_ok(self, results)
        for r, (_, (first, then)) in results.items():
            how, took, msg = first
            self.assertEqual(how, "raised", f"rank {r}")
            self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
            self.assertIn("all_to_all", msg)
            self.assertEqual(then[0], "raised", f"rank {r}: the group stayed usable after the failure")
        self.assertIn("rank 0 sends 4 bytes, this rank expects 8", results[3][1][0][2])

    def test_hosts_passing_another_dtype_raise_on_every_host(self):
        if self.ENGINE == "gloo":
            self.skipTest("gloo moves the bytes without comparing dtypes (docs/multihost.md)")
        results = self.run_ranks(_dtype_differs_between_hosts, 4, [0, 0, 1, 1], deadline_s=120)
        assert_all_ok(self, results)
        for r, (_, (how, took, msg)) in sorted(results.items()):
            self.assertEqual(how, "raised", f"rank {r}")
            self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
        leaders = [results[r][1][2] for r in (0, 2)]
        self.assertTrue(any("passes Int tensors reduced with SUM, this rank Float tensors" in m for m in leaders) and
                        any("passes Float tensors reduced with SUM, this rank Int tensors" in m for m in leaders),
                        leaders)

    def test_ranks_ask_for_different_all_to_all_paths(self):
        results = self.run_ranks(_option_differs, 4, [0, 0, 1, 1], "all_to_all_hops", "two_hops", deadline_s=120)
        for r, (status, (msg, took)) in sorted(results.items()):
            self.assertEqual(status, "ok", msg)
            self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
            theirs, mine = ("direct", "two_hops") if r == 2 else ("two_hops", "direct")
            self.assertIn(f"rank {0 if r == 2 else 2} has all_to_all_hops={theirs} but this rank has "
                          f"all_to_all_hops={mine}", msg)

    def test_frozen_rank_raises_at_the_deadline(self):
        results = self.run_ranks(_frozen, 4, [0, 0, 1, 1], deadline_s=90, allow_died=(3,))
        for r in (0, 1, 2):
            status, value = results[r]
            self.assertEqual(status, "ok", value)
            how, took, msg = value
            self.assertEqual(how, "raised", f"rank {r}")
            self.assertLess(took, 4 + 6, f"rank {r} took {took:.1f} s: {msg}")
        self.assertTrue(any("timeout after 4000 ms" in results[r][1][2] for r in (0, 1, 2)),
                        [results[r][1][2] for r in (0, 1, 2)])

    # MoE dispatch / combine and the Buffer run over the group's collectives.
    def test_moe_two_hosts_of_two(self):
        self._run([0, 0, 1, 1], _moe)

    def test_moe_three_hosts_of_one(self):
        self._run([0, 1, 2], _moe)

    def test_moe_two_hosts_interleaved(self):
        # Hosts whose ranks are not contiguous: rail peers and local indices are not rank // 2, rank % 2.
        self._run([0, 1, 1, 0], _moe)

    def check_dead_rank(self, fn, dead, expect):
        """fn on 2 x 2, where rank `dead` vanishes: every other rank raised in time with a message
        matching expect % rank, and nothing is left in /dev/shm."""
        before = set(cam_segments())
        results = self.run_ranks(fn, 4, [0, 0, 1, 1], deadline_s=120, allow_died=(dead,))
        for r in sorted(set(range(4)) - {dead}):
            status, value = results[r]
            self.assertEqual(status, "ok", value)
            how, took, msg = value
            self.assertEqual(how, "raised", f"rank {r} took {took:.1f} s: {msg}")
            self.assertRegex(msg, expect % r)
        self.assertEqual(set(cam_segments()) - before, set())

    def test_moe_dead_rank_raises_on_every_host(self):
        self.check_dead_rank(_moe_dead_peer, 3, r"cam moe_dispatch on rank %d")

    def test_moe_dead_rank_in_two_hop_combine_raises_on_every_host(self):
        self.check_dead_rank(_moe_dead_peer_in_combine, 3, r"cam moe_combine on rank %d")

    def test_dead_rank_raises_on_every_host(self):
        before = set(cam_segments())
        results = self.run_ranks(_killed, 4, [0, 0, 1, 1], deadline_s=120, allow_died=(3,))
        for r in (0, 1, 2):
            status, value = results[r]
            self.assertEqual(status, "ok", value)
            how, took, msg = value
            self.assertEqual(how, "raised", f"rank {r}")
            self.assertLess(took, 30.0, f"rank {r} took {took:.1f} s: {msg}")
        self.assertEqual(set(cam_segments()) - before, set())


@unittest.skipUnless(_have_ucx(), "this build of torch_cam has no UCX (apt-get install libucx-dev, then rebuild)")
class UcxHierarchicalTest(_HierarchicalCases, unittest.TestCase):
    ENGINE = "ucx"

    # KV transfer between hosts runs over UCX whatever engine the collectives use.
    def test_kv_two_hosts_of_two(self):
        self._run([0, 0, 1, 1], _kv)

    def test_kv_three_hosts_of_one(self):
        self._run([0, 1, 2], _kv)

    # AFD between hosts puts and gets over UCX whatever engine the collectives use.
    def test_afd_two_hosts_of_two(self):
        results = self.run_ranks(_afd, 4, [0, 0, 1, 1], deadline_s=DEADLINE_S)
        assert_all_ok(self, results)
        self.assertFalse([m for _, v in results.values() for m in v])

    def test_afd_three_hosts_of_one(self):
        results = self.run_ranks(_afd, 3, [0, 1, 2], deadline_s=DEADLINE_S)
        assert_all_ok(self, results)
        self.assertFalse([m for _, v in results.values() for m in v])

    def test_afd_dead_ffn_rank_raises_on_the_other_host(self):
        results = self.run_ranks(_afd_dead_ffn, 4, [0, 0, 1, 1], deadline_s=120, allow_died=(2,))
        for r in (0, 1):  # the attention ranks, both waiting for FFN rank 2 of the other host
            status, value = results[r]
            self.assertEqual(status, "ok", value)
            msg, elapsed, again = value
            self.assertRegex(msg, r"AfdError: .*rank 2 (is unreachable|died)", f"rank {r}")
            self.assertLess(elapsed, 8.0, f"rank {r} took {elapsed:.1f} s")
            self.assertRegex(again, r"the channel is broken", f"rank {r}")

    # Weight transfer reads other hosts' trainers over UCX whatever engine the collectives use.
    def test_weights_two_hosts_of_two(self):
        self._run([0, 0, 1, 1], _weights)

    def test_weights_three_hosts_of_one(self):
        self._run([0, 1, 2], _weights)

    def test_weights_dead_trainer_raises_on_every_host(self):
        self.check_dead_rank(_weights_dead_trainer, 0, r"weights update of version 2 on rank %d: .*(peer rank 0 died|"
                                                       r"rank 0 .*(unreachable|failed|gone))")

    def test_p2p_across_hosts_errors_and_dead_peer(self):
        results = self.run_ranks(_p2p_across_hosts, 4, [0, 0, 1, 1], deadline_s=120, allow_died=(3,))
        for r in (0, 1, 2):
            self.assertEqual(results[r][0], "ok", results[r][1])
            self.assertTrue(results[r][1]["usable"], f"rank {r}: the group failed after a refused recv")
        got = results[2][1]
        self.assertTrue(got["strided"])
        for tag, want in ((1, "rank 0 sent more than the 16 bytes this rank expects"),
                          (2, "rank 0 sent 8 bytes, this rank expects 16")):
            how, took, msg = got[tag]
            self.assertEqual(how, "raised", f"tag {tag}")
            self.assertIn(want, msg)
            self.assertIn("cam recv from rank 0", msg)
            self.assertLess(took, 5.0)
        for r, key in ((1, "dead"), (0, "dead_any")):
            how, took, msg = results[r][1][key]
            self.assertEqual(how, "raised", key)
            self.assertIn("rank 3", msg)
            self.assertIn("UCX endpoint failed", msg)
            self.assertLess(took, 10.0, msg)

    def test_ranks_ask_for_different_engines(self):
        results = self.run_ranks(_option_differs, 4, [0, 0, 1, 1], "inter_host_engine", "gloo", deadline_s=120)
        for r, (status, (msg, took)) in sorted(results.items()):
            self.assertEqual(status, "ok", msg)
            self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
            if r == 2:
                self.assertIn("rank 0 has inter_host_engine=ucx but this rank has inter_host_engine=gloo", msg)
            else:
                self.assertIn("rank 2 has inter_host_engine=gloo but this rank has inter_host_engine=ucx", msg)

    def test_kv_dead_peer_on_another_host(self):
        before = set(cam_segments())
        results = self.run_ranks(_kv_dead_peer, 4, [0, 0, 1, 1], deadline_s=120, allow_died=(3,))
        for r in (0, 1, 2):
            status, value = results[r]
            self.assertEqual(status, "ok", value)
            how, took, msg = value
            self.assertEqual(how, "RuntimeError", f"rank {r}: {msg}")
            self.assertLess(took, 10.0, f"rank {r} took {took:.1f} s: {msg}")
            self.assertIn("rank 3", msg)
            self.assertIn("| push:", msg)
        self.assertIn("UCX", results[0][1][2])  # host 0 reaches rank 3 over UCX
        self.assertEqual(set(cam_segments()) - before, set())


class GlooHierarchicalTest(_HierarchicalCases, unittest.TestCase):
    ENGINE = "gloo"


if __name__ == "__main__":
    unittest.main()
