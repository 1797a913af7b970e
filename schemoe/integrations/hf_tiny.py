"""Tiny random models of every converted Hugging Face MoE family, and the measurements that
compare a converted model with the unmodified one (tests/test_hf_families.py and
scripts/hf_families.py use them; nothing is downloaded). Needs `transformers`.

Legend: T tokens, E experts, k experts per token.

    model = tiny("deepseek_v3", std=0.5)     # 2 MoE layers, E 4..8, k 2, hidden 32
    compare("deepseek_v3", 0.5)             # {"logits": max|diff|, "grads": max|diff|, ...}
    train_steps("deepseek_v3", 0.5)         # 5 AdamW steps' losses (rank, world: 2 ranks)
    round_trip("deepseek_v3", 0.5, "out/")  # save_pretrained -> family from_pretrained: max|diff|

`std`: None keeps the family's own initialisation (transformers' _init_weights); a number draws
every weight of the MoE blocks (routers, experts, shared experts) from N(0, std), and the
selection biases (e_score_correction_bias) from N(0, std / 5), so the routing scores are
separated and the experts' outputs O(1).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn

from ..layer.parallel import average_expert_gradients, dense_parameters
from ..routing import route
from .hf import SUPPORTED, HFMoEBlock, replace_moe_blocks
from .hf_export import save_pretrained
from .hf_families import FAMILIES, to_moe_experts

__all__ = [
    "BASE",
    "REFUSED_TINY",
    "TINY",
    "bf16_routing_mismatch",
    "compare",
    "perturb",
    "round_trip",
    "same_greedy_tokens",
    "tiny",
    "train_steps",
]

VOCAB = 64
BASE = {  # every tiny model's config, before its family's overrides
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "output_router_logits": True,
}
_MLA = {  # DeepSeek's multi-head latent attention at the tiny size
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "head_dim": 8,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 0,
}
_QWEN = {"num_experts": 4, "moe_intermediate_size": 24}
# Jamba with attention and experts in every layer (its Mamba layers hold no MoE block)
_JAMBA = {"num_experts": 4, "expert_layer_period": 1, "attn_layer_period": 1}
_JAMBA |= {"expert_layer_offset": 0, "attn_layer_offset": 0}

# family -> (config class, model class, config overrides)
TINY: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        _QWEN | {"shared_expert_intermediate_size": 36},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        _QWEN | {"norm_topk_prob": True, "head_dim": 8},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4}),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", {"num_experts": 4}),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        _QWEN
        | {
            "shared_expert_intermediate_size": 36,
            "norm_topk_prob": True,
            "head_dim": 8,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", {"num_local_experts": 4, "head_dim": 8}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4}),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        {"num_local_experts": 4, "shared_intermediate_size": 36},
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        _MLA
        | {
            "n_routed_experts": 4,
            "moe_intermediate_size": 24,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.5,
            "topk_method": "group_limited_greedy",  # 2 groups of 2 experts, the best one kept
            "n_group": 2,
            "topk_group": 1,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        _MLA
        | {
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "moe_intermediate_size": 24,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
        },
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "n_routed_experts": 8,
            "n_group": 2,
            "topk_group": 1,
            "moe_intermediate_size": 24,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "routed_scaling_factor": 1.8,
            "head_dim": 8,
        },
    ),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "head_dim": 8}),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {"num_local_experts": 4, "head_dim": 8, "intermediate_size_mlp": 48},
    ),
    "jamba": ("JambaConfig", "JambaForCausalLM", _JAMBA),
}

# The refused families at the tiny size (the error is what is checked).
REFUSED_TINY: dict[str, tuple[str, str, dict]] = {
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_local_experts": 4}),
}


def tiny(family: str, std: float | None = None, seed: int = 0) -> nn.Module:
    """The tiny fp32 causal LM of `family` (TINY or REFUSED_TINY), in eval mode."""
    cfg_name, model_name, over = (TINY | REFUSED_TINY)[family]
    cfg = getattr(tf, cfg_name)(**(BASE | over))
    torch.manual_seed(seed)
    model = getattr(tf, model_name)(cfg).float().eval()
    if std is not None:
        with torch.no_grad():
            for m in (m for m in model.modules() if type(m).__name__ in SUPPORTED):
                for p in m.parameters():
                    p.normal_(0, std)
                for n, b in m.named_buffers():
                    if n.endswith("e_score_correction_bias"):
                        b.normal_(0, std / 5)
    return model


def _ids(rank: int, seq: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(11 + rank))


def _hf_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient of the unmodified model, the experts' in MoELayer's layout
    (under "<block>.moe.experts.w1_EMH" etc., where the converted model holds them)."""
    out, experts = {}, set()
    for name, m in model.named_modules():
        if type(m).__name__ not in SUPPORTED:
            continue
        layout = FAMILIES[SUPPORTED[type(m).__name__]].experts
        ex = m.experts
        experts |= {f"{name}.experts.{n}" for n, _ in ex.named_parameters()}
        if layout == "gpt_oss":  # per-expert modules: global expert e's rows
            for n, p in ex.named_parameters():
                for e in range(p.shape[0]):
                    out[f"{name}.moe.experts.experts.{e}.{n}"] = p.grad[e]
        else:
            moe = to_moe_experts(ex.gate_up_proj.grad, ex.down_proj.grad, layout)
            out |= {f"{name}.moe.{k}": g for k, g in moe.items()}
    for n, p in model.named_parameters():
        if n not in experts and p.grad is not None:
            out[n] = p.grad
    return out


