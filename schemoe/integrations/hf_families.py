"""The Hugging Face MoE families schemoe converts, as data: how each family routes and where each
of its block's weights lives in the MoELayer that replaces it.

Legend: E experts, M model dim (HF's hidden size), I expert intermediate size.

Read from the modeling files of transformers 5.25 (one `FamilySpec` per family below):

    family       router                                            shared experts
    mixtral      softmax, top-k, renormalised; input jitter (train) -
    qwen2_moe    softmax, top-k, renormalised iff norm_topk_prob   1, sigmoid-gated
    qwen3_moe    softmax, top-k, renormalised iff norm_topk_prob   -
    qwen3_next   as qwen2_moe                                      1, sigmoid-gated
    minimax      as mixtral                                        -
    olmoe        as qwen3_moe                                      -
    flex_olmo    as qwen3_moe                                      -
    granitemoe   softmax of the top-k logits (= softmax, top-k,    -
                 renormalised)
    granitemoeshared  as granitemoe (its shared MLP is outside the block, left as it is)
    jamba        softmax, top-k, never renormalised                -
    deepseek_v2  softmax, top-k ("greedy", or "group_limited_greedy": n_shared_experts, ungated
                 groups scored by their best expert), never
                 renormalised, x routed_scaling_factor
    deepseek_v3  sigmoid; e_score_correction_bias for selection;   n_shared_experts, ungated
                 group-limited (n_group, topk_group; group score =
                 sum of its 2 best); renormalised iff norm_topk_prob;
                 x routed_scaling_factor
    glm4_moe     as deepseek_v3                                    n_shared_experts, ungated
    gpt_oss      logits + router bias, softmax of the top-k logits -
                 (= softmax, top-k, renormalised); experts with
                 biases and a clamped swiglu (hf_experts.GptOssExpert)
    llama4       top-k of the logits, weight sigmoid(logit), on    1, ungated
                 the expert's INPUT: expert(w x) (weights_on="input")

Every routed expert but GPT-OSS's is y = down (silu(gate x) * (up x)), weights fused as
gate_up_proj [E, 2I, M] (gate rows first) and down_proj [E, M, I] (Llama 4: transposed,
[E, M, 2I] and [E, I, M]); MoELayer's swiglu experts hold w1 = gate^T [E, M, I], w3 = up^T,
w2 = down^T [E, I, M] (`to_moe_experts` / `from_moe_experts`, exact inverses).

Weights after conversion (a converted block keeps the family's router and shared-expert modules
under their own names, their tensors tied to the MoELayer's): `FamilySpec.weights(block)` lists,
for each of the original block's parameters and buffers (names relative to the block), the
MoELayer tensor (relative to the converted block: "moe.<name>") that holds it, and whether it is
the same tensor ("tied", same layout), a layout conversion ("experts", through the functions
above, the family's `FamilySpec.experts` layout) or one module per expert ("per_expert", GPT-OSS:
row e of the HF tensor is `moe.experts.experts.{e}.<name>`, e local to the rank holding it).
That mapping is stable: it is what saving a converted model in the family's layout reads.

Refused, with the reason (`REFUSED`): PhiMoE, whose routing MoELayer does not compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

__all__ = [
    "FAMILIES",
    "REFUSED",
    "FamilySpec",
    "WeightLink",
    "family_of",
    "from_moe_experts",
    "to_moe_experts",
]

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"
MOE_EXPERTS = ("experts.w1_EMH", "experts.w3_EMH", "experts.w2_EHM")


EXPERT_LAYOUTS = ("fused", "fused_t", "gpt_oss")


def to_moe_experts(
    gate_up: torch.Tensor, down: torch.Tensor, layout: str = "fused"
) -> dict[str, torch.Tensor]:
    """A family's fused expert weights (or their gradients) as MoELayer's swiglu expert tensors
    (names relative to the MoELayer: experts.w1_EMH, experts.w3_EMH [E, M, I],
    experts.w2_EHM [E, I, M]). `layout` "fused": gate_up [E, 2I, M] (gate rows first),
    down [E, M, I] (Mixtral and most); "fused_t": gate_up [E, M, 2I] (gate columns first),
    down [E, I, M] (Llama 4)."""
    if layout == "fused_t":
        inter = down.shape[1]
        return {
            "experts.w1_EMH": gate_up[..., :inter].contiguous(),
            "experts.w3_EMH": gate_up[..., inter:].contiguous(),
            "experts.w2_EHM": down.contiguous(),
        }
    assert layout == "fused", f"layout {layout!r} has no MoELayer swiglu form"
    inter = down.shape[-1]
    return {
        "experts.w1_EMH": gate_up[:, :inter].transpose(1, 2).contiguous(),
        "experts.w3_EMH": gate_up[:, inter:].transpose(1, 2).contiguous(),
        "experts.w2_EHM": down.transpose(1, 2).contiguous(),
    }


def from_moe_experts(
    moe: Mapping[str, torch.Tensor], layout: str = "fused"
) -> dict[str, torch.Tensor]:
    """The inverse of `to_moe_experts`: {"experts.gate_up_proj", "experts.down_proj"} (names
    relative to the family's block, in `layout`) from MoELayer's experts.w1_EMH,
    experts.w3_EMH, experts.w2_EHM (all E experts: gather them first)."""
    w1, w3, w2 = (moe[n] for n in MOE_EXPERTS)
    if layout == "fused_t":
        return {GATE_UP: torch.cat([w1, w3], dim=2).contiguous(), DOWN: w2.contiguous()}
    assert layout == "fused", f"layout {layout!r} has no MoELayer swiglu form"
    gate_up = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=1).contiguous()
    return {GATE_UP: gate_up, DOWN: w2.transpose(1, 2).contiguous()}


@dataclass(frozen=True)
class WeightLink:
    """Where one of the original block's tensors lives in the converted block.

    Attributes:
        hf: its name relative to the original block (e.g. "gate.weight").
        moe: the MoELayer tensors that hold it, relative to the converted block
            (e.g. ("moe.gate_weight",) or the three expert tensors).
        kind: "tied" (the converted block keeps `hf` under the same name, and it IS the
            MoELayer tensor: same storage, same layout), "experts" (a layout conversion:
            `to_moe_experts` / `from_moe_experts` with the family's `experts` layout; MoELayer
            holds this rank's experts only) or "per_expert" (GPT-OSS: `moe` is a template with
            {e}, the local expert index: row first + e of the HF tensor, same layout, is that
            module's tensor on the rank holding expert first + e).
    """

    hf: str
    moe: tuple[str, ...]
    kind: str


# The shared MLP's linears, in the order of MoELayer's shared tensors w1 (gate), w3 (up), w2.
SHARED_LINEARS = (("gate_proj", "w1_HM"), ("up_proj", "w3_HM"), ("down_proj", "w2_MH"))


@dataclass(frozen=True)
class FamilySpec:
    """One family's MoE block as MoELayer computes it.

    Attributes:
        family: the transformers model type (e.g. "deepseek_v3").
        blocks: the block class names of this family.
        router: the block's attribute holding the router (its `.weight` is [E, M]).
        score: "softmax" or "sigmoid" (GateConfig.score).
        renormalize: True / False, or the router attribute that says (e.g. "norm_topk_prob").
        scale: the router attribute holding routed_scaling_factor, or None (1).
        groups: the router attributes (groups, kept groups) of group-limited routing, or None.
        correction_bias: the router buffer added to the scores for selection only, or None.
        shared: the block's attribute holding the shared-expert MLP, or None.
        shared_gate: the block's attribute holding its [M -> 1] sigmoid gate, or None.
        jitter: the block's attribute holding the training-time input jitter, or None.
        experts: the experts' layout, see `to_moe_experts` ("fused", "fused_t"), or "gpt_oss"
            (hf_experts.GptOssExpert modules, one per expert).
        logit_bias: the router attribute holding a bias added to its logits, or None.
        group_score: GateConfig.group_score ("top2", or "max").
        grouped_if: (router attribute, value): group-limited routing only when it has that
            value (DeepSeek-V2's topk_method); None: whenever `groups` is set.
        weights_on: GateConfig.weights_on ("output", or "input": Llama 4).
        returns_router: the block returns (hidden, router output [i]) rather than hidden:
            the index i into its router's outputs; None: hidden only.
    """

    family: str
    blocks: tuple[str, ...]
    router: str = "gate"
    score: str = "softmax"
    renormalize: bool | str = True
    scale: str | None = None
    groups: tuple[str, str] | None = None
    correction_bias: str | None = None
    shared: str | None = None
    shared_gate: str | None = None
    jitter: str | None = None
    experts: str = "fused"
    logit_bias: str | None = None
    group_score: str = "top2"
    grouped_if: tuple[str, str] | None = None
    weights_on: str = "output"
    returns_router: int | None = None

    def weights(self, block: nn.Module | None = None) -> tuple[WeightLink, ...]:
        """Every tensor of the original block and where the converted block holds it (see the
        module docstring). `block` (the original or the converted one) decides the optional
        parts; None lists all the family can have."""
        if self.experts == "gpt_oss":
            names = (GATE_UP, f"{GATE_UP}_bias", DOWN, f"{DOWN}_bias")
            tmpl = "moe.experts.experts.{e}."
            links = [WeightLink(n, (tmpl + n.split(".")[1],), "per_expert") for n in names]
        else:
            links = [
                WeightLink(GATE_UP, tuple(f"moe.{n}" for n in MOE_EXPERTS[:2]), "experts"),
                WeightLink(DOWN, (f"moe.{MOE_EXPERTS[2]}",), "experts"),
            ]
        links.append(WeightLink(f"{self.router}.weight", ("moe.gate_weight",), "tied"))
        if self.logit_bias is not None:
            links.append(WeightLink(f"{self.router}.{self.logit_bias}", ("moe.gate_bias",), "tied"))
        if self.correction_bias is not None:
            name = f"{self.router}.{self.correction_bias}"
            links.append(WeightLink(name, ("moe.expert_bias",), "tied"))
        if self.shared is not None and (block is None or getattr(block, self.shared, None)):
            for hf, ours in SHARED_LINEARS:
                links.append(
                    WeightLink(f"{self.shared}.{hf}.weight", (f"moe.shared.{ours}",), "tied")
                )
            if self.shared_gate is not None:
                links.append(
                    WeightLink(f"{self.shared_gate}.weight", ("moe.shared.gate_1M",), "tied")
                )
        return tuple(links)


_QWEN2_MOE = FamilySpec(
    family="qwen2_moe",
    blocks=("Qwen2MoeSparseMoeBlock",),
    renormalize="norm_topk_prob",
    shared="shared_expert",
    shared_gate="shared_expert_gate",
)
_DEEPSEEK_V3 = FamilySpec(
    family="deepseek_v3",
    blocks=("DeepseekV3MoE",),
    score="sigmoid",
    renormalize="norm_topk_prob",
    scale="routed_scaling_factor",
    groups=("num_group", "topk_group"),
    correction_bias="e_score_correction_bias",
    shared="shared_experts",
)


def _as(spec: FamilySpec, family: str, block: str) -> FamilySpec:
    """`spec`'s routing and weights under another family's name and block class."""
    return replace(spec, family=family, blocks=(block,))


def _qwen3(family: str, block: str) -> FamilySpec:
    """Softmax, top-k, renormalised iff the router's norm_topk_prob; no shared expert."""
    return FamilySpec(family=family, blocks=(block,), renormalize="norm_topk_prob")


FAMILIES: dict[str, FamilySpec] = {
    spec.family: spec
    for spec in (
        FamilySpec(family="mixtral", blocks=("MixtralSparseMoeBlock",), jitter="jitter_noise"),
        _QWEN2_MOE,
        _qwen3("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
        _qwen3("olmoe", "OlmoeSparseMoeBlock"),
        _qwen3("flex_olmo", "FlexOlmoSparseMoeBlock"),
        _as(_QWEN2_MOE, "qwen3_next", "Qwen3NextSparseMoeBlock"),
        FamilySpec(family="minimax", blocks=("MiniMaxSparseMoeBlock",), jitter="jitter_noise"),
        FamilySpec(family="granitemoe", blocks=("GraniteMoeMoE",), router="router"),
        FamilySpec(
            family="jamba", blocks=("JambaSparseMoeBlock",), router="router", renormalize=False
        ),
        # Its shared MLP sits in the decoder layer, outside the block: only the block changes.
        FamilySpec(family="granitemoeshared", blocks=("GraniteMoeSharedMoE",), router="router"),
        FamilySpec(
            family="deepseek_v2",
            blocks=("DeepseekV2Moe",),
            renormalize=False,
            scale="routed_scaling_factor",
            groups=("num_group", "topk_group"),
            group_score="max",
            grouped_if=("topk_method", "group_limited_greedy"),
            shared="shared_experts",
        ),
        FamilySpec(
            family="gpt_oss",
            blocks=("GptOssMLP",),
            router="router",
            experts="gpt_oss",
            logit_bias="bias",
            returns_router=1,
        ),
        FamilySpec(
            family="llama4",
            blocks=("Llama4TextMoe",),
            router="router",
            score="sigmoid",
            renormalize=False,
            experts="fused_t",
            weights_on="input",
            shared="shared_expert",
            returns_router=1,
        ),
        _DEEPSEEK_V3,
        _as(_DEEPSEEK_V3, "glm4_moe", "Glm4MoeMoE"),
    )
}

# Block class name -> (family, why MoELayer cannot compute it exactly).
REFUSED: dict[str, tuple[str, str]] = {
    "PhimoeSparseMoeBlock": (
        "phimoe",
        (
            "its sparsemixer router (each choice's weight a softmax over the logits within a "
            "relative threshold of that choice, Gumbel sampling and a Heun-method gradient in "
            "training) is not top-k of one score distribution, which is all MoELayer routes"
        ),
    ),
}


def family_of(block: nn.Module) -> FamilySpec | None:
    """The FamilySpec whose block class `block` is, or None."""
    name = type(block).__name__
    return next((s for s in FAMILIES.values() if name in s.blocks), None)
