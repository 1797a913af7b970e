"""Activation memory of a 4-block MoE model, forward and backward, with and without checkpointing.

    python scripts/recompute_memory.py [--world 1,2] [--tokens 2048] [--model-dim 512] ...

Each block is pre-norm causal self-attention then a MoELayer (every block an MoE block). Four
runs of one forward + backward per world size, from the same weights and tokens:
  plain    no checkpointing;
  schemoe  every block under schemoe.checkpoint_block (recomputes the block but keeps each MoE
           layer's all-to-all results: no all-to-all in the recomputation; the region's backward
           recomputes the experts' activations from the kept received rows);
  schemoe-keep  the same with recompute_experts=False (keeps the experts' activations too);
  torch    every block under torch.utils.checkpoint(use_reentrant=False) alone (recomputes
           everything, the region's all-to-alls and experts included), for comparison.

Measured per rank (bytes allocated through torch inside the step, parameters and inputs
excluded): `held_mb`, what is still allocated when the forward returns (the activations kept for
backward, the region's saved expert graphs, the output); `peak_mb`, the most allocated at once
during forward + backward (adds gradients and temporaries). On CPU a dispatch mode tracks every
storage an op creates until it is freed; with --device cuda, torch.cuda.memory_allocated and
max_memory_allocated (one GPU per rank). Also `a2a`, the all_to_all_single calls of the step, and
`grad_max_diff`, max |grad - plain grad| over the input and every parameter. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

import schemoe
from schemoe.dist.launch import spawn


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops created while active and that are still alive; and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def _free(self, key: int, n: int) -> None:
        self.live.pop(key, None)
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place or out= op) allocated nothing; this
        # also keeps storages made before the step (parameters, inputs) out of the count.
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live and key not in seen:
                    n = st.nbytes()
                    self.live[key] = weakref.ref(st, lambda _, k=key, n=n: self._free(k, n))
                    self.now += n
                    self.peak = max(self.peak, self.now)
        return out


class Block(nn.Module):
    def __init__(self, config: schemoe.MoEConfig, heads: int) -> None:
        super().__init__()
        M = config.experts.model_dim
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(M), nn.LayerNorm(M)
        self.qkv, self.proj = nn.Linear(M, 3 * M), nn.Linear(M, M)
        self.moe = schemoe.MoELayer(config, seed=7)

    def forward(self, x_BLM):
        B, L, M = x_BLM.shape
        q, k, v = self.qkv(self.ln1(x_BLM)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x_BLM + self.proj(a.transpose(1, 2).reshape(B, L, M))
        y, aux = self.moe(self.ln2(h))
        return h + y, aux


def _step(model, x, mode: str, device: torch.device) -> dict:
    calls = [0]
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    x = x.detach().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    tracker = LiveBytes()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    dist.all_to_all_single = counted
    try:
        with tracker if not cuda else contextlib.nullcontext():
            h, aux = x, 0
            for b in model:
                if mode == "plain":
                    h, a = b(h)
                elif mode.startswith("schemoe"):
                    h, a = schemoe.checkpoint_block(b, h, recompute_experts=mode == "schemoe")
                else:
                    h, a = checkpoint(b, h, use_reentrant=False)
                aux = aux + a
            held = torch.cuda.memory_allocated(device) - base if cuda else tracker.now
            (h.float().square().mean() + aux).backward()
            peak = torch.cuda.max_memory_allocated(device) - base if cuda else tracker.peak
    finally:
        dist.all_to_all_single = real
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return {"held_mb": held / 2**20, "peak_mb": peak / 2**20, "a2a": calls[0], "grads": grads}


def _rank(rank: int, world: int, a: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    device = torch.device(f"cuda:{rank}" if a.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shared = {"shared": schemoe.SharedExpertConfig(num=1, hidden_dim=a.hidden)} if a.shared else {}
    config = schemoe.MoEConfig(
        gate=schemoe.GateConfig(num_experts=a.experts, top_k=a.top_k, capacity_factor=a.capacity),
        experts=schemoe.ExpertConfig(model_dim=a.model_dim, hidden_dim=a.hidden),
        **shared,
    )
    model = nn.ModuleList(Block(config, a.heads) for _ in range(a.blocks)).to(device)
    torch.manual_seed(1 + rank)
    x = torch.randn(a.batch, a.tokens // a.batch, a.model_dim, device=device)
    rows, ref = [], None
    for mode in ("plain", "schemoe", "schemoe-keep", "torch"):
        r = _step(model, x, mode, device)
        grads = r.pop("grads")
        ref = grads if ref is None else ref
        diff = max((g - g0).abs().max().item() for g, g0 in zip(grads, ref))
        rows.append({"world": world, "rank": rank, "mode": mode, **r, "grad_max_diff": diff})
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", default="1,2", help="rank counts to run, comma-separated")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank (batch x length)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--model-dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity", type=float, default=1.25, help="0: dropless")
    p.add_argument("--shared", action="store_true", help="one shared expert per layer")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = p.parse_args(argv)
    rows = []
    for world in (int(w) for w in a.world.split(",")):
        backend = "nccl" if a.device == "cuda" else "gloo"
        for per_rank in spawn(_rank, world, a, timeout=600, threads=a.threads, backend=backend):
            for r in per_rank:
                r = {k: round(v, 2) if isinstance(v, float) and k != "grad_max_diff" else v
                     for k, v in r.items()}  # fmt: skip
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(json.dumps({"args": vars(a), "rows": rows}))


if __name__ == "__main__":
    main(sys.argv[1:])
