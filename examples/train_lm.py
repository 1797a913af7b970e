"""MoELayer in your own model, expert x data parallel under torchrun (the whole recipe).

torchrun --nproc-per-node 4 examples/train_lm.py      # or: python examples/train_lm.py
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import schemoe as sm
from schemoe.layer.parallel import average_expert_gradients, clip_grad_norm_, init_expert_parallel


class TinyLM(nn.Module):
    def __init__(self, ep_group=None, vocab: int = 256, dim: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied with the output projection
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.moe = sm.MoELayer(
            sm.MoEConfig(  # experts split over the ranks of the expert-parallel group
                gate=sm.GateConfig(num_experts=experts, top_k=2, capacity_factor=1.25),
                experts=sm.ExpertConfig(model_dim=dim, hidden_dim=4 * dim),
                schedule=sm.ScheduleConfig(policy="schemoe", chunks=2),
            ),
            group=ep_group,
        )

    def forward(self, tokens):
        x = self.embed(tokens)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        y, aux = self.moe(self.ln2(x))
        return (x + y) @ self.embed.weight.t(), aux


def main() -> None:
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # per rank
    rank, world = (dist.get_rank(), dist.get_world_size()) if launched else (0, 1)
    cuda = torch.cuda.is_available()
    dev = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    # Every rank creates every group: EP groups of 2 ranks (or 1), DP groups across them.
    ep = init_expert_parallel(2 if world % 2 == 0 else 1)
    torch.manual_seed(0)  # identical dense weights everywhere; MoELayer seeds each expert itself
    core = TinyLM(ep.ep_group).to(dev)
    model = nn.parallel.DistributedDataParallel(sm.ddp_ignore_experts(core)) if world > 1 else core
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.frombuffer(bytearray(Path(__file__).read_bytes() * 20), dtype=torch.uint8)
    data, g = data.long().to(dev), torch.Generator().manual_seed(rank)  # own batches per rank
    for step in range(1, 61):
        idx = (torch.randint(0, len(data) - 33, (8, 1), generator=g) + torch.arange(33)).to(dev)
        logits, aux = model(data[idx[:, :-1]])
        loss = F.cross_entropy(logits.flatten(0, 1), data[idx[:, 1:]].flatten())
        opt.zero_grad()
        (loss + aux).backward()  # DDP averages the dense gradients over the world
        average_expert_gradients(core, ep)  # ... and this the expert ones, the same mean
        clip_grad_norm_(core, 1.0, ep)
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}  loss {loss.item():.3f}")
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
