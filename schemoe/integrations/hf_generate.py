"""`generate` for a converted Hugging Face model whose experts are spread over several ranks.

    replace_moe_blocks(model, group=None)            # experts over every rank
    out = generate(model, input_ids, max_new_tokens=32, eos_token_id=eos)   # every rank calls it

Every MoE block runs all-to-alls, which every rank of its expert-parallel group must join, once
per forward. transformers' `generate` stops a rank's loop when that rank's sequences are done, so
a rank that reaches its end token first stops calling forward and the others wait in their next
all-to-all until the process group's timeout. transformers' own remedy is `synced_gpus=True`
(made for DeepSpeed ZeRO-3 and FSDP, which gather weights in forward the same way): each step
all ranks all-reduce whether any is still generating, and a finished rank keeps running forward
(its outputs discarded, its tokens unchanged) until all are done. `generate` here is the model's
`generate` with `synced_gpus=True` whenever an MoE layer of the model spans more than one rank;
the tokens are those of a one-process run. The flag is all-reduced over the default process
group, so every rank of it calls `generate`, the same number of times (prompts, lengths, end
tokens and sampling settings may differ per rank).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..layer.moe import MoELayer

__all__ = ["generate", "needs_synced_generation"]


def needs_synced_generation(model: nn.Module) -> bool:
    """Whether generating with `model` needs every rank to step together: an MoELayer of it
    spans more than one rank."""
    return any(isinstance(m, MoELayer) and m.topology.world > 1 for m in model.modules())


def generate(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`model.generate(*args, **kwargs)`, with every rank stepping until all are done where the
    experts are spread over ranks (see the module docstring). Collective then: every rank of the
    default process group calls it.

    Args:
        model: a transformers model after `replace_moe_blocks` (or its DDP wrapper).
        *args, **kwargs: as for the model's `generate` (input_ids, max_new_tokens, ...).

    Returns:
        What the model's `generate` returns (e.g. the token ids [B, L + new]).

    Raises:
        ValueError: `synced_gpus=False` for a model whose experts span several ranks (it
            would hang at the first rank that finishes early).
    """
    bare = model.module if isinstance(model, DDP) else model
    if needs_synced_generation(bare):
        if kwargs.get("synced_gpus") is False:
            raise ValueError(
                "synced_gpus=False: this model's experts span several ranks, so every rank must "
                "run each forward until all are done; leave synced_gpus unset (or True)"
            )
        assert dist.is_initialized()  # a layer spanning ranks was built in a process group
        kwargs["synced_gpus"] = True
    return bare.generate(*args, **kwargs)
