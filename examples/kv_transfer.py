"""Prefill -> decode KV-cache transfer on one host over cam.

Run:  torchrun --nproc-per-node 2 examples/kv_transfer.py

Rank 0 plays a prefill worker, rank 1 a decode worker of a small model (4 layers, 8 KV heads,
head_dim 64, bf16). Both keep paged KV pools in the group's symmetric heap, with different
layouts (prefill NHD with 16-token blocks, decode HND with 32-token blocks). The prefill rank
"computes" a request's KV (seeded), writes it into its blocks, pushes them into the blocks the
decode rank allocated (the copy converts the layout), and the decode rank, once the notification
arrives, checks its cache bit for bit against the same seeded KV. The push runs asynchronously
on the group's engine; the prefill rank watches its layers complete.
"""
import time

import torch
import torch.distributed as dist

import torch_cam
from torch_cam.kv import KVTransfer
from torch_cam.kv_reference import KVLayout, gather_tokens, scatter_tokens

LAYERS, HEADS, HEAD_DIM, TOKENS = 4, 8, 64, 1000


def main():
    dist.init_process_group("cam")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "run with --nproc-per-node 2"
    if rank == 0:
        layout = KVLayout("mha", LAYERS, 128, 16, HEADS, HEAD_DIM, torch.bfloat16, "NHD")
    else:
        layout = KVLayout("mha", LAYERS, 64, 32, HEADS, HEAD_DIM, torch.bfloat16, "HND")
    pools = [torch_cam.zeros(*layout.pool_shape(), dtype=layout.dtype) for _ in range(LAYERS)]
    kv = KVTransfer()
    kv.register(pools, layout)
    dist.barrier()
    kv.version(1 - rank)  # first look at the peer's registration: maps its pools here (once)

    g = torch.Generator().manual_seed(7)
    truth = [torch.randn(2, TOKENS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    prefill_blocks = list(range(5, 5 + -(-TOKENS // 16)))         # where prefill keeps the request
    decode_blocks = list(range(63, 63 - -(-TOKENS // 32), -1))      # what decode allocated for it
    dist.barrier()

    if rank == 0:
        scatter_tokens(pools, layout, prefill_blocks, truth)        # the "prefill" result
        t0 = time.perf_counter()
        work = kv.push(1, prefill_blocks, decode_blocks, TOKENS, request_id=b"request-42", async_op=True)
        work.wait()
        dt = time.perf_counter() - t0
        assert all(work.layer_done(l) for l in range(LAYERS))
        print(f"[prefill rank 0] pushed {TOKENS} tokens x {LAYERS} layers ({work.nbytes / 2**20:.1f} MiB, "
              f"{len(prefill_blocks)} blocks of 16 -> {len(decode_blocks)} blocks of 32, NHD -> HND) "
              f"in {dt * 1e3:.2f} ms ({work.nbytes / dt / 1e9:.1f} GB/s)", flush=True)
    else:
        note = kv.wait_notification(b"request-42", peer=0, timeout_s=60)
        got = gather_tokens(pools, layout, decode_blocks, TOKENS)
        ok = note.ok and all(torch.equal(a, b) for a, b in zip(got, truth))
        print(f"[decode rank 1] notification {note.request_id.decode()} from rank {note.peer}: "
              f"{'ok' if note.ok else note.message}, {note.nbytes / 2**20:.1f} MiB; cache matches the "
              f"prefill KV bit for bit: {'PASS' if ok else 'FAIL'}", flush=True)
        if not ok:
            raise SystemExit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
