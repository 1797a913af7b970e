"""The way back from `replace_moe_blocks`: a converted Hugging Face model saved as a checkpoint
its own, unmodified family class loads, and a family checkpoint loaded into a converted model.

    replace_moe_blocks(model, group=ep_group)        # train with schemoe ...
    save_pretrained(model, "out/")                   # every rank calls it; rank 0 writes
    MixtralForCausalLM.from_pretrained("out/")       # the family's own class, same logits

    load_pretrained_into(model, "out/")              # back into a converted model (every rank)

Legend: E experts, M model dim (HF's hidden size), I expert intermediate size.

A converted block (`HFMoEBlock`) keeps the family's router and shared-expert modules under their
own names, their tensors tied to the MoELayer's; only the routed experts change layout. The
family's state dict is therefore the converted model's, less every `<block>.moe.*` name (the
same tensors again, or the layer's routing statistics), plus the routed experts in the family's
layout (transformers 5.x stores them fused), gathered from the expert-parallel ranks (a
collective):

    fused (Mixtral and most)  <block>.experts.gate_up_proj [E, 2I, M] = cat(w1_EMH^T, w3_EMH^T)
                              <block>.experts.down_proj    [E, M, I]  = w2_EHM^T
    fused_t (Llama 4)         gate_up_proj [E, M, 2I] = cat(w1_EMH, w3_EMH), down_proj = w2_EHM
    per_expert (GPT-OSS)      row e of each family tensor = that tensor of expert e's module

A block's family spec (`block.spec`, where the conversion gives one) names its layout and its
tensors (`spec.weights(block)`); a block without one has Mixtral's / Qwen2-MoE's. The result is
checked against the family's own layout (the class built on the meta device: no memory, no
weights): a converted block whose weights do not map back exactly is refused, not written.
`model.save_pretrained(path, state_dict=hf_state_dict(model))` is what `save_pretrained` runs on
rank 0; transformers then writes the checkpoint format of the family (e.g. Mixtral's per-expert
w1/w2/w3) as for an unconverted model. Plain `model.save_pretrained(path)` on a converted model
fails in transformers (the router weight is held under two names) and could not gather experts.

Loading goes through the family class: `from_pretrained` reads and converts the checkpoint
format, then `load_hf_state_dict` copies each tensor into the converted model (each rank keeps
its experts' rows). Peak memory is one unconverted copy of the model per rank for the duration;
`replace_moe_blocks(Family.from_pretrained(path))` is the other route, for a fresh model.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checkpoint.files import agree
from .hf import HFMoEBlock, to_schemoe_experts

__all__ = [
    "from_schemoe_experts",
    "hf_state_dict",
    "load_hf_state_dict",
    "load_pretrained_into",
    "save_pretrained",
]

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"


def from_schemoe_experts(
    state: Mapping[str, torch.Tensor], layout: str = "fused"
) -> dict[str, torch.Tensor]:
    """The inverse of `to_schemoe_experts`: the family's fused expert weights.

    Args:
        state: MoELayer tensors (names relative to the layer) holding all E experts:
            experts.w1_EMH, experts.w3_EMH [E, M, I] and experts.w2_EHM [E, I, M].
        layout: "fused" (Mixtral and most: gate_up_proj [E, 2I, M], gate rows first,
            down_proj [E, M, I]) or "fused_t" (Llama 4: gate_up_proj [E, M, 2I], gate columns
            first, down_proj [E, I, M]).

    Returns:
        {"experts.gate_up_proj", "experts.down_proj"} in `layout`, names relative to the block.
    """
    w1, w3, w2 = state["experts.w1_EMH"], state["experts.w3_EMH"], state["experts.w2_EHM"]
    if layout == "fused_t":
        return {GATE_UP: torch.cat([w1, w3], dim=2).contiguous(), DOWN: w2.contiguous()}
    if layout != "fused":
        raise ValueError(f"layout must be 'fused' or 'fused_t', got {layout!r}")
    gate_up = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=1).contiguous()
    return {GATE_UP: gate_up, DOWN: w2.transpose(1, 2).contiguous()}


def _to_schemoe(gate_up: torch.Tensor, down: torch.Tensor, layout: str) -> dict:
    """`from_schemoe_experts`'s inverse for `layout` (MoELayer's expert tensors)."""
    if layout == "fused":
        return to_schemoe_experts(gate_up, down)
    assert layout == "fused_t", layout
    inter = down.shape[1]
    w1, w3 = gate_up[..., :inter].contiguous(), gate_up[..., inter:].contiguous()
    return {"experts.w1_EMH": w1, "experts.w3_EMH": w3, "experts.w2_EHM": down.contiguous()}


def _expert_links(block: HFMoEBlock) -> tuple[list, str]:
    """The block's routed-expert tensors as (family name, MoELayer names, kind) links and the
    family's expert layout: from the block's family spec (`spec.weights`, `spec.experts`) where
    it has one, else Mixtral's / Qwen2-MoE's fused pair. Kinds: "experts" (a layout conversion
    of MoELayer's experts.w1_EMH / w3_EMH / w2_EHM) and "per_expert" (`moe` a name template with
    {e}, the local expert index, whose tensor is row first + e of the family's, same layout)."""
    spec = getattr(block, "spec", None)
    if spec is None:
        return [(GATE_UP, (), "experts"), (DOWN, (), "experts")], "fused"
    links = [(w.hf, w.moe, w.kind) for w in spec.weights(block) if w.kind != "tied"]
    unknown = sorted({kind for _, _, kind in links} - {"experts", "per_expert"})
    if unknown:
        raise TypeError(f"{spec.family}: weight links of kind {unknown} are not written back")
    return links, getattr(spec, "experts", "fused")


def _gather_rows(local: torch.Tensor, moe) -> torch.Tensor:
    """[El, ...] of every expert-parallel rank -> [E, ...] in global expert order (collective)."""
    if moe.topology.world == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(moe.topology.world)]
    dist.all_gather(parts, local.contiguous(), group=moe.topology.group)
    return torch.cat(parts)


