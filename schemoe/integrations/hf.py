"""Hugging Face `transformers` drop-in: swap the sparse MoE blocks of a model for MoELayer
(expert-parallel, scheduled), weights copied, same math.

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM(DeepseekV3Config(...))   # or from_pretrained(...)
    report = replace_moe_blocks(model, group=None)         # each rank keeps E / P experts
    model = DDP(ddp_ignore_experts(model))                 # dense weights data-parallel

Legend: T tokens, M model dim (HF's hidden size), E experts, I expert intermediate size.

Which families convert, how each routes and where each weight goes: `hf_families` (one
`FamilySpec` per family, read from the modeling files of transformers 5.25). What they share:
- Router: MoELayer's GateConfig reproduces the family's (softmax or sigmoid scores in fp32,
  selection bias, group-limited top-k, renormalisation, routed scale). Every token is kept:
  capacity_factor=0 (dropless). No load-balancing loss inside MoELayer: the HF model computes its
  own from the router logits. The one difference: transformers takes the logits in the model's
  dtype for some families (Mixtral, Qwen, OLMoE, Granite), MoELayer always in fp32; identical in
  fp32, a few routing choices differ in bf16 (docs/training.md, "Hugging Face").
- Experts: swiglu, the fused gate_up_proj / down_proj converted to MoELayer's w1/w3/w2.
- Shared experts (Qwen2-MoE's gated one, DeepSeek / GLM's ungated ones): MoELayer's shared
  experts (the schedule's S task, under the dispatch all-to-alls), tied to the family's own
  modules, which the converted block keeps under their names (as it keeps the router, whose
  weight is MoELayer's gate_weight, and its e_score_correction_bias, MoELayer's selection bias):
  parameter names, checkpoints of those tensors and the optimizer see no change.
- Router-logit hooks: in 5.x the model collects router logits (for `output_router_logits` and
  its aux loss) with forward hooks on its router class, so the converted block calls the kept
  router once per forward: one extra [T, M] x [M, E] product, under 1% of the experts' FLOPs.
- Mixtral's router jitter (training only): x *= U(1 - j, 1 + j), applied first, as HF does.

Older layouts (transformers 4.x: per-expert nn.Linear modules) are refused with a TypeError,
families MoELayer cannot compute exactly (`hf_families.REFUSED`) with a ValueError saying why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ExpertConfig, GateConfig, MoEConfig, SharedExpertConfig
from ..layer.moe import MoELayer
from .hf_experts import GptOssExpert
from .hf_families import FAMILIES, REFUSED, FamilySpec, family_of, to_moe_experts

if TYPE_CHECKING:  # the optional parts of the config, left to MoEConfig's defaults when None
    from ..config import CollectiveConfig, CompressionConfig, ParallelConfig, ScheduleConfig

__all__ = [
    "SUPPORTED",
    "HFMoEBlock",
    "Replaced",
    "from_hf_block",
    "replace_moe_blocks",
    "to_schemoe_experts",
]

# block class name -> family (see hf_families.FAMILIES)
SUPPORTED = {b: s.family for s in FAMILIES.values() for b in s.blocks}

# The attribute names of HFMoEBlock built directly (no spec): Mixtral's / Qwen2-MoE's.
_DEFAULT = FamilySpec(
    family="custom", blocks=(), shared="shared_expert", shared_gate="shared_expert_gate"
)


def to_schemoe_experts(gate_up_EID: torch.Tensor, down_EDI: torch.Tensor) -> dict:
    """HF fused expert weights (or their gradients) as MoELayer's swiglu expert tensors, named
    relative to the MoELayer's parent ("experts.w1_EMH" is the MoELayer's own name)."""
    return to_moe_experts(gate_up_EID, down_EDI)


class HFMoEBlock(nn.Module):
    """A sparse MoE block of an HF model, computed by MoELayer. forward(x [B, L, M]) -> [B, L, M].

    Args:
        moe: the MoELayer (dropless, swiglu, gate_weight tied to `router.weight`).
        router: the model's original router module (called for the router-logit hooks; its
            e_score_correction_bias, if the family has one, is MoELayer's selection bias).
        jitter: the training-time input jitter (Mixtral's router_jitter_noise).
        shared, shared_gate: the family's shared-expert MLP and its [M -> 1] gate, or None;
            kept for their parameter names only: `moe` computes them (tied weights).
        spec: the family (its attribute names); None: Mixtral's / Qwen2-MoE's names.
    """

    def __init__(
        self,
        moe: MoELayer,
        router: nn.Module,
        *,
        jitter: float = 0.0,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
        spec: FamilySpec | None = None,
    ) -> None:
        super().__init__()
        self.spec, self.jitter = spec or _DEFAULT, jitter
        # The family's modules first: named_parameters() lists a tied tensor under its first
        # name, so the router and shared experts keep their HF names there (and in optimizers).
        setattr(self, self.spec.router, router)
        if shared is not None:
            setattr(self, self.spec.shared, shared)
        if shared_gate is not None:
            setattr(self, self.spec.shared_gate, shared_gate)
        self.moe = moe

    @property
    def family(self) -> str:
        return self.spec.family

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """[B, L, M] -> [B, L, M]; for a family whose block returns (hidden, router output)
        (GPT-OSS, Llama 4), that pair, the router output from the kept router."""
        B, L, M = hidden_states.shape
        x = hidden_states
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        x_TM = x.reshape(-1, M)
        router = getattr(self, self.spec.router)
        routed = router(x_TM)  # for the model's router-logit hooks (output_router_logits)
        if self.spec.correction_bias is not None:
            # The router's buffer, looked up per call: .to() and load_state_dict replace it.
            # as_subclass: a plain-tensor alias (same storage) of the family's nn.Buffer, which
            # torch would otherwise try to register as a second buffer of `moe`.
            bias = getattr(router, self.spec.correction_bias)
            self.moe.expert_bias = bias.as_subclass(torch.Tensor)
        # aux is 0: the HF model adds its own balancing loss. The shared experts, if any, run
        # inside: their output is in y_TM.
        y_TM, _ = self.moe(x_TM)
        if self.spec.returns_router is not None:
            return y_TM.view(B, L, M), routed[self.spec.returns_router]
        return y_TM.view(B, L, M)

    def extra_repr(self) -> str:
        return f"family={self.spec.family}"


def _act(module: nn.Module | None) -> nn.Module | None:
    """A module's activation (act_fn, or Llama 4's activation_fn)."""
    return getattr(module, "act_fn", getattr(module, "activation_fn", None))


def _silu(module: nn.Module | None) -> bool:
    name = type(module).__name__.lower()
    return "silu" in name or "swish" in name


def _spec(block: nn.Module) -> FamilySpec:
    """The block's family, or the error that says why it does not convert."""
    name = type(block).__name__
    if name in REFUSED:
        family, why = REFUSED[name]
        raise ValueError(f"{name} ({family}) cannot be converted exactly: {why}")
    spec = family_of(block)
    if spec is None:
        raise TypeError(
            f"unsupported MoE block {name}: schemoe converts only the blocks whose routing it "
            f"reproduces exactly, checked against transformers (FAMILIES): {sorted(SUPPORTED)}; "
            "for another family, build its MoELayer with a GateConfig of its routing"
        )
    ex, router = getattr(block, "experts", None), getattr(block, spec.router, None)
    if not (
        isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(ex, "down_proj", None), torch.Tensor)
        and isinstance(getattr(router, "weight", None), torch.Tensor)
    ):
        raise TypeError(
            f"{name} has not the transformers 5.x layout (experts.gate_up_proj, "
            f"{spec.router}.weight); this transformers version is not supported"
        )
    if spec.experts != "gpt_oss" and not _silu(_act(ex)):
        raise ValueError(
            f"{name} uses activation {type(_act(ex)).__name__}; MoELayer's swiglu experts "
            "need silu (hidden_act='silu')"
        )
    if spec.grouped_if is not None:  # DeepSeek-V2: "greedy" or "group_limited_greedy"
        attr, grouped = spec.grouped_if
        method = getattr(router, attr)
        if method not in ("greedy", grouped):
            raise ValueError(
                f"{name} routes with {attr}={method!r}; MoELayer computes "
                f"'greedy' and {grouped!r} only"
            )
    return spec


