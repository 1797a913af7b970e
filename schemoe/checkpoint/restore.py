"""Putting a checkpoint's tensors (keyed as store.py describes) into a model and its optimizer,
each rank taking the rows of its own experts (`MoELayer.expert_slice()`)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .shards import expert_keys, optim_names

__all__ = ["STACKED", "like", "load_model", "load_optimizer", "lookup", "needed"]

STACKED = re.compile(r"^(.*)\[(\d+)\]$")


def needed(model: nn.Module, with_optimizer: bool, keys: Iterable[str]) -> list[str]:
    """The checkpoint `keys` this rank loads: the dense tensors, its own experts' rows, and
    their optimizer states when `with_optimizer`."""
    experts = expert_keys(model)
    names = set(experts)  # stacked optimizer states (AdamW's step) go by the parameter's name
    for name in model.state_dict():
        names.update(k for k, _ in experts.get(name, [(name, None)]))
    out = []
    for key in keys:
        kind, _, rest = key.partition("/")
        if kind == "optim" and with_optimizer:
            rest = rest.partition("/")[2]
        elif kind != "model":
            continue
        if rest in names:
            out.append(key)
    return out


def like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full` (a whole tensor) laid out as `target`: as is for a plain tensor; for a DTensor
    (an FSDP-sharded weight or its AdamW state), this rank's shard of it, cut locally from its
    own copy (`src_data_rank=None`: no collective)."""
    if not isinstance(target, DTensor) or full.shape != target.shape:
        return full
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)


def lookup(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """An expert row from a checkpoint (model/name[e]) or from an export (model/name, E rows)."""
    if key in tensors:
        return tensors[key]
    m = STACKED.match(key)
    if m and m[1] in tensors:
        full = tensors[m[1]]
        if int(m[2]) < full.shape[0]:
            return full[int(m[2])]
    raise KeyError(key)


def load_model(model: nn.Module, tensors: dict[str, torch.Tensor], src: Path) -> None:
    experts = expert_keys(model)
    state = {}
    for name, t in model.state_dict().items():
        try:
            if name in experts:
                rows = [lookup(tensors, f"model/{key}") for key, _ in experts[name]]
                state[name] = rows[0] if experts[name][0][1] is None else torch.stack(rows)
            else:
                state[name] = tensors[f"model/{name}"]
        except KeyError as e:
            raise ValueError(
                f"{src} has no {e.args[0]!r} for {name}: written for another model "
                "(layers, experts or expert type differ)?"
            ) from None
        if state[name].shape != t.shape:
            raise ValueError(
                f"{src}: {name} has shape {tuple(state[name].shape)}, the model "
                f"expects {tuple(t.shape)}"
            )
        state[name] = like(state[name], t)
    model.load_state_dict(state)


def load_optimizer(
    model: nn.Module, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    by_name: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, v in tensors.items():
        if key.startswith("optim/"):
            _, k, rest = key.split("/", 2)
            by_name[rest][k] = v
    experts = expert_keys(model)
    params = dict(model.named_parameters())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for idx, name in enumerate(optim_names(model, opt)):
        if name not in experts:
            if name in by_name:
                state[idx] = {k: like(v.clone(), params[name]) for k, v in by_name[name].items()}
            continue
        keys = experts[name]
        rows = [by_name.get(key, {}) for key, _ in keys]
        entry = {k: v.clone() for k, v in by_name.get(name, {}).items()}  # e.g. step
        if keys[0][1] is None:
            entry.update({k: v.clone() for k, v in rows[0].items()})
        else:
            entry.update({k: torch.stack([row[k] for row in rows]) for k in rows[0]})
        if entry:
            state[idx] = entry
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
