"""Which tensors a rank holds in a checkpoint: experts keyed by global index, the dense weights
and their optimizer state under the same keys on every rank; see store.py for the layout."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..experts.ffn import ModuleExperts
from ..layer.moe import MoELayer
from ..layer.parallel import is_expert_param

__all__ = ["bare", "expert_keys", "finite", "optim_names", "rank_state"]


def bare(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def expert_keys(model: nn.Module) -> dict[str, list[tuple[str, int | None]]]:
    """Parameter name -> [(storage key, local row or None for the whole tensor)] per expert."""
    out: dict[str, list[tuple[str, int | None]]] = {}
    for ln, layer in model.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        first = layer.expert_slice().start
        pre = f"{ln}." if ln else ""
        for pn, p in layer.named_parameters():
            if not is_expert_param(p):
                continue
            m = re.fullmatch(r"experts\.experts\.(\d+)\.(.+)", pn)
            if isinstance(layer.experts, ModuleExperts) and m:
                out[pre + pn] = [(f"{pre}experts.experts.{first + int(m[1])}.{m[2]}", None)]
            else:  # stacked: dim 0 is the local expert
                out[pre + pn] = [(f"{pre}{pn}[{first + i}]", i) for i in range(p.shape[0])]
    return out


def optim_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its state_dict index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def finite(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every floating tensor is finite; a DTensor by its local shard (no collective: the
    caller agrees over ranks). A host sync per tensor, at save time only."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors.values())
    return all(bool(t.isfinite().all()) for t in local if t.is_floating_point())


def rank_state(model: nn.Module, optimizer, rng, rank: int) -> dict[str, torch.Tensor]:
    """This rank's flat state dict for DCP, every tensor a CPU copy: the dense tensors
    (model/<name>, optim/<k>/<name>; the same keys on every rank, DCP writes each once), this
    rank's experts under their global keys, and its RNG states (rng/<rank>/<name>)."""
    experts = expert_keys(model)
    state = optimizer.state if optimizer is not None else {}
    out: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor) -> None:
        # no copy: DCP copies each tensor to the CPU as it writes it, and clones a view (whose
        # storage is larger than itself); a DTensor (FSDP) is written as this rank's shard
        out[key] = t.detach()

    for name, t in model.state_dict().items():
        for key, i in experts.get(name, [(name, None)]):
            put(f"model/{key}", t if i is None else t[i])
    for name, p in model.named_parameters():
        for k, v in state.get(p, {}).items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(
                    f"optimizer state {k!r} of {name} is a {type(v).__name__}; "
                    "only tensor states can be checkpointed"
                )
            if name not in experts or (experts[name][0][1] is not None and v.shape != p.shape):
                # dense, or a state of stacked experts that does not shard like the weight
                # (AdamW's step): one tensor under the parameter's name
                put(f"optim/{k}/{name}", v)
                continue
            for key, i in experts[name]:
                put(f"optim/{k}/{key}", v if i is None else v[i])
    for k, v in (rng or {}).items():
        put(f"rng/{rank}/{k}", v)
    return out
