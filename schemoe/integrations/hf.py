"""Hugging Face `transformers` drop-in: swap the sparse MoE blocks of Mixtral- and Qwen2-MoE-style
models for MoELayer (expert-parallel, scheduled), weights copied, same math.

    from transformers import MixtralConfig, MixtralForCausalLM
    model = MixtralForCausalLM(MixtralConfig(...))       # or from_pretrained(...)
    replace_moe_blocks(model, group=None)                # each rank keeps E / P experts
    model = DDP(ddp_ignore_experts(model))               # dense weights data-parallel

Legend: T tokens, M model dim (HF's hidden size), E experts, I expert intermediate size, k experts per token.

The math of the blocks in transformers 5.x (checked against 5.24), and how it maps:
- Router: logits = x W_g^T, probs = softmax(logits in fp32), top-k of probs; Mixtral always
  renormalises the k weights, Qwen2-MoE only with `norm_topk_prob`. MoELayer routes the same way
  (softmax, then top-k, then optional renormalisation, in fp32) -> GateConfig(renormalize=...).
  Every token is kept: capacity_factor=0 (dropless). No load-balancing loss inside MoELayer: the
  HF model computes its own from the router logits.
- Experts: gate_up_proj [E, 2I, M], down_proj [E, M, I]; y_e = down (silu(gate x) * (up x)):
  ExpertConfig(activation="swiglu") with w1 = gate^T [E, M, I], w3 = up^T, w2 = down^T [E, I, M].
- Qwen2-MoE's shared expert: y += sigmoid(x W_s^T) * shared_mlp(x). MoELayer runs it as its
  shared experts (SharedExpertConfig(num=1, hidden_dim=shared_expert_intermediate_size,
  gated=True)): the schedule's S task, under the dispatch all-to-alls (and its backward under the
  backward exchanges) instead of before the layer. Its weights are the original modules' (tied:
  gate_proj/up_proj/down_proj.weight and shared_expert_gate.weight are MoELayer's w1_HM, w3_HM,
  w2_MH and gate_1M), so the model's parameter names, checkpoints and optimizer see no change.
- Mixtral's router jitter (training only): x *= U(1 - j, 1 + j), applied first, as HF does.

In 5.x a block returns the hidden states only; the model collects router logits (for
`output_router_logits` and its aux loss) with forward hooks on its router class. The wrapper
therefore keeps the original router module, its weight tied to MoELayer's gate_weight, and calls
it once per forward: one extra [T, M] x [M, E] product, under 1% of the experts' 6kTMI FLOPs.
Older layouts (transformers 4.x: per-expert nn.Linear modules, blocks returning
(hidden, router_logits)) are refused with a TypeError rather than guessed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ExpertConfig, GateConfig, MoEConfig, SharedExpertConfig
from ..layer.moe import MoELayer

if TYPE_CHECKING:  # the optional parts of the config, left to MoEConfig's defaults when None
    from ..config import CollectiveConfig, CompressionConfig, ParallelConfig, ScheduleConfig

__all__ = ["SUPPORTED", "HFMoEBlock", "from_hf_block", "replace_moe_blocks", "to_schemoe_experts"]

# block class name -> whether its router always renormalises the top-k weights
SUPPORTED = {"MixtralSparseMoeBlock": True, "Qwen2MoeSparseMoeBlock": None}


def to_schemoe_experts(gate_up_EID: torch.Tensor, down_EDI: torch.Tensor) -> dict:
    """HF fused expert weights (or their gradients) as BatchedFFN(swiglu) tensors."""
    inter = down_EDI.shape[-1]
    return {
        "experts.w1_EMH": gate_up_EID[:, :inter].transpose(1, 2).contiguous(),
        "experts.w3_EMH": gate_up_EID[:, inter:].transpose(1, 2).contiguous(),
        "experts.w2_EHM": down_EDI.transpose(1, 2).contiguous(),
    }


class HFMoEBlock(nn.Module):
    """A sparse MoE block of an HF model, computed by MoELayer. forward(x [B, L, M]) -> [B, L, M].

    Args:
        moe: the MoELayer (dropless, swiglu, gate_weight tied to `router.weight`).
        router: the model's original router module (called for the router-logit hooks).
        jitter: Mixtral's router_jitter_noise.
        shared, shared_gate: Qwen2-MoE's shared expert MLP and its [M -> 1] gate, or None;
            kept for their parameter names only: `moe` computes them (its shared experts, tied
            to these weights).
    """

    def __init__(
        self,
        moe: MoELayer,
        router: nn.Module,
        *,
        jitter: float = 0.0,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.moe, self.gate, self.jitter = moe, router, jitter
        self.shared_expert, self.shared_expert_gate = shared, shared_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, L, M = hidden_states.shape
        x = hidden_states
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        x_TM = x.reshape(-1, M)
        self.gate(x_TM)  # only for the model's router-logit hooks (output_router_logits)
        # aux is 0: the HF model adds its own balancing loss. The shared expert, if any, runs
        # inside: its output is in y_TM.
        y_TM, _ = self.moe(x_TM)
        return y_TM.view(B, L, M)


def _check_layout(block: nn.Module) -> None:
    name = type(block).__name__
    if name not in SUPPORTED:
        raise TypeError(f"unsupported MoE block {name}; expected one of {sorted(SUPPORTED)}")
    ex = getattr(block, "experts", None)
    if not (
        isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(block.gate, "weight", None), torch.Tensor)
    ):
        raise TypeError(
            f"{name} has not the transformers 5.x layout (experts.gate_up_proj, "
            "gate.weight); this transformers version is not supported"
        )
    act = type(ex.act_fn).__name__.lower()
    if "silu" not in act and "swish" not in act:
        raise ValueError(
            f"{name} uses activation {type(ex.act_fn).__name__}; MoELayer's swiglu "
            "experts need silu (hidden_act='silu')"
        )


def _shared_config(block: nn.Module) -> SharedExpertConfig | None:
    """Qwen2-MoE's shared expert (an MLP and a [M -> 1] sigmoid gate) as MoELayer's, or None."""
    sh = getattr(block, "shared_expert", None)
    if sh is None:
        return None
    gate = getattr(block, "shared_expert_gate", None)
    linears = ("gate_proj", "up_proj", "down_proj")
    if gate is None or any(getattr(getattr(sh, n, None), "bias", 0) is not None for n in linears):
        raise TypeError(
            f"{type(block).__name__}'s shared expert is not Qwen2-MoE's (gate_proj, up_proj, "
            "down_proj without bias, and shared_expert_gate); this layout is not supported"
        )
    act = type(getattr(sh, "act_fn", None)).__name__.lower()
    if "silu" not in act and "swish" not in act:
        raise ValueError(f"the shared expert uses activation {act}; MoELayer's needs silu")
    return SharedExpertConfig(num=1, hidden_dim=sh.gate_proj.weight.shape[0], gated=True)


def from_hf_block(
    block: nn.Module,
    *,
    group=None,
    parallel: ParallelConfig | None = None,
    schedule: ScheduleConfig | None = None,
    collective: CollectiveConfig | None = None,
    compression: CompressionConfig | None = None,
) -> HFMoEBlock:
    """The HFMoEBlock equivalent to `block` (a Mixtral/Qwen2-MoE sparse block), weights copied;
    this rank keeps the experts of its slice of `group` (None: the default group)."""
    _check_layout(block)
    gate, ex = block.gate, block.experts
    E, M = gate.weight.shape
    renorm = SUPPORTED[type(block).__name__]
    if renorm is None:
        renorm = bool(gate.norm_topk_prob)
    # The parts not given stay MoEConfig's defaults (stated once, there).
    given = {
        "parallel": parallel,
        "schedule": schedule,
        "collective": collective,
        "compression": compression,
    }
    cfg = MoEConfig(
        gate=GateConfig(
            num_experts=E,
            top_k=gate.top_k,
            capacity_factor=0.0,
            renormalize=renorm,
            aux_loss_weight=0.0,
        ),
        experts=ExpertConfig(model_dim=M, hidden_dim=ex.down_proj.shape[-1], activation="swiglu"),
        shared=_shared_config(block),
        **{part: value for part, value in given.items() if value is not None},
    )
    w = gate.weight
    moe = MoELayer(cfg, group=group).to(device=w.device, dtype=w.dtype)
    moe.load_global_state(to_schemoe_experts(ex.gate_up_proj.detach(), ex.down_proj.detach()))
    moe.gate_weight = gate.weight  # tied: one router weight, gradients from both uses
    if cfg.shared is not None:  # tied too: MoELayer computes them, the HF names hold them
        sh = block.shared_expert
        moe.shared.w1_HM, moe.shared.w3_HM = sh.gate_proj.weight, sh.up_proj.weight
        moe.shared.w2_MH, moe.shared.gate_1M = sh.down_proj.weight, block.shared_expert_gate.weight
    return HFMoEBlock(
        moe,
        gate,
        jitter=float(getattr(block, "jitter_noise", 0.0) or 0.0),
        shared=getattr(block, "shared_expert", None),
        shared_gate=getattr(block, "shared_expert_gate", None),
    )


def replace_moe_blocks(model: nn.Module, **kw) -> list[str]:
    """Replace every supported sparse MoE block in `model` in place (keyword arguments go to
    `from_hf_block`); returns the names of the replaced modules. Collective when `group` has
    more than one rank (every rank must call it)."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in SUPPORTED]
    for name, block in found:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, from_hf_block(block, **kw))
    return [n for n, _ in found]