def _expert_ref(ref: dict, name: str, block: HFMoEBlock) -> torch.Tensor:
    """The reference gradient of this rank's expert parameter `name` (module-relative)."""
    sl = block.moe.expert_slice()
    head, sep, tail = name.partition(".moe.experts.experts.")
    if not sep:
        return ref[name][sl]
    i, rest = tail.split(".", 1)  # local index -> global
    return ref[f"{head}{sep}{sl.start + int(i)}.{rest}"]


def compare(family: str, std: float | None, rank: int = 0, world: int = 1) -> dict[str, float]:
    """max|diff| of the logits, the loss and every parameter gradient, converted vs unmodified,
    fp32. With world > 1 (call on every rank of the default group), each rank feeds its own
    batch; the reference runs every rank's batch; dense gradients are summed over the ranks
    (as DDP would) and each rank's experts are compared with their slice."""
    orig = tiny(family, std)
    conv = copy.deepcopy(orig)
    replaced = replace_moe_blocks(conv)
    assert set(replaced.families.values()) == {family}, replaced.families
    ids = [_ids(r) for r in range(world)]
    outs = [orig(i, labels=i) for i in ids]
    sum(o.loss for o in outs).backward()
    mine = conv(ids[rank], labels=ids[rank])
    mine.loss.backward()
    ref = _hf_grads(orig)
    for name, m in conv.named_modules():  # tied tensors: also under their MoELayer names
        if isinstance(m, HFMoEBlock):
            for link in m.spec.weights(m):
                if link.kind == "tied" and f"{name}.{link.hf}" in ref:  # params only
                    ref[f"{name}.{link.moe[0]}"] = ref[f"{name}.{link.hf}"]
    grad = 0.0
    for n, p in conv.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if getattr(p, "schemoe_expert", False):
            want = _expert_ref(ref, n, conv.get_submodule(n.split(".moe.")[0]))
        else:
            if world > 1:
                g = g.clone()
                dist.all_reduce(g)
            want = ref[n]
        grad = max(grad, float((g - want).abs().max()))
    return {
        "logits": float((mine.logits - outs[rank].logits).detach().abs().max()),
        "loss": float((mine.loss - outs[rank].loss).detach().abs()),
        "grads": grad,
        "logit_scale": float(outs[rank].logits.detach().abs().max()),
        "blocks": len(replaced),
    }


