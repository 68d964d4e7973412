"""Bad input raises a clear exception naming the op, the rank, the peer and expected vs
received; mismatches between ranks fail on every rank involved, and the group stays usable."""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cam  # noqa: F401,E402
from cam_testing import make, same_bytes  # noqa: E402


class CamErrorsTest(MultiProcContinuousTest):
    world_size = 3
    timeout = timedelta(seconds=60)

    @classmethod
    def backend_str(cls):
        return "cam"

    # A string, not a method: torch's TestCase.assertRaisesRegex ignores the regex otherwise.
    device_type = "cpu"

    def assert_group_usable(self):
        want = make(1000, torch.float32, seed=1)
        t = want.clone() if self.rank == 0 else torch.zeros(1000)
        dist.broadcast(t, src=0)
        self.assertTrue(same_bytes(t, want))

    def test_broadcast_size_mismatch_fails_everywhere(self):
        n = 10 if self.rank != 2 else 12
        with self.assertRaisesRegex(RuntimeError,
                                    r"cam broadcast \(seq \d+\) on rank %d: root rank 0 broadcasts 40 bytes of "
                                    r"Float but (this rank|rank 2)'s tensor holds 48 bytes of Float" % self.rank):
            dist.broadcast(torch.zeros(n), src=0)
        self.assert_group_usable()

    def test_broadcast_dtype_mismatch(self):
        t = torch.zeros(4, dtype=torch.int32 if self.rank == 1 else torch.float32)
        with self.assertRaisesRegex(RuntimeError, r"16 bytes of Float but (this rank|rank 1)'s tensor holds 16 bytes of Int"):
            dist.broadcast(t, src=0)
        self.assert_group_usable()

    def test_broadcast_root_disagreement(self):
        with self.assertRaisesRegex(RuntimeError, r"broadcasts from root \d while this rank uses root"):
            dist.broadcast(torch.zeros(3), src=1 if self.rank == 0 else 0)
        self.assert_group_usable()

    def test_all_to_all_split_mismatch(self):
        # Rank 0 sends 2 rows to rank 1, but rank 1 expects 1 row from rank 0.
        send = {0: [1, 2, 0], 1: [1, 1, 1], 2: [0, 1, 1]}[self.rank]
        recv = {0: [1, 1, 0], 1: [1, 1, 1], 2: [1, 1, 1]}[self.rank]
        inp = torch.zeros(sum(send), 2)
        out = torch.zeros(sum(recv), 2)
        with self.assertRaisesRegex(RuntimeError, r"(this rank|rank 0) sends 16 bytes of Float to (this rank|rank 1) but "
                                                  r"(this rank|rank 1) expects 8 bytes of Float from (this rank|rank 0)"):
            dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
        self.assert_group_usable()

    def test_all_to_all_local_split_errors(self):
        # Rank 1's own checks refuse its arguments while the others pass good ones: rank 1 raises
        # at once, and so does every other rank, naming rank 1 and its reason.
        def expect(reason, bad_call, good_call):
            pattern = (r"cam all_to_all_single \(seq \d+\) on rank 1: " if self.rank == 1 else
                       r"cam all_to_all_single \(seq \d+\) on rank %d: rank 1 refused its arguments: " % self.rank)
            with self.assertRaisesRegex(RuntimeError, pattern + reason):
                bad_call() if self.rank == 1 else good_call()

        good = lambda: dist.all_to_all_single(torch.zeros(6), torch.zeros(6))  # noqa: E731
        expect(r"input_split_sizes add up to 5 but the input tensor has 6 rows",
               lambda: dist.all_to_all_single(torch.zeros(6), torch.zeros(6), [2, 2, 2], [1, 2, 2]), good)
        expect(r"the input tensor has 7 rows along dim 0, which does not split evenly over 3",
               lambda: dist.all_to_all_single(torch.zeros(7), torch.zeros(7)), good)
        be = torch_cam.get_cam_backend()
        expect(r"input is Float but output is Long",
               lambda: be.alltoall_base(torch.zeros(3, dtype=torch.long), torch.zeros(3), [], [], dist.AllToAllOptions()),
               lambda: be.alltoall_base(torch.zeros(3), torch.zeros(3), [], [], dist.AllToAllOptions()).wait())
        self.assert_group_usable()

    def test_send_recv_size_mismatch_fails_both_sides(self):
        if self.rank == 0:
            with self.assertRaisesRegex(RuntimeError, r"cam send \(seq \d+\) on rank 0 to rank 1 \(tag 3\): the message "
                                                      r"holds 40 bytes of Float but the matching recv on rank 1 expects "
                                                      r"32 bytes of Float"):
                dist.send(torch.zeros(10), 1, tag=3)
        elif self.rank == 1:
            with self.assertRaisesRegex(RuntimeError, r"cam recv \(seq \d+\) on rank 1: rank 0 sent a message with tag 3 "
                                                      r"holding 40 bytes of Float but this recv expects 32 bytes of Float"):
                dist.recv(torch.zeros(8), 0, tag=3)
        # The dropped message did not corrupt the stream.
        if self.rank == 0:
            dist.send(torch.arange(4.0), 1, tag=3)
        elif self.rank == 1:
            t = torch.zeros(4)
            dist.recv(t, 0, tag=3)
            self.assertEqual(t.tolist(), [0.0, 1.0, 2.0, 3.0])
        self.assert_group_usable()

    def test_send_recv_dtype_mismatch(self):
        if self.rank == 2:
            with self.assertRaisesRegex(RuntimeError, r"holds 8 bytes of Long but the matching recv on rank 0 expects 8 bytes of Double"):
                dist.send(torch.zeros(1, dtype=torch.long), 0)
        elif self.rank == 0:
            with self.assertRaisesRegex(RuntimeError, r"rank 2 sent a message with tag 0 holding 8 bytes of Long but this recv expects 8 bytes of Double"):
                dist.recv(torch.zeros(1, dtype=torch.double), 2)
        self.assert_group_usable()

    def test_collective_order_mismatch(self):
        with self.assertRaisesRegex(RuntimeError, r"issued (barrier|broadcast) as its collective #\d+ while this rank "
                                                  r"issued (barrier|broadcast)"):
            if self.rank == 0:
                dist.barrier()
            else:
                dist.broadcast(torch.zeros(2), src=1)
        self.assert_group_usable()

    def test_bad_arguments_on_the_backend(self):
        be = torch_cam.get_cam_backend()
        with self.assertRaisesRegex(RuntimeError, r"cam send on rank \d: destination rank 7 is out of range for a group of 3 ranks"):
            be.send([torch.zeros(1)], 7, 0)
        with self.assertRaisesRegex(RuntimeError, r"cam recv on rank \d: source rank -2 is out of range"):
            be.recv([torch.zeros(1)], -2, 0)
        with self.assertRaisesRegex(RuntimeError, r"cam send on rank (\d): a rank cannot send to itself"):
            be.send([torch.zeros(1)], self.rank, 0)
        with self.assertRaisesRegex(RuntimeError, r"cam broadcast \(seq \d+\) on rank \d: expected a CPU tensor, got one on meta"):
            opts = dist.BroadcastOptions()
            be.broadcast([torch.zeros(2, device="meta")], opts)
        with self.assertRaisesRegex(RuntimeError, r"expected a dense tensor, got layout Sparse"):
            be.broadcast([torch.zeros(2).to_sparse()], dist.BroadcastOptions())
        with self.assertRaisesRegex(RuntimeError, r"cam broadcast \(seq \d+\) on rank \d: root rank 5 is out of range"):
            opts = dist.BroadcastOptions()
            opts.rootRank = 5
            be.broadcast([torch.zeros(2)], opts)
        self.assert_group_usable()

    def test_pg_options_validation(self):
        with self.assertRaisesRegex(ValueError, r"unknown option\(s\) \['window_size'\]"):
            torch_cam.Options().merged({"window_size": 1})
        g = None
        with self.assertRaisesRegex(RuntimeError, r"chunk_bytes: expected a multiple of 64 that is >= 4096, got 100"):
            g = dist.new_group([0, 1, 2], pg_options={"chunk_bytes": 100})
        self.assertIsNone(g)
        self.assert_group_usable()


if __name__ == "__main__":
    run_tests()
