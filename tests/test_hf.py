"""Hugging Face drop-in: Mixtral and Qwen2-MoE sparse blocks replaced by MoELayer give the same
outputs and gradients, alone and inside the whole model, on one rank and expert-parallel on two.

Tolerance (fp32): both sides compute the same products in a different order (one bmm per expert
group vs one linear per expert, index_add vs a weighted gather, expert-weight gradients summed over
tokens and ranks in another order). For O(1) values that moves results by a few ulps (1.2e-7)
times sqrt(terms) ~ 1e-6; atol 2e-5 / rtol 2e-4 leaves ~10x headroom, while a wrong routing
choice, weight layout or dropped token shows up as an O(1e-2..1) error.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_cases import close
from schemoe.integrations.hf import from_hf_block, replace_moe_blocks, to_schemoe_experts
from schemoe.integrations.hf_tiny import BASE

transformers = pytest.importorskip("transformers")

SEQ = 6


# The tiny model both families are built at (each adds its own name for the expert count).
TINY = BASE | {"router_aux_loss_coef": 0.02}


def mixtral():
    cfg = transformers.MixtralConfig(**TINY, num_local_experts=4)
    return _seeded(transformers.MixtralForCausalLM, cfg)


def qwen(norm: bool):
    cfg = transformers.Qwen2MoeConfig(
        **TINY,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=36,
        num_experts=4,
        norm_topk_prob=norm,
    )
    return _seeded(transformers.Qwen2MoeForCausalLM, cfg)


def _seeded(cls, cfg):
    torch.manual_seed(0)
    model = cls(cfg).float()
    with torch.no_grad():  # separated routing scores (ties are not tested), O(1) experts
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight") or "expert" in n:  # routed and shared
                p.normal_(0, 0.5)
    return model


MODELS = {
    "mixtral": mixtral,
    "qwen2-moe": lambda: qwen(False),
    "qwen2-moe-norm": lambda: qwen(True),
}


def _expert_grads(block) -> dict[str, torch.Tensor]:
    return to_schemoe_experts(block.experts.gate_up_proj.grad, block.experts.down_proj.grad)


def _check_block(name: str, rank: int, world: int) -> None:
    """Each rank feeds its own tokens; the reference block sees every rank's tokens."""
    block = MODELS[name]().model.layers[0].mlp
    ref = copy.deepcopy(block)
    new = from_hf_block(block)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, SEQ + r, 32, generator=g) for r in range(world)]
    gys = [torch.randn_like(x) for x in xs]
    rx = [x.clone().requires_grad_(True) for x in xs]
    ry = [ref(x) for x in rx]
    sum((y * gy).sum() for y, gy in zip(ry, gys)).backward()
    x = xs[rank].clone().requires_grad_(True)
    y = new(x)
    (y * gys[rank]).sum().backward()
    tag = f"{name} rank {rank}/{world}"
    close(y.detach(), ry[rank].detach(), f"output {tag}")
    close(x.grad, rx[rank].grad, f"input grad {tag}")
    sl = new.moe.expert_slice()
    for k, gref in _expert_grads(ref).items():
        close(new.moe.get_parameter(k).grad, gref[sl], f"{k} grad {tag}")
    dense = ["gate.weight"]
    if getattr(ref, "shared_expert", None) is not None:
        dense += [f"shared_expert.{n}" for n, _ in ref.shared_expert.named_parameters()]
        dense += ["shared_expert_gate.weight"]
    for n in dense:
        gr = new.get_parameter(n).grad.clone()
        if world > 1:
            dist.all_reduce(gr)  # dense weights: what DDP's all-reduce sums
        close(gr, ref.get_parameter(n).grad, f"{n} grad {tag}")


def _check_model(name: str, rank: int, world: int) -> None:
    orig = MODELS[name]()
    conv = copy.deepcopy(orig)
    assert len(replace_moe_blocks(conv)) == 2
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(11 + rank))
    a = orig(ids, labels=ids)
    b = conv(ids, labels=ids)
    tag = f"{name} model rank {rank}/{world}"
    assert len(b.router_logits) == 2  # the hooks on the kept router module still collect them
    close(b.logits, a.logits, f"logits {tag}")
    close(b.aux_loss, a.aux_loss, f"aux loss {tag}")
    close(b.loss, a.loss, f"loss {tag}")
    if world > 1:
        return  # gradients on two ranks: checked block by block above
    a.loss.backward()
    b.loss.backward()
    for n, p in orig.named_parameters():
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        close(conv.get_parameter(n).grad, p.grad, f"grad {n} {tag}")
    for i, layer in enumerate(orig.model.layers):
        for k, gref in _expert_grads(layer.mlp).items():
            close(conv.model.layers[i].mlp.moe.get_parameter(k).grad, gref, f"layer {i} {k}")


def _everything(rank: int, world: int) -> bool:
    for name in MODELS:
        _check_block(name, rank, world)
        _check_model(name, rank, world)
    return True


def test_replaced_blocks_match_mixtral_and_qwen2_moe_outputs_and_gradients_on_one_rank():
    _everything(0, 1)


def test_replaced_blocks_match_hf_expert_parallel_on_two_ranks(ranks):
    assert ranks(2).run(_everything) == [True, True]


def test_unsupported_blocks_and_activations_are_refused_by_name():
    with pytest.raises(TypeError, match="unsupported MoE block Linear"):
        from_hf_block(torch.nn.Linear(2, 2))
    block = mixtral().model.layers[0].mlp
    block.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="need silu"):
        from_hf_block(block)


def test_mixtral_router_jitter_draws_the_same_noise_as_hf_in_training():
    block = mixtral().model.layers[0].mlp
    block.jitter_noise = 0.2
    ref = copy.deepcopy(block)
    new = from_hf_block(block)
    x = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(3)
    want = ref(x.clone())  # HF scales its input in place
    torch.manual_seed(3)
    close(new(x), want, "jittered output")
    new.eval()
    ref.eval()
    close(new(x), ref(x.clone()), "no jitter in eval")