def train_steps(
    family: str,
    std: float | None,
    rank: int = 0,
    world: int = 1,
    steps: int = 5,
    lr: float = 1e-2,
    parts: int = 2,
) -> list[float]:
    """The loss of each of `steps` AdamW steps (fp32), the same data on one process and on
    `world` ranks. Each step's batch is `parts` batches of 2 x 6 tokens, the same every step.

    world 1: the unmodified model; the step's loss is the mean of its `parts` batches' losses
    (each its own forward, as DDP's ranks: HF's load-balancing loss is per forward, so one
    forward over all of them would not be the same objective). world > 1 (call on every rank of
    the default group; parts == world): the converted model, experts sharded over the world
    (E / world per rank), rank r feeds batch r; dense gradients all-reduced and divided by the
    world (DDP's mean), expert gradients by average_expert_gradients; the loss reported is the
    mean over the ranks, the same on every rank.
    """
    if world > 1 and parts != world:
        raise ValueError(f"parts={parts} must equal world={world} on several ranks")
    model = tiny(family, std).train()
    if world > 1:
        replace_moe_blocks(model)  # the default group: expert-parallel over the world
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # The same batches every step: the model learns them and the loss falls, so the runs are
    # compared along a trajectory that moves (fresh random tokens would keep it near ln(VOCAB)).
    ids = torch.randint(3, VOCAB, (parts, 2, 6), generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        if world == 1:
            loss = sum(model(i, labels=i).loss for i in ids) / parts
            loss.backward()
            loss = loss.detach()
        else:
            loss = model(ids[rank], labels=ids[rank]).loss
            loss.backward()
            # Which dense weights got a gradient is the same on every rank (the model's
            # structure), so the flat all-reduce sizes agree; None stays None, as on one process.
            grads = [p.grad for p in dense_parameters(model) if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g)).div_(world)
            average_expert_gradients(model)  # the all-to-all summed the ranks: / world
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        opt.step()
        losses.append(float(loss))  # HOST SYNC (the loss, once a step)
    return losses


def perturb(model: nn.Module, rank: int, world: int) -> None:
    """Add 0.1 N(0, 1) to every weight, the same on every rank: an expert's change depends on
    its global index only, so the model is the same one however its experts are spread."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if getattr(p, "schemoe_expert", False):  # [E / world, ...]: this rank's slice
                noise = torch.randn((p.shape[0] * world, *p.shape[1:]), generator=g)
                p.add_(0.1 * noise[rank * p.shape[0] : (rank + 1) * p.shape[0]])
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def round_trip(family: str, std: float | None, path: str, rank: int = 0, world: int = 1) -> float:
    """max|diff| of the logits of the family's own class loaded (`from_pretrained`) from what
    `save_pretrained` wrote for the converted model, every weight of which has moved after
    conversion (as training moves them), against the converted model's. With
    world > 1 (every rank of the default group calls it, `path` shared), the experts are
    gathered from the ranks and each rank compares its own batch."""
    conv = tiny(family, std)
    replace_moe_blocks(conv)
    perturb(conv, rank, world)
    save_pretrained(conv, path)  # collective when the experts span ranks
    back = type(conv).from_pretrained(path)
    ids = _ids(rank)
    with torch.no_grad():
        want = conv(ids).logits  # collective when the experts span ranks
        got = back(ids).logits
    return float((got - want).abs().max())


def same_greedy_tokens(family: str, std: float | None, new: int = 6) -> bool:
    """Greedy generation from the converted model gives the unmodified model's tokens."""
    orig = tiny(family, std)
    conv = copy.deepcopy(orig)
    replace_moe_blocks(conv)
    ids = _ids(0, 4)
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    return bool(torch.equal(orig.generate(ids, **kw), conv.generate(ids, **kw)))


def bf16_routing_mismatch(family: str, std: float | None, batch: int = 16, seq: int = 64) -> float:
    """The share of (layer, token) pairs whose expert set differs between the family's own bf16
    router and MoELayer's (which routes in fp32), on the same bf16 input of each layer."""
    model = tiny(family, std).to(torch.bfloat16)
    replace_moe_blocks(model)
    differ, total = 0, 0

    def hook(block: HFMoEBlock, args, out) -> None:
        nonlocal differ, total
        x_TM = args[0]
        router = getattr(block, block.spec.router)
        out = router(x_TM.reshape(-1, x_TM.shape[-1]))
        k = block.moe.config.gate.top_k
        # Llama 4's router returns (scores, logits) and picks the top-k logits; the others
        # return (logits, weights, chosen experts).
        theirs = out[1].topk(k, dim=-1).indices if block.family == "llama4" else out[2]
        ours = route(
            x_TM.reshape(-1, x_TM.shape[-1]),
            block.moe.gate_weight,
            block.moe.config.gate,
            bias_E=getattr(router, block.spec.correction_bias or "", None),
            logit_bias_E=block.moe.gate_bias,
        ).expert_TK
        same = (theirs.sort(-1).values == ours.sort(-1).values).all(-1)
        differ += int((~same).sum())
        total += same.numel()

    for m in model.modules():
        if isinstance(m, HFMoEBlock):
            m.register_forward_pre_hook(lambda b, a: hook(b, a, None))
    with torch.no_grad():
        ids = torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(5))
        model(ids)
    return differ / max(total, 1)


assert set(TINY) == set(FAMILIES), "every converted family has a tiny model"
