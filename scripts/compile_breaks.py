"""Graph breaks of a MoELayer under torch.compile, and the eager / compiled step-time ratio.

    python scripts/compile_breaks.py [--backend inductor] [--tokens 512] [--model-dim 256]
                                     [--hidden-dim 1024] [--repeats 20]

One process. For capacity mode (f = 1.25) and dropless mode (f = 0), the README's layer (E=8,
k=2, policy schemoe, r=2): `torch._dynamo.explain` of one layer call (the breaks in the layer's
own frame, with their reasons) and of a two-block model (a break inside a nested call counts once
per Python frame on the stack under dynamo's default configuration); then one training step
(forward, backward) of that model, eager and compiled, timed alternately `--repeats` times after
warm-up: the ratio is the median eager step over the median compiled step (> 1: compiled is
faster). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig

MODES = {"capacity": 1.25, "dropless": 0.0}


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(cfg.experts.model_dim), MoELayer(cfg)

    def forward(self, x):
        y, aux = self.moe(self.norm(x))
        return x + y, aux


class Model(nn.Module):
    def __init__(self, cfg: MoEConfig, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(blocks))

    def forward(self, x):
        total = 0
        for block in self.blocks:
            x, aux = block(x)
            total = total + aux
        return x.square().mean() + total


def _explain(fn, x) -> dict:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(x)
    reasons = [" ".join(s.strip() for s in r.reason.splitlines()[:2]) for r in ex.break_reasons]
    return {"breaks": ex.graph_break_count, "graphs": ex.graph_count, "reasons": reasons}


def _step(model, x) -> float:
    t0 = time.perf_counter()
    model(x).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def measure(mode: str, a: argparse.Namespace) -> dict:
    cfg = MoEConfig(
        gate=GateConfig(num_experts=8, top_k=2, capacity_factor=MODES[mode]),
        experts=ExpertConfig(model_dim=a.model_dim, hidden_dim=a.hidden_dim),
        schedule=ScheduleConfig(policy="schemoe", chunks=2),
    )
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.model_dim)
    eager = Model(cfg, a.blocks)
    layer = _explain(eager.blocks[0].moe, x)
    model = _explain(eager, x)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(eager), backend=a.backend)
    for _ in range(a.warmup):
        _step(eager, x), _step(compiled, x)
    t_eager, t_compiled = [], []
    for _ in range(a.repeats):  # interleaved, so drift in machine load hits both alike
        t_eager.append(_step(eager, x))
        t_compiled.append(_step(compiled, x))
    me, mc = statistics.median(t_eager), statistics.median(t_compiled)
    return {
        "mode": mode,
        "layer_breaks": layer["breaks"],
        "layer_reasons": layer["reasons"],
        "model_breaks": model["breaks"],
        "model_graphs": model["graphs"],
        "eager_ms": round(me * 1e3, 3),
        "compiled_ms": round(mc * 1e3, 3),
        "eager_over_compiled": round(me / mc, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--model-dim", type=int, default=256)
    p.add_argument("--hidden-dim", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    rows = []
    for mode in MODES:
        r = measure(mode, a)
        rows.append(r)
        print(
            f"{mode}: {r['layer_breaks']} break(s) per layer call, {r['model_breaks']} in the "
            f"{a.blocks}-block model ({r['model_graphs']} graphs); step eager {r['eager_ms']} ms, "
            f"compiled {r['compiled_ms']} ms, eager/compiled {r['eager_over_compiled']}"
        )
        for reason in r["layer_reasons"]:
            print(f"  break: {reason}")
    summary = {
        "backend": a.backend,
        "tokens": a.tokens,
        "model_dim": a.model_dim,
        "hidden_dim": a.hidden_dim,
        "blocks": a.blocks,
        "repeats": a.repeats,
        "torch": torch.__version__,
        "modes": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
