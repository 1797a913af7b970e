"""The stack runtime: stack policies give bitwise the sequential stack's results; the stack
matches the single-process reference (capacity per micro-chunk) and, dropless, m = 1; m = 1 is
bitwise the plain per-layer loop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_cases import close, global_weights, layer_config
from schemoe import (
    GateConfig,
    MoEConfig,
    MoELayer,
)
from schemoe.layer.reference import reference_moe
from schemoe.step.stack import MoEStack, Stage, run_stack
from schemoe.train.model import GPT, GPTConfig, _Attention

E, M, H, B, L = 8, 12, 20, 4, 5


def cfg(
    f: float, region: str = "schemoe", r: int = 2, aux: float = 0.01, algorithm: str = "naive"
) -> MoEConfig:
    return layer_config(
        region,
        algorithm,
        chunks=r,
        experts=E,
        capacity_factor=f,
        dims=(M, H),
        rpn=2,
        aux_loss_weight=aux,
    )


class Attn(nn.Module):
    """A pre stage as in schemoe.train.model: pre-norm attention with its residual, then the MoE norm."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(M), nn.LayerNorm(M), _Attention(M, 2)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x, self.ln2(x)


class Split(nn.Module):
    """A pre stage that hands x to the MoE and adds nothing: the stack's output is the MoE's."""

    def forward(self, x):
        return torch.zeros_like(x), x


def _stages(c: MoEConfig, blocks: int = 2) -> list[Stage]:
    torch.manual_seed(0)  # the same dense weights on every rank
    return [Stage(Attn(), MoELayer(c, seed=b)) for b in range(blocks)]


def _params(stages):
    return [p for s in stages for m in (s.pre, s.moe) for p in m.parameters()]


