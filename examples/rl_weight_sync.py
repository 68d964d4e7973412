"""RL weight sync on one host over cam: 2 trainer ranks (TP 2, fp32) -> 2 rollout replicas (TP 1, bf16).

Run:  torchrun --nproc-per-node 4 examples/rl_weight_sync.py

Ranks 0 and 1 train a small transformer with tensor parallelism: each holds its Megatron-style
shard of every weight (column-parallel layers split on dim 0, row-parallel ones on dim 1,
norms whole) as fp32 parameters with an SGD optimizer. To keep the example short the gradient of
a step comes from a single-process copy of the model (both trainers compute the same one and each
applies its shard of it). Ranks 2 and 3 are two rollout replicas serving the whole model in bf16.
Three times: the trainers step, publish the new version, the rollouts take it in place (resharded
2 -> 1 and cast fp32 -> bf16 inside the one copy), run a forward pass and check their logits bit
for bit against a single-process bf16 model of that version.
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_cam  # noqa: F401  registers "cam"
from torch_cam.weights import Shard, WeightChannel

VOCAB, DIM, HEADS, LAYERS, SEQ = 512, 128, 4, 2, 16
TRAINERS, REPLICAS = [0, 1], [[2], [3]]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def tp_dim(name: str, p: torch.Tensor):
    """Megatron's split of each weight: column-parallel (qkv, up, head, the embedding's vocab)
    on dim 0 with their biases, row-parallel (proj, down) weights on dim 1; the rest whole."""
    if any(k in name for k in ("qkv.", "up.", "head.", "emb.")):
        return 0
    if any(k in name for k in ("proj.weight", "down.weight")):
        return 1
    return None


def train_step(model, opt, data):
    """One SGD step of next-token prediction; every rank can take it on its copy of the model."""
    opt.zero_grad()
    loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss


def main():
    dist.init_process_group("cam")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4, "run with --nproc-per-node 4"
    torch.manual_seed(0)
    reference = Model()                           # every rank builds version 0 alike
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ch = WeightChannel(trainers=TRAINERS, replicas=REPLICAS)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, VOCAB, (4, SEQ), generator=g)

    if rank in TRAINERS:
        i = TRAINERS.index(rank)
        shards = {}
        for name, p in reference.named_parameters():
            d = tp_dim(name, p)
            mine = nn.Parameter(p.detach().chunk(2, d)[i].clone() if d is not None else p.detach().clone())
            ch.register(name, mine, Shard(d, i, 2) if d is not None else None, shape=p.shape)
            shards[name] = (mine, d)
        opt = torch.optim.SGD([p for p, _ in shards.values()], lr=0.5)
        for version in (1, 2, 3):
            data = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
            loss = train_step(reference, ref_opt, data)
            for name, p in reference.named_parameters():
                mine, d = shards[name]
                mine.grad = p.grad.chunk(2, d)[i].clone() if d is not None else p.grad.clone()
            opt.step()                            # the trainer's own update, in the heap
            t0 = time.perf_counter()
            ch.publish(version)
            if rank == 0:
                print(f"version {version}: loss {loss.item():.4f}, published in "
                      f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    else:
        engine = Model().to(torch.bfloat16).eval()    # the rollout's own weights, TP 1
        for name, p in engine.named_parameters():
            ch.register(name, p.data)
        for version in (1, 2, 3):
            data = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
            train_step(reference, ref_opt, data)  # the single-process model of this version
            t0 = time.perf_counter()
            ch.update(version)
            dt = time.perf_counter() - t0
            with torch.no_grad(), ch.reading():
                logits = engine(prompts)
                want = Model().to(torch.bfloat16)
                want.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
                expected = want.eval()(prompts)
            assert torch.equal(logits, expected), f"rank {rank}: logits differ at version {version}"
            nbytes = sum(p.nbytes for p in engine.parameters())
            print(f"rollout rank {rank}: version {version} in place ({nbytes / 2**20:.1f} MiB bf16) in "
                  f"{dt * 1e3:.1f} ms; logits equal the single-process model", flush=True)
    dist.barrier()
    if rank == 0:
        print("rl_weight_sync: 3 versions, 2 trainers (TP 2, fp32) -> 2 replicas (TP 1, bf16): OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
