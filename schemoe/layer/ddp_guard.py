"""The one check MoELayer makes of the DistributedDataParallel around it: DDP must not manage its
sharded experts (wrap the model as DDP(schemoe.ddp_ignore_experts(model)))."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["refuse_ddp_managed_experts"]


def refuse_ddp_managed_experts(experts: nn.Module, world: int, checked: set[int]) -> None:
    """Raise if the DDP module running this forward manages a parameter of `experts` (sharded
    over `world` ranks): at its construction DDP copied rank 0's experts over every rank's, and
    it would average the gradients of different experts. Checked once per DDP wrapper (`checked`
    holds the ids seen); torch names the DDP module running a forward through a classmethod it
    keeps for its compiler."""
    active = getattr(DDP, "_get_active_ddp_module", None)
    ddp = active() if active is not None else None
    if ddp is None or world == 1 or id(ddp) in checked:
        return
    checked.add(id(ddp))
    ours = {id(p) for p in experts.parameters()}
    managed = [
        n
        for n, p in ddp.module.named_parameters()
        if id(p) in ours and n not in ddp.parameters_to_ignore
    ]
    if managed:
        raise RuntimeError(
            f"DistributedDataParallel manages this MoE layer's expert parameters "
            f"({managed[0]!r}, ...): it broadcast rank 0's experts over the others' and "
            "would average different experts' gradients. Wrap the model as "
            "DDP(schemoe.ddp_ignore_experts(model))"
        )
