"""KV transfer between ranks of a cam group (torch_cam.kv.KVTransfer): push and pull of a
request's blocks between heap-registered pools, with TP/block-size/order conversion, checked
bit for bit against torch_cam.kv_reference; notifications after the data; versions; bounds
checks before anything moves; failures reported to both sides."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cam  # noqa: E402
from cam_testing import CamProcessGroupCase  # noqa: E402
from torch_cam.kv import KVTransfer  # noqa: E402
from torch_cam.kv_reference import KVLayout, gather_tokens, scatter_tokens, shard_heads  # noqa: E402

HEADS, D, LAYERS = 4, 8, 3


def layout(tp_rank, tp_size, order="NHD", block_size=4, blocks=32, kind="mha"):
    if kind == "mla":
        return KVLayout("mla", LAYERS, blocks, block_size, 1, 16, torch.bfloat16, "NHD", tp_rank, tp_size)
    return KVLayout("mha", LAYERS, blocks, block_size, HEADS // tp_size, D, torch.bfloat16, order, tp_rank,
                    tp_size, HEADS)


def model_kv(num_tokens, seed, kind="mha"):
    """The whole model's KV of a request, per layer (the ground truth)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_tokens, HEADS, D) if kind == "mha" else (num_tokens, 16)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def heap_pools(lay, kv=None):
    if kv is not None:
        return kv.allocate(lay)
    return [torch_cam.zeros(*lay.pool_shape(), dtype=lay.dtype) for _ in range(lay.num_layers)]