def _family_experts(block: HFMoEBlock) -> dict[str, torch.Tensor]:
    """The block's routed experts in the family's names (relative to the block) and layout,
    every expert (collective over the block's expert-parallel group)."""
    links, layout = _expert_links(block)
    if all(kind == "experts" for _, _, kind in links):
        return from_schemoe_experts(block.moe.global_state(), layout)  # all-gather
    own = block.state_dict(keep_vars=True)
    out = {}
    for hf, moe, kind in links:
        assert kind == "per_expert" and len(moe) == 1, (hf, moe, kind)
        local = torch.stack([own[moe[0].format(e=e)].detach() for e in range(block.moe.num_local)])
        out[hf] = _gather_rows(local, block.moe)
    return out


@torch.no_grad()
def _load_family_experts(block: HFMoEBlock, state: dict, prefix: str) -> None:
    """Pop the block's routed experts (family names and layout, every expert) from `state` into
    its MoELayer, this rank's experts only."""
    links, layout = _expert_links(block)
    absent = [prefix + hf for hf, _, _ in links if prefix + hf not in state]
    if absent:
        raise ValueError(f"the state dict has no {absent}: not this family's layout")
    full = {hf: state.pop(prefix + hf) for hf, _, _ in links}
    if all(kind == "experts" for _, _, kind in links):
        block.moe.load_global_state(_to_schemoe(full[GATE_UP], full[DOWN], layout))
        return
    own, first = block.state_dict(keep_vars=True), block.moe.expert_slice().start
    for hf, moe, _ in links:
        for e in range(block.moe.num_local):
            own[moe[0].format(e=e)].copy_(full[hf][first + e])


