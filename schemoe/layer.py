"""MoELayer: routing, layout and the scheduled expert-parallel region, composed.

Legend: T tokens on this rank, M model dim, E experts, P ranks, El = E / P, N buffer rows.

    x [.., M] -> route -> encode -> rows [N, M] -> scheduled region (dispatch a2a, experts,
    combine a2a; r chunks under a policy) -> rows [N, M] -> decode -> y [.., M], aux loss
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from . import collectives, compression, trace
from .config import MoEConfig
from .experts import BatchedFFN, ModuleExperts
from .gating import load_balancing_loss, route, router_z_loss, update_balance_bias
from .layout import decode, encode
from .scheduling.autograd import Region, run_region
from .scheduling.plan import build_plan
from .scheduling.policies import POLICIES
from .topology import Topology

__all__ = ["MoELayer"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class MoELayer(nn.Module):
    """A Mixture-of-Experts FFN layer with expert parallelism over `group`.

    Args:
        config: the layer's MoEConfig.
        group: the expert-parallel process group (None: the default group, or a single process
            when torch.distributed is not initialised).
        expert_factory: optional; called with a global expert index, returns that expert's
            nn.Module mapping [n, M] -> [n, M]; replaces the built-in batched FFN.
        seed: base seed of the expert initialisation (expert e gets the same initial weights
            whatever P is).

    forward(x) takes x of shape [T, M] or [B, L, M] and returns (y of the same shape, aux loss).
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        group=None,
        expert_factory: Callable[[int], nn.Module] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        E, M = config.gate.num_experts, config.experts.model_dim
        if _distributed():
            self.topology = Topology.from_group(group, config.parallel.ranks_per_node)
        else:
            self.topology = Topology(world=1, rank=0, ranks_per_node=1)
        P, rank = self.topology.world, self.topology.rank
        if E % P:
            raise ValueError(f"num_experts={E} must be divisible by the expert-parallel size {P}")
        self.num_local = E // P
        # What runs: the config itself, or (policy "auto") what the cost model picks on the
        # first call. Plug-in names are checked here, not in the config, so late registrations
        # work.
        self._run: MoEConfig | None = None
        self._costs = None
        self._tokens0 = 0  # rank 0's token count at the first call (what the cost model saw)
        self._trials = None  # policy "auto" with trials: online.Trials until it has decided
        self.trial_report: list[dict] = []  # then each candidate's median and the choice
        if config.schedule.policy != "auto":
            self._use(config)

        self.gate_weight = nn.Parameter(torch.empty(E, M))
        nn.init.uniform_(self.gate_weight, -1 / math.sqrt(M), 1 / math.sqrt(M))
        first = rank * self.num_local
        if expert_factory is None:
            self.experts = BatchedFFN(config.experts, self.num_local, first, seed)
        else:
            self.experts = ModuleExperts(expert_factory, self.num_local, first)
        if config.gate.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(E))
            self.register_buffer("expert_load", torch.zeros(E))
        else:
            self.expert_bias = None
            self.expert_load = None

    # ---------------------------------------------------------------- forward
    def _check(self, x: torch.Tensor) -> None:
        M = self.config.experts.model_dim
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoELayer input must be a Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != M:
            raise ValueError(
                f"MoELayer input must be [T, {M}] or [B, L, {M}], got shape {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise TypeError(f"MoELayer input must be floating point, got {x.dtype}")
        w = next(self.experts.parameters(), None)
        if w is not None and w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"input dtype {x.dtype} does not match the expert weights' dtype {w.dtype}; "
                f"cast the layer (layer.to({x.dtype})) or run under torch.autocast"
            )

    def _exchange_counts(self, counts: tuple[int, ...], device):
        """Start the exchange of [P][El]: rows each rank holds for this rank's experts (a tiny
        all-to-all). Returns a function that waits for it (a host sync: splits must be known)."""
        P, El = self.topology.world, self.num_local
        if P == 1:
            return lambda: [list(counts)]
        send = torch.tensor(counts, dtype=torch.long, device=device)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.topology.group, async_op=True)

        def wait() -> list[list[int]]:
            work.wait()
            flat = recv.tolist()
            return [flat[s * El : (s + 1) * El] for s in range(P)]

        return wait

    def _use(self, cfg: MoEConfig) -> None:
        """Run `cfg` from now on; policy "search" also gets this layer's cost model."""
        self._policy = POLICIES.get(cfg.schedule.policy)
        self.algorithm = collectives.build(cfg.collective.algorithm, self.topology)
        opts = cfg.compression.options
        self.forward_compressor = compression.build(cfg.compression.forward, opts)
        self.backward_compressor = compression.build(cfg.compression.backward, opts)
        self._costs = None
        if cfg.schedule.policy == "search" and self._tokens0:
            from .costmodel import tune

            self._costs = tune.cost_model_for(cfg, self._tokens0, self.topology) or None
        self._run = cfg

    def _first_call(self, tokens: int) -> None:
        """Policies "auto" and "search" consult the cost model once per layer, on the first call,
        with rank 0's token count, so every rank runs the same schedule (collective). "auto"
        with trials gets the model's shortlist and times it over the next calls."""
        sched = self.config.schedule
        if self._tokens0 or sched.policy not in ("auto", "search"):
            return
        from .costmodel import online, tune

        if self.topology.world > 1:
            t = torch.tensor([tokens])
            dist.broadcast(t, self.topology.global_rank(0), group=self.topology.group)
            tokens = int(t.item())
        self._tokens0 = max(tokens, 1)
        if sched.policy == "search":
            self._use(self.config)
            return
        n = sched.shortlist if sched.trials else 1
        picks = tune.resolve(self.config, self._tokens0, self.topology, n=n)
        picks = picks if isinstance(picks, list) else [picks]
        if len(picks) == 1:
            self._use(picks[0])
        else:
            self._trials = online.Trials(picks, sched.trials)

    def _next_trial(self) -> bool:
        """Policy "auto" while trials run: switch to this call's candidate (True: time it), or
        decide once every sample is in (collective: the ranks agree on the slowest's times)."""
        i = self._trials.next()
        if i is not None:
            self._use(self._trials.configs[i])
            return True

        def slowest(medians: list[float]) -> list[float]:
            if self.topology.world == 1:
                return medians
            t = torch.tensor(medians, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.topology.group)
            return t.tolist()

        self._use(self._trials.configs[self._trials.decide(slowest)])
        self.trial_report = self._trials.report
        self._trials = None
        return False

    @property
    def resolved_config(self) -> MoEConfig | None:
        """The configuration that runs: `config` itself, or for policy "auto" what was chosen
        (None before the first call and while trials run; see `tuning`)."""
        return None if self._trials is not None else self._run

    def running(self) -> dict | None:
        """{policy, chunks, algorithm, compression} of `resolved_config`, None while tuning."""
        from .costmodel.online import _summary

        return None if self.resolved_config is None else _summary(self.resolved_config)

    @property
    def tuning(self) -> bool:
        """True until policy "auto" has settled on a configuration."""
        return self._run is None or self._trials is not None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(x)
        self._first_call(x.numel() // self.config.experts.model_dim)
        timed = self._trials is not None and self._next_trial()
        t0 = trace.clock(x.device) if timed else 0.0
        cfg = self._run
        x_TM = x.reshape(-1, cfg.experts.model_dim)
        # 1. Route (fp32) and the router losses of this rank's tokens.
        routing = route(
            x_TM, self.gate_weight, cfg.gate, training=self.training, bias_E=self.expert_bias
        )
        aux = routing.probs_TE.new_zeros(())
        if cfg.gate.aux_loss_weight > 0:
            aux = aux + cfg.gate.aux_loss_weight * load_balancing_loss(
                routing.probs_TE, routing.expert_TK
            )
        if cfg.gate.z_loss_weight > 0:
            aux = aux + cfg.gate.z_loss_weight * router_z_loss(routing.logits_TE)
        if self.expert_load is not None and self.training:
            with torch.no_grad():
                self.expert_load += torch.bincount(
                    routing.expert_TK.reshape(-1), minlength=cfg.gate.num_experts
                ).float()
        # 2. Tokens into the expert-major buffer, while the buffer sizes are exchanged.
        recv_counts = self._exchange_counts(routing.counts, x.device)
        rows_NM = encode(x_TM, routing)
        # 3. Dispatch, experts, combine: chunked and scheduled, forward and backward.
        plan = build_plan(
            routing.counts,
            recv_counts(),
            self.topology.rank,
            cfg.schedule.chunks,
            self._policy.partition,
            x.device,
        )
        region = Region(
            plan,
            self.algorithm,
            self.forward_compressor,
            self.backward_compressor,
            self.experts,
            cfg.schedule.policy,
            self._costs,
            self._trials.add if timed else None,
        )
        out_NM = run_region(region, rows_NM)
        # 4. Weighted sum back in token order.
        y_TM = decode(out_NM, routing, x.dtype)
        if timed:  # the whole forward call (the chunk plan depends on the candidate)
            self._trials.add(trace.clock(x.device) - t0)
        return y_TM.view(x.shape), aux

    # ---------------------------------------------------------------- state
    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step: nudge the selection bias using the load seen since the
        last call, summed over the expert-parallel group (collective)."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs GateConfig(bias_update_rate > 0)")
        load = self.expert_load.clone()
        if self.topology.world > 1:
            dist.all_reduce(load, group=self.topology.group)
        self.expert_bias.copy_(
            update_balance_bias(self.expert_bias, load, self.config.gate.bias_update_rate)
        )
        self.expert_load.zero_()

    def expert_slice(self) -> slice:
        r, El = self.topology.rank, self.num_local
        return slice(r * El, (r + 1) * El)

    @torch.no_grad()
    def load_global_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load an unsharded state: gate_weight [E, M] and expert tensors with E leading rows
        (as in `global_state()`); this rank keeps its experts' rows."""
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        sl = self.expert_slice()
        for name, t in state.items():
            if name not in own:
                raise ValueError(f"unknown parameter {name!r}; expected one of {sorted(own)}")
            target = own[name]
            src = t[sl] if getattr(target, "schemoe_expert", False) else t
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} does not fit {tuple(target.shape)}"
                )
            target.copy_(src)

    @torch.no_grad()
    def global_state(self) -> dict[str, torch.Tensor]:
        """The unsharded state (expert tensors gathered over the group; collective)."""
        out = {}
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if getattr(t, "schemoe_expert", False) and self.topology.world > 1:
                parts = [torch.empty_like(t) for _ in range(self.topology.world)]
                dist.all_gather(parts, t.detach().contiguous(), group=self.topology.group)
                out[name] = torch.cat(parts)
            else:
                out[name] = t.detach().clone()
        return out

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"E={c.gate.num_experts}, k={c.gate.top_k}, f={c.gate.capacity_factor}, "
            f"M={c.experts.model_dim}, H={c.experts.hidden_dim}, P={self.topology.world}, "
            f"policy={c.schedule.policy}, r={c.schedule.chunks}, "
            f"algorithm={c.collective.algorithm}, compression={c.compression.forward}/"
            f"{c.compression.backward}"
        )