def _inputs(rank: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(B, L, M, generator=g), torch.randn(B, L, M, generator=g)


def _run(stages, m: int, policy: str, rank: int, plain: bool = False):
    x, gy = _inputs(rank)
    x.requires_grad_(True)
    for p in _params(stages):
        p.grad = None
    if plain:  # the per-layer loop every model ran before the stack
        out, aux = x, 0.0
        for s in stages:
            x_res, h = s.pre(out)
            y, a = s.moe(h)
            out, aux = x_res + y, aux + a
    else:
        out, aux = run_stack(stages, x, m, policy)
    ((out * gy).sum() + aux).backward()
    return out.detach(), aux.detach(), x.grad.clone(), [p.grad.clone() for p in _params(stages)]


def _bitwise(a, b, what):
    assert torch.equal(a[0], b[0]), f"output {what}"
    assert torch.equal(a[1], b[1]), f"aux {what}"
    assert torch.equal(a[2], b[2]), f"input grad {what}"
    for n, (u, v) in enumerate(zip(a[3], b[3])):
        assert torch.equal(u, v), f"grad {n} {what}"


def _policies_agree(rank, world, f, m, region, algorithm="naive"):
    stages = _stages(cfg(f, region, algorithm=algorithm))
    base = _run(stages, m, "sequential", rank)
    _bitwise(_run(stages, m, "wavefront", rank), base, f"wavefront {f=} {m=} {region}")
    if m == 1:
        _bitwise(_run(stages, 1, "sequential", rank, plain=True), base, "plain loop")
    return True


@pytest.mark.parametrize(
    "world,f,m,region,algorithm",
    [
        (2, 1.0, 2, "schemoe", "naive"),
        (2, 0.0, 4, "schemoe", "naive"),
        (2, 0.0, 1, "schemoe", "naive"),
        (2, 1.0, 1, "tutel", "naive"),
        (4, 1.0, 4, "sequential", "naive"),
        (4, 0.0, 2, "tutel", "naive"),
        (4, 1.0, 2, "schemoe", "pipe"),  # two links: intra and inter
    ],
)
def test_wavefront_gives_bitwise_the_sequential_stack_and_m1_the_plain_loop(
    ranks, world, f, m, region, algorithm
):
    assert all(ranks(world).run(_policies_agree, f, m, region, algorithm))


def _across_m(rank, world, m):
    # Dropless: the same tokens meet the same weights at any m, and the aux loss is the whole
    # batch's; only the order of floating-point sums differs (weight gradients summed over
    # micro-chunks, f and P of the balancing loss averaged, fewer rows per matmul). Each
    # element is a sum of O(B L) products of O(1) values, a few fp32 ulps (1.2e-7) each:
    # atol 2e-5 / rtol 2e-4 (moe_cases' bound) is ~10x headroom, and a wrong or dropped row,
    # or a per-micro-chunk balancing loss (~2e-3 relative here), would exceed it.
    stages = _stages(cfg(0.0, aux=0.5))
    one, got = _run(stages, 1, "sequential", rank), _run(stages, m, "wavefront", rank)
    close(got[0], one[0], f"output m={m}")
    close(got[1], one[1], f"aux m={m}")
    close(got[2], one[2], f"input grad m={m}")
    for n, (u, v) in enumerate(zip(got[3], one[3])):
        close(u, v, f"grad {n} m={m}")
    return True


@pytest.mark.parametrize("world,m", [(2, 2), (4, 4)])
def test_dropless_results_at_m_micro_chunks_match_one_within_rounding(ranks, world, m):
    assert all(ranks(world).run(_across_m, m))


def _reference(rank, world, f, m, policy):
    """One stage whose output is the MoE's: against reference_moe called once per micro-chunk
    on every rank's slice (capacity is per micro-chunk: each is a layer call of B L / m tokens)
    and once on the whole batch for the aux loss."""
    c = cfg(f, r=2)
    torch.manual_seed(0)
    moe = MoELayer(c, seed=3)
    w = global_weights(moe, seed=5)
    moe.load_global_state(w)
    stages = [Stage(Split(), moe)]
    out, aux, gx, grads = _run(stages, m, policy, rank)
    xs_gys = [_inputs(q) for q in range(world)]
    wr = {n: t.clone().requires_grad_(True) for n, t in w.items()}
    xr = [x.clone().requires_grad_(True) for x, _ in xs_gys]
    # The outputs: one reference call per micro-chunk; the aux loss: the whole batch's.
    _, raux = reference_moe([x.reshape(-1, M) for x in xr], wr, c)
    loss, ys = sum(raux), []
    for j in range(m):
        sl = slice(j * B // m, (j + 1) * B // m)
        y, _ = reference_moe([x[sl].reshape(-1, M) for x in xr], wr, c)
        loss = loss + sum((yy.view(-1, L, M) * g[sl]).sum() for yy, (_, g) in zip(y, xs_gys))
        ys.append(y[rank].view(-1, L, M))
    loss.backward()
    close(out, torch.cat(ys).detach(), "output")
    close(aux, raux[rank].detach(), "aux")
    close(gx, xr[rank].grad, "input grad")
    for (name, p), g in zip(moe.named_parameters(), grads):
        if getattr(p, "schemoe_expert", False):
            close(g, wr[name].grad[moe.expert_slice()], f"grad {name}")
        else:
            dist.all_reduce(g)
            close(g, wr[name].grad, f"grad {name}")
    return True


@pytest.mark.parametrize(
    "world,f,m,policy",
    [(2, 1.0, 2, "wavefront"), (2, 0.0, 2, "sequential"), (4, 1.0, 4, "wavefront")],
    ids=["capacity-w2-m2", "dropless-w2-m2", "capacity-w4-m4"],
)
def test_the_stack_matches_the_reference_called_once_per_micro_chunk(ranks, world, f, m, policy):
    assert all(ranks(world).run(_reference, f, m, policy))


def test_moestack_registers_its_stages_and_runs_without_grad():
    c = cfg(1.0)
    stack = MoEStack([(Attn(), MoELayer(c, seed=0), None)], micro_chunks=2)
    assert len(list(stack.parameters())) == len(list(stack.stages[0].pre.parameters())) + len(
        list(stack.stages[0].moe.parameters())
    )
    with torch.no_grad():
        out, aux = stack(torch.randn(B, L, M))
    assert out.shape == (B, L, M) and not out.requires_grad and aux.dim() == 0


def test_bad_stack_input_is_refused_with_the_value_named():
    stages = [Stage(Attn(), MoELayer(cfg(1.0), seed=0))]
    with pytest.raises(ValueError, match="batch 4 must be divisible by micro_chunks=3"):
        run_stack(stages, torch.randn(B, L, M), 3)
    with pytest.raises(ValueError, match="micro_chunks must be an int >= 1, got 0"):
        run_stack(stages, torch.randn(B, L, M), 0)
    with pytest.raises(ValueError, match="unknown stack policy .nope.; known: .*wavefront"):
        run_stack(stages, torch.randn(B, L, M), 2, "nope")
    with pytest.raises(TypeError, match="must be a MoELayer"):
        Stage(Attn(), nn.Linear(M, M))
    with pytest.raises(ValueError, match="at least one stage"):
        run_stack([], torch.randn(B, L, M), 1)


def test_a_second_backward_through_the_stack_needs_retain_graph_the_first_time():
    stages = _stages(cfg(1.0), blocks=1)
    x = torch.randn(B, L, M, requires_grad=True)
    out, aux = run_stack(stages, x, 2, "wavefront")
    loss = out.square().sum() + aux
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.allclose(x.grad, 2 * first, rtol=1e-5, atol=1e-6)
    out, aux = run_stack(stages, x, 2, "wavefront")
    (out.sum() + aux).backward()
    with pytest.raises(RuntimeError, match="retain_graph=True the first time"):
        (out.sum() + aux).backward()


def _gpt_step(m: int):
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(seq_len=L, layers=5, heads=2, micro_chunks=m), cfg(0.0))
    tokens = torch.randint(0, 256, (B, L), generator=torch.Generator().manual_seed(1))
    logits, aux = gpt(tokens)
    (logits.square().mean() + aux).backward()
    return gpt, logits.detach(), aux.detach(), [p.grad for p in gpt.parameters()]


def test_the_gpt_runs_its_blocks_as_a_stack_with_trailing_dense_blocks_and_matches_m1():
    # 5 layers, MoE every 2nd: stages (block 0 + block 1's attention), (block 2 + block 3's),
    # and block 4 (dense) in the last stage's post. Dropless: equal up to rounding (see above).
    plain, y1, a1, g1 = _gpt_step(1)
    stack, y2, a2, g2 = _gpt_step(2)
    assert plain._stages == [] and len(stack._stages) == 2 and stack._stages[-1].post is not None
    close(y2, y1, "logits")
    close(a2, a1, "aux")
    for n, (u, v) in enumerate(zip(g2, g1)):
        close(u, v, f"grad {n}")


def test_router_noise_is_drawn_per_micro_chunk_so_policies_stay_bitwise_equal():
    c = cfg(1.0)
    c = MoEConfig(
        gate=GateConfig(num_experts=E, top_k=2, capacity_factor=1.0, noise_std=1.0),
        experts=c.experts,
        parallel=c.parallel,
        schedule=c.schedule,
    )
    stages = _stages(c)
    runs = {}
    for policy in ("sequential", "wavefront", "sequential"):
        torch.manual_seed(7)
        runs.setdefault(policy, []).append(_run(stages, 2, policy, 0))
    _bitwise(runs["wavefront"][0], runs["sequential"][0], "with router noise")
    _bitwise(runs["sequential"][1], runs["sequential"][0], "repeated")
    torch.manual_seed(8)  # another draw: other noise, so the noise is really on
    assert not torch.equal(_run(stages, 2, "wavefront", 0)[0], runs["sequential"][0][0])