def _bare(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _blocks(model: nn.Module) -> list[tuple[str, HFMoEBlock]]:
    """The converted blocks with their name prefixes ("model.layers.0.mlp."), in module order
    (the same on every rank: the order of the collectives below)."""
    found = [
        (f"{n}." if n else "", m) for n, m in model.named_modules() if isinstance(m, HFMoEBlock)
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no converted MoE block (HFMoEBlock); "
            "call schemoe.integrations.hf.replace_moe_blocks(model) first, or use the "
            "family's own save_pretrained / from_pretrained"
        )
    return found


def _check_tied(name: str, block: HFMoEBlock) -> None:
    """Every MoELayer tensor but the routed experts must be one of the block's HF-named tensors
    (same storage), or the family's state dict would not hold it. Integer buffers (routing
    counts) are statistics, not weights."""
    held = {
        t.data_ptr()
        for n, t in block.state_dict(keep_vars=True).items()
        if not n.startswith("moe.")
    }
    loose = [
        n
        for n, t in block.moe.state_dict(keep_vars=True).items()
        if not getattr(t, "schemoe_expert", False)
        and t.is_floating_point()
        and t.data_ptr() not in held
    ]
    if loose:
        raise TypeError(
            f"{name or 'the block'}: MoELayer tensors {loose} are not tied to any of the "
            "family's tensors; this block cannot be written in (or read from) the family's layout"
        )


def _check_layout(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """`state` has exactly the names and shapes of the unmodified family model's state dict
    (that class built from the model's config on the meta device: no memory, no weights)."""
    with torch.device("meta"):
        ref = type(model)(copy.deepcopy(model.config)).state_dict()
    missing, extra = sorted(set(ref) - set(state)), sorted(set(state) - set(ref))
    shapes = [
        f"{n}: {tuple(state[n].shape)} vs {tuple(t.shape)}"
        for n, t in ref.items()
        if n in state and tuple(state[n].shape) != tuple(t.shape)
    ]
    if missing or extra or shapes:
        raise ValueError(
            f"the converted model's weights do not map onto {type(model).__name__}'s own layout "
            f"(missing {missing[:4]}, unexpected {extra[:4]}, shapes {shapes[:4]}); "
            "this family's converted blocks cannot be saved in its layout"
        )


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unmodified family model that computes what the converted `model`
    computes (see the module docstring), with every expert; collective over each converted
    block's expert-parallel group (every rank calls it, and gets the whole dict).

    Args:
        model: a transformers model after `replace_moe_blocks` (or its DDP wrapper).

    Returns:
        name -> tensor (detached; the experts gathered, the rest the model's own tensors).

    Raises:
        ValueError: no converted block, or the result does not fit the family's layout.
        TypeError: a converted block holds a weight the family's layout has no name for.
    """
    model = _bare(model)
    blocks = _blocks(model)
    inner = tuple(f"{prefix}moe." for prefix, _ in blocks)
    out = {n: t.detach() for n, t in model.state_dict().items() if not n.startswith(inner)}
    for prefix, block in blocks:
        _check_tied(prefix, block)
        experts = _family_experts(block)  # all-gather over the block's expert-parallel group
        out.update({prefix + n: t for n, t in experts.items()})
    _check_layout(model, out)
    return out


def save_pretrained(model: nn.Module, path: str | os.PathLike, **kwargs) -> None:
    """Write the converted `model` as a checkpoint of its own family: `Family.from_pretrained(
    path)` (unmodified transformers) loads it and computes the same logits.

    Collective: every rank calls it (the experts are gathered from the expert-parallel ranks);
    global rank 0 writes, and every rank returns once the write succeeded (or raises if it did
    not). Dense weights are taken from rank 0 (data-parallel replicas hold the same ones).

    Args:
        model: a transformers model after `replace_moe_blocks` (or its DDP wrapper).
        path: the folder to write (created if needed).
        **kwargs: passed to the model's `save_pretrained` (e.g. max_shard_size); not
            `state_dict` or `is_main_process`, which this function sets.
    """
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise TypeError(f"save_pretrained sets {key} itself; do not pass it")
    state = hf_state_dict(model)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    ok = True
    try:
        if rank == 0:
            if os.path.isfile(path):  # transformers would log it and return, writing nothing
                raise ValueError(f"{path} is a file; save_pretrained writes a folder")
            _bare(model).save_pretrained(path, state_dict=state, is_main_process=True, **kwargs)
    except BaseException:
        ok = False
        agree(ok)  # the other ranks learn of it now, not at their timeout
        raise
    if not agree(ok):  # a barrier too: the files exist when every rank returns
        raise RuntimeError(f"rank 0 failed to write {path} (see its error)")


@torch.no_grad()
def load_hf_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a family state dict (the unmodified model's names and layout, every expert) into the
    converted `model`: each rank keeps its experts' rows. Not collective.

    Raises:
        ValueError: a name of the family's model is missing from `state`, or `state` has a name
            the converted model does not hold.
    """
    model = _bare(model)
    state = dict(state)
    blocks = _blocks(model)
    for prefix, block in blocks:
        _check_tied(prefix, block)
        _load_family_experts(block, state, prefix)
    missing, unexpected = model.load_state_dict(state, strict=False)
    inner = tuple(f"{prefix}moe." for prefix, _ in blocks)
    missing = [n for n in missing if not n.startswith(inner)]  # tied to loaded names, or counts
    if missing or unexpected:
        raise ValueError(
            f"state dict does not fit the converted {type(model).__name__}: missing "
            f"{missing[:4]}, unexpected {unexpected[:4]}"
        )


def load_pretrained_into(model: nn.Module, path: str | os.PathLike, **kwargs) -> None:
    """Load the family checkpoint at `path` into the converted `model` (its parameters keep their
    identity: an optimizer or DDP wrapper built on them stays valid). Every rank reads the whole
    checkpoint through the family's `from_pretrained` (its format conversions included) and keeps
    its own experts. Not collective.

    Args:
        model: a transformers model after `replace_moe_blocks` (or its DDP wrapper).
        path: a folder (or hub name) `from_pretrained` reads.
        **kwargs: passed to `from_pretrained`; dtype defaults to the model's.
    """
    bare = _bare(model)
    kwargs.setdefault("dtype", next(bare.parameters()).dtype)
    family = type(bare).from_pretrained(path, **kwargs)
    load_hf_state_dict(bare, family.state_dict())