def _gate_config(spec: FamilySpec, block: nn.Module) -> GateConfig:
    router = getattr(block, spec.router)
    renorm = spec.renormalize
    if isinstance(renorm, str):
        renorm = bool(getattr(router, renorm))
    groups, top_groups = 1, None
    grouped = spec.grouped_if is None or getattr(router, spec.grouped_if[0]) == spec.grouped_if[1]
    if spec.groups is not None and grouped:
        g, t = (getattr(router, a) for a in spec.groups)
        groups, top_groups = int(g or 1), int(t or g or 1)
    return GateConfig(
        num_experts=router.weight.shape[0],
        top_k=int(router.top_k),
        capacity_factor=0.0,
        renormalize=renorm,
        aux_loss_weight=0.0,
        score=spec.score,
        groups=groups,
        top_groups=top_groups,
        scale=float(getattr(router, spec.scale)) if spec.scale else 1.0,
        group_score=spec.group_score,
        logit_bias=spec.logit_bias is not None,
        weights_on=spec.weights_on,
    )


def _shared_config(spec: FamilySpec, block: nn.Module) -> SharedExpertConfig | None:
    """The family's shared experts (one MLP, its [M -> 1] sigmoid gate if any) as MoELayer's."""
    sh = getattr(block, spec.shared, None) if spec.shared else None
    if sh is None:
        return None
    gated = spec.shared_gate is not None
    linears = [getattr(sh, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    gate = getattr(block, spec.shared_gate, None) if gated else None
    if any(getattr(lin, "bias", 0) is not None for lin in linears + ([gate] if gated else [])):
        raise TypeError(
            f"{type(block).__name__}'s shared expert is not gate_proj, up_proj, down_proj "
            f"without bias{' and a ' + spec.shared_gate if gated else ''}; this layout is not "
            "supported"
        )
    if not _silu(_act(sh)):
        act = type(_act(sh)).__name__
        raise ValueError(f"the shared expert uses activation {act}; MoELayer's needs silu")
    return SharedExpertConfig(num=1, hidden_dim=sh.gate_proj.weight.shape[0], gated=gated)


def from_hf_block(
    block: nn.Module,
    *,
    group=None,
    parallel: ParallelConfig | None = None,
    schedule: ScheduleConfig | None = None,
    collective: CollectiveConfig | None = None,
    compression: CompressionConfig | None = None,
) -> HFMoEBlock:
    """The HFMoEBlock equivalent to `block` (a sparse MoE block of a family in
    `hf_families.FAMILIES`), weights copied (experts) or tied (router, shared experts); this
    rank keeps the experts of its slice of `group` (None: the default group).

    Raises:
        TypeError: not a block of a supported family, or not the transformers 5.x layout.
        ValueError: a family, activation or routing variant MoELayer cannot compute exactly.
    """
    spec = _spec(block)
    router, ex = getattr(block, spec.router), block.experts
    # The parts not given stay MoEConfig's defaults (stated once, there).
    given = {
        "parallel": parallel,
        "schedule": schedule,
        "collective": collective,
        "compression": compression,
    }
    M = router.weight.shape[1]
    inter = ex.gate_up_proj.shape[1 if spec.experts == "fused" else 2] // 2
    cfg = MoEConfig(
        gate=_gate_config(spec, block),
        experts=ExpertConfig(model_dim=M, hidden_dim=inter, activation="swiglu"),
        shared=_shared_config(spec, block),
        **{part: value for part, value in given.items() if value is not None},
    )
    w = ex.gate_up_proj
    moe = _moe(spec, cfg, ex, group).to(device=w.device, dtype=w.dtype)
    _load_experts(spec, moe, ex)
    moe.gate_weight = router.weight  # tied: one router weight, gradients from both uses
    if spec.logit_bias is not None:
        moe.gate_bias = getattr(router, spec.logit_bias)
    shared = getattr(block, spec.shared) if cfg.shared is not None else None
    shared_gate = getattr(block, spec.shared_gate) if cfg.shared and cfg.shared.gated else None
    if shared is not None:  # tied too: MoELayer computes them, the family's names hold them
        moe.shared.w1_HM, moe.shared.w3_HM = shared.gate_proj.weight, shared.up_proj.weight
        moe.shared.w2_MH = shared.down_proj.weight
        if shared_gate is not None:
            moe.shared.gate_1M = shared_gate.weight
    if spec.correction_bias is not None:  # re-aliased per call (see HFMoEBlock.forward)
        moe.expert_bias = getattr(router, spec.correction_bias).as_subclass(torch.Tensor)
    jitter = getattr(block, spec.jitter, 0.0) if spec.jitter else 0.0
    return HFMoEBlock(
        moe,
        router,
        jitter=float(jitter or 0.0),
        shared=shared,
        shared_gate=shared_gate,
        spec=spec,
    )


def _moe(spec: FamilySpec, cfg: MoEConfig, ex: nn.Module, group) -> MoELayer:
    if spec.experts != "gpt_oss":
        return MoELayer(cfg, group=group)
    M, inter = cfg.experts.model_dim, cfg.experts.hidden_dim
    alpha, limit = float(ex.alpha), float(ex.limit)
    return MoELayer(cfg, group=group, expert_factory=lambda e: GptOssExpert(M, inter, alpha, limit))


@torch.no_grad()
def _load_experts(spec: FamilySpec, moe: MoELayer, ex: nn.Module) -> None:
    """This rank's experts from the family's [E, ...] tensors (copies, in MoELayer's layout)."""
    if spec.experts != "gpt_oss":
        moe.load_global_state(
            to_moe_experts(ex.gate_up_proj.detach(), ex.down_proj.detach(), spec.experts)
        )
        return
    first = moe.expert_slice().start
    for i, module in enumerate(moe.experts.experts):
        for name, p in module.named_parameters():
            p.copy_(getattr(ex, name)[first + i])


class Replaced(list):
    """What `replace_moe_blocks` replaced: a list of module names (as before), with `families`
    mapping each name to its family and `summary()` counting blocks per family."""

    def __init__(self, families: dict[str, str]) -> None:
        super().__init__(families)
        self.families = dict(families)

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fam in self.families.values():
            out[fam] = out.get(fam, 0) + 1
        return out


def _moe_like(module: nn.Module) -> bool:
    """A block that looks like a sparse MoE: it holds an `experts` submodule (every MoE block of
    transformers 5.x does), or its class is a refused family's."""
    return type(module).__name__ in REFUSED or isinstance(
        getattr(module, "experts", None), nn.Module
    )


def replace_moe_blocks(model: nn.Module, **kw) -> Replaced:
    """Replace every sparse MoE block in `model` in place (keyword arguments go to
    `from_hf_block`); returns the replaced modules' names with their families (`Replaced`).
    Collective when `group` has more than one rank (every rank must call it).

    Raises (before anything is replaced):
        ValueError / TypeError: a MoE-like block (one with an `experts` submodule) that does not
            convert, naming its class and why; or no MoE block at all.
    """
    found: list[tuple[str, nn.Module]] = []
    skip: tuple[str, ...] = ()
    for name, m in model.named_modules():
        if skip and name.startswith(skip):
            continue
        if isinstance(m, (HFMoEBlock, MoELayer)):
            skip += (f"{name}.",)  # already schemoe: nothing below it to convert
            continue
        if type(m).__name__ in SUPPORTED or _moe_like(m):
            _spec(m)  # raises, naming the class and why, if it does not convert
            found.append((name, m))
            skip += (f"{name}.",)
    already = any(isinstance(m, HFMoEBlock) for m in model.modules())
    if not found and not already:
        raise ValueError(
            f"{type(model).__name__} has no sparse MoE block of a supported family "
            f"({sorted(FAMILIES)}); nothing to replace"
        )
    for name, block in found:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, from_hf_block(block, **kw))
    return Replaced({n: SUPPORTED[type(b).__name__] for n, b in found})