class KVCases(CamProcessGroupCase):
    timeout = timedelta(seconds=120)

    def setup(self, prefill_ranks, decode_ranks, p_kw, d_kw, kind="mha"):
        """Ranks in prefill_ranks form a prefill TP group, decode_ranks a decode TP group; each
        registers heap pools; returns (kv, my layout, my pools, role, tp index)."""
        kv = KVTransfer()
        r = self.rank
        if r in prefill_ranks:
            lay = layout(prefill_ranks.index(r), len(prefill_ranks), kind=kind, **p_kw)
            role, idx = "prefill", prefill_ranks.index(r)
        elif r in decode_ranks:
            lay = layout(decode_ranks.index(r), len(decode_ranks), kind=kind, **d_kw)
            role, idx = "decode", decode_ranks.index(r)
        else:
            lay, role, idx = None, "idle", -1
        pools = heap_pools(lay, kv if r % 2 else None) if lay is not None else None
        if lay is not None:
            kv.register(pools, lay)
        dist.barrier()
        return kv, lay, pools, role, idx

    def check_decode(self, lay, pools, ids, num_tokens, seed, kind="mha", layers=None):
        truth = model_kv(num_tokens, seed, kind)
        got = gather_tokens(pools, lay, ids, num_tokens)
        for l in (layers if layers is not None else range(LAYERS)):
            want = shard_heads(truth[l], lay) if kind == "mha" else truth[l]
            self.assertTrue(torch.equal(got[l], want), f"layer {l}")

    def run_request(self, prefill_ranks, decode_ranks, p_kw, d_kw, mode, num_tokens=13, kind="mha", seed=1,
                    layers=None):
        kv, lay, pools, role, idx = self.setup(prefill_ranks, decode_ranks, p_kw, d_kw, kind)
        p_ids = list(range(3, 3 + -(-num_tokens // (p_kw.get("block_size", 4)))))
        d_ids = [30 - i for i in range(-(-num_tokens // d_kw.get("block_size", 4)))]  # reversed, scattered
        rid = f"req-{seed}".encode()
        if role == "prefill":
            scatter_tokens(pools, lay, p_ids, [shard_heads(t, lay) if kind == "mha" else t
                                               for t in model_kv(num_tokens, seed, kind)])
        dist.barrier()
        if mode == "push" and role == "prefill":
            for d in decode_ranks:
                work = kv.push(d, p_ids, d_ids, num_tokens, request_id=rid, layers=layers, async_op=True)
                work.wait()
                self.assertTrue(work.is_completed())
                for l in (layers if layers is not None else range(LAYERS)):
                    self.assertTrue(work.layer_done(l))
        elif mode == "push" and role == "decode":
            senders = set()
            for _ in prefill_ranks:
                n = kv.wait_notification(rid, timeout_s=60)
                self.assertTrue(n.ok, n.message)
                self.assertEqual(n.kind, "push")
                senders.add(n.peer)
            self.assertEqual(senders, set(prefill_ranks))
            self.check_decode(lay, pools, d_ids, num_tokens, seed, kind, layers)
        elif mode == "pull" and role == "decode":
            for p in prefill_ranks:
                kv.pull(p, p_ids, d_ids, num_tokens, request_id=rid, layers=layers)
            self.check_decode(lay, pools, d_ids, num_tokens, seed, kind, layers)
        elif mode == "pull" and role == "prefill":
            for _ in decode_ranks:
                n = kv.wait_notification(rid, timeout_s=60)
                self.assertTrue(n.ok and n.kind == "pull", n)
        dist.barrier()

    def test_push_and_pull_same_layout(self):
        self.run_request([0], [1], {}, {}, "push", seed=2)
        self.run_request([0], [1], {}, {}, "pull", seed=3)

    def test_layout_conversion(self):
        self.run_request([0], [1], {"order": "NHD", "block_size": 4}, {"order": "HND", "block_size": 6},
                         "push", num_tokens=29, seed=4)
        self.run_request([1], [0], {"order": "HND", "block_size": 8}, {"order": "NHD", "block_size": 4},
                         "pull", num_tokens=17, seed=5, layers=[0, 2])
        self.run_request([0], [1], {}, {"block_size": 16}, "push", num_tokens=21, kind="mla", seed=6)

    def test_bad_blocks_refused_before_anything_moves(self):
        kv, lay, pools, role, idx = self.setup([0], [1], {}, {})
        if role == "prefill":
            before = [p.clone() for p in kv.peer_pools(1)]
            with self.assertRaisesRegex(IndexError, r"dst_block_ids\[1\] = 99 is out of range"):
                kv.push(1, [0, 1], [0, 99], 8, request_id=b"bad-block")
            with self.assertRaisesRegex(IndexError, "layer 7"):
                kv.push(1, [0, 1], [0, 1], 8, layers=[7], request_id=b"bad-layer")
            self.assertTrue(all(torch.equal(a, b) for a, b in zip(kv.peer_pools(1), before)))
        elif role == "decode":
            # The decode side hears about both failures, with the cause.
            n = kv.wait_notification(b"bad-block", timeout_s=30)
            self.assertFalse(n.ok)
            self.assertIn("dst_block_ids[1] = 99", n.message)
            self.assertIn("layer 7", kv.wait_notification(b"bad-layer", timeout_s=30).message)
        dist.barrier()

    def test_unreadable_ids_and_long_request_ids_fail_both_sides_at_once(self):
        """Block ids that are not ints fail the push and tell the decode rank (whose wait
        returns at once, not at its timeout); a request id longer than a notification holds is
        refused by push and by wait_notification alike."""
        kv, lay, pools, role, idx = self.setup([0], [1], {}, {})
        long_id = b"x" * 65
        if role == "prefill":
            with self.assertRaisesRegex(ValueError, r"src_block_ids must hold ints, got 0\.5"):
                kv.push(1, [0.5, 1], [0, 1], 8, request_id=b"float-ids")
            with self.assertRaisesRegex(ValueError, r"request_id has 65 bytes, at most 64"):
                kv.push(1, [0], [0], 4, request_id=long_id)
        elif role == "decode":
            start = time.monotonic()
            n = kv.wait_notification(b"float-ids", timeout_s=30)
            self.assertLess(time.monotonic() - start, 5)
            self.assertFalse(n.ok)
            self.assertIn("src_block_ids must hold ints", n.message)
            with self.assertRaisesRegex(ValueError, r"request_id has 65 bytes, at most 64"):
                kv.wait_notification(long_id, timeout_s=30)
        dist.barrier()

    def test_reregistration_refuses_stale_version(self):
        kv, lay, pools, role, idx = self.setup([0], [1], {}, {})
        if role == "prefill":
            v = kv.version(1)
        dist.barrier()
        if role == "decode":
            before = kv.version(self.rank)  # this rank's own registration reads like a peer's
            self.assertGreater(kv.register(pools, lay), before)  # bumps the version
            self.assertGreater(kv.version(self.rank), before)
        dist.barrier()
        if role == "prefill":
            with self.assertRaisesRegex(RuntimeError, "re-registered"):
                kv.push(1, [0], [0], 4, request_id=b"stale", version=v)  # planned against the old one
            self.assertGreater(kv.version(1), v)
            kv.push(1, [0], [0], 4, request_id=b"after", version=kv.version(1))  # a fresh plan works
        elif role == "decode":
            self.assertFalse(kv.wait_notification(b"stale", timeout_s=30).ok)
            self.assertTrue(kv.wait_notification(b"after", timeout_s=30).ok)
        dist.barrier()

    def test_full_ring_times_out_and_group_stays_usable(self):
        """A peer that never reads its notifications fills the ring (64 slots): the next push,
        synchronous or asynchronous, fails with TimeoutError at the transfer's deadline (the
        data was written, the error says so); the group stays usable, and once the peer drains
        the ring, pushes go through again."""
        kv, lay, pools, role, idx = self.setup([0], [1], {}, {})
        if role == "prefill":
            short = KVTransfer(timeout_s=0.5)
        else:
            short = KVTransfer()  # collective construction
        if role in ("prefill", "decode"):
            short.register(pools, lay)
        dist.barrier()
        if role == "prefill":
            for i in range(64):
                short.push(1, [0], [i % 32], 4, request_id=b"fill")
            t0 = time.monotonic()
            with self.assertRaisesRegex(TimeoutError, "ring of 64 full.*the data was written"):
                short.push(1, [0], [0], 4, request_id=b"one-too-many")
            self.assertLess(time.monotonic() - t0, 10)
            work = short.push(1, [0], [1], 4, request_id=b"async-too-many", async_op=True)
            with self.assertRaisesRegex(TimeoutError, "ring of 64 full"):
                work.wait()
            self.assertEqual(work.failed_blocks(), {1})
        dist.barrier()  # the group is still usable
        if role == "decode":
            got = short.poll_notifications()
            self.assertEqual([n.request_id for n in got], [b"fill"] * 64)
            self.assertTrue(all(n.ok and n.peer == 0 for n in got))
        dist.barrier()
        if role == "prefill":
            short.push(1, [0], [0], 4, request_id=b"after")
        elif role == "decode":
            self.assertTrue(short.wait_notification(b"after", peer=0, timeout_s=30).ok)
        dist.barrier()

    def test_wait_notification_deadline(self):
        kv, lay, pools, role, idx = self.setup([0], [1], {}, {})
        if role == "decode":
            t0 = time.monotonic()
            with self.assertRaisesRegex(TimeoutError, "no notification for request 'never' from rank 0"):
                kv.wait_notification(b"never", peer=0, timeout_s=0.2)
            self.assertLess(time.monotonic() - t0, 5)
        dist.barrier()

    def test_concurrent_async_requests(self):
        """Eight asynchronous pushes in flight at once (the engine interleaves them layer by
        layer), completed through their futures; each notification arrives once, after its data."""
        kv, lay, pools, role, idx = self.setup([0], [1], {}, {})
        n_req, tokens = 8, 8
        if role == "prefill":
            for r in range(n_req):
                scatter_tokens(pools, lay, [2 * r, 2 * r + 1],
                               [shard_heads(t, lay) for t in model_kv(tokens, 100 + r)])
            works = [kv.push(1, torch.tensor([2 * r, 2 * r + 1]), [31 - 2 * r, 30 - 2 * r], tokens,
                             request_id=f"c{r}".encode(), async_op=True) for r in range(n_req)]
            torch.futures.wait_all([w.get_future() for w in works])
            self.assertTrue(all(w.is_completed() and w.exception() is None for w in works))
        elif role == "decode":
            for r in reversed(range(n_req)):
                n = kv.wait_notification(f"c{r}".encode(), peer=0, timeout_s=60)
                self.assertTrue(n.ok, n.message)
                self.assertEqual(n.nbytes, LAYERS * 2 * tokens * HEADS * D * 2)
                self.check_decode(lay, pools, [31 - 2 * r, 30 - 2 * r], tokens, 100 + r)
            self.assertEqual(kv.poll_notifications(), [])
        dist.barrier()


class KV2(KVCases, MultiProcContinuousTest):
    world_size = 2


class KV4(KVCases, MultiProcContinuousTest):
    world_size = 4

    def test_tp_conversion(self):
        """Prefill TP 2 (ranks 0, 1) -> decode TP 1 (rank 2) and TP 1 (rank 3) -> TP 2 (ranks 0, 1)."""
        self.run_request([0, 1], [2], {}, {}, "push", seed=8)
        self.run_request([3], [0, 1], {}, {"order": "HND"}, "pull", seed=9)
        self.run_request([0, 1], [2, 3], {"block_size": 8}, {"block_size": 4, "order": "HND"}, "push", seed=10,
                         num_tokens=33)


if __name__ == "__main__":
    run_tests()
