"""MoELayer: a router, a token dispatcher and the scheduled expert-parallel region, composed.

Legend: T tokens on this rank, M model dim, E experts, P ranks, El = E / P, N buffer rows.

    x [.., M] -> route -> dispatcher.dispatch -> rows [N, M] -> scheduled region (dispatch a2a,
    experts, combine a2a; r chunks under a policy) -> rows [N, M] -> dispatcher.combine
    -> y [.., M], aux loss

A layer runs one resolved configuration (`running`): its config, or for policy "auto" what a
tuner (`schemoe.tuning.auto.AutoTuner`) hands it through `configure`. The forward never consults a
cost model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives, compression
from ..config import MoEConfig
from ..dist.topology import layer_topology
from ..experts.ffn import BatchedFFN, ModuleExperts
from ..routing import LoadMetrics, load_balancing_loss, route, router_z_loss, tally
from ..routing.layout import decode, encode
from ..routing.losses import update_balance_bias
from ..scheduling import POLICIES, Direction, Schedule, TaskGraph
from ..scheduling.background import Background
from .ddp_guard import refuse_ddp_managed_experts
from .dispatcher import TokenDispatcher
from .opaque import expert_parallel
from .recompute import replaying
from .region import Region
from .shared import build_shared, region_schedule

__all__ = ["NEEDS_TUNER", "MoELayer"]

# Policies a layer cannot run from its config alone: "auto" (which configuration) and "search"
# (needs a cost model). A tuner (schemoe.tuning.auto.AutoTuner) configures such layers.
NEEDS_TUNER = ("auto", "search")


def _record_expert_slice(module: MoELayer, state_dict, prefix, local_metadata) -> None:
    local_metadata["schemoe_experts"] = module.expert_shard()


class MoELayer(nn.Module):
    """A Mixture-of-Experts FFN layer with expert parallelism over `group`.

    Args:
        config: the layer's MoEConfig.
        group: the expert-parallel process group (None: the default group, or a single process
            when torch.distributed is not initialised).
        expert_factory: optional; called with a global expert index, returns that expert's
            nn.Module mapping [n, M] -> [n, M]; replaces the built-in batched FFN.
        seed: base seed of the expert initialisation (expert e gets the same initial weights
            whatever P is); None (default): drawn from torch's global generator, so
            `torch.manual_seed` decides it and layers built in a row differ.

    forward(x) takes x of shape [T, M] or [B, L, M] and returns (y of the same shape, aux loss).
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        group=None,
        expert_factory: Callable[[int], nn.Module] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        E, M = config.gate.num_experts, config.experts.model_dim
        self.topology = layer_topology(group, config.parallel.ranks_per_node)
        P, rank = self.topology.world, self.topology.rank
        if E % P:
            raise ValueError(f"num_experts={E} must be divisible by the expert-parallel size {P}")
        self.num_local = E // P
        if seed is None:
            # One draw from the global generator. Ranks that seed alike (as the replicated gate
            # weight below requires) draw the same value, so expert e depends on (seed, e) only,
            # whatever P. < 2**40 keeps seed * 1_000_003 + 3 e + 2 (experts.py) in int64.
            seed = int(torch.randint(0, 2**40, (), dtype=torch.int64))
        self._running: MoEConfig | None = None
        self._ddp_checked: set[int] = set()
        # Low-priority transfers (a scheduled gradient sync's buckets) this layer's region posts
        # into its idle network time; set by whoever owns them (schemoe.step.gradsync.GradSync).
        self.background: Background | None = None
        # Where a scheduled stack hands a block's dense gradients once they are final, before
        # its backward returns (grad_ready(params, grads)); set by the same owner.
        self.grad_ready: Callable[[list, list], None] | None = None
        if config.schedule.policy not in NEEDS_TUNER:
            self.configure(config)

        self.gate_weight = nn.Parameter(torch.empty(E, M))
        nn.init.uniform_(self.gate_weight, -1 / math.sqrt(M), 1 / math.sqrt(M))
        # The learned logit bias (GateConfig.logit_bias), dense like the gate weight.
        self.gate_bias = nn.Parameter(torch.zeros(E)) if config.gate.logit_bias else None
        first = rank * self.num_local
        if expert_factory is None:
            self.experts = BatchedFFN(config.experts, self.num_local, first, seed)
        else:
            self.experts = ModuleExperts(expert_factory, self.num_local, first)
        self.shared = build_shared(config, seed)  # always-on experts (dense), or None
        if config.gate.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(E))
            self.register_buffer("expert_load", torch.zeros(E, dtype=torch.long))  # exact counts
        else:
            self.expert_bias = None
            self.expert_load = None
        # routing_total: choices per expert and kept choices [E + 1] on the device of every
        # training call while `record_routing`, since the layer was built (None before one).
        # Never reset: readers (take_load_metrics, the re-planner) difference two reads.
        self.record_routing = False
        self.routing_total: torch.Tensor | None = None
        self._routing_taken: torch.Tensor | None = None
        # state_dict() holds this rank's experts only, under the layer's names: record which
        # slice, so loading it into another expert layout raises instead of mixing experts up.
        self._register_state_dict_hook(_record_expert_slice)
        self._register_load_state_dict_pre_hook(self._check_expert_slice)

    # ---------------------------------------------------------------- configuration
    def configure(self, config: MoEConfig, costs: Any = None) -> None:
        """Run `config` from the next call on: its policy, r, algorithm and compressors (the
        gate, experts and parallel layout must be this layer's; in capacity mode f may differ).
        `costs`: the cost model policy "search" orders tasks with (required there; anything
        `scheduling.search` accepts); the same on every rank.

        Plug-in names are checked here, not in the config, so late registrations work. Every
        rank must configure the same way (the schedules' transfers are collectives)."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if config.schedule.policy == "auto":
            raise ValueError(
                "configure() takes a resolved configuration; policy 'auto' is resolved by "
                "schemoe.tuning.auto.AutoTuner"
            )
        fixed = ("gate", "experts", "parallel", "shared")
        f, own = config.gate.capacity_factor, self.config.gate.capacity_factor
        # In capacity mode f may change too (a re-planner's opt-in); dropless stays dropless.
        gate = dataclasses.replace(config.gate, capacity_factor=own) if f and own else config.gate
        if gate != self.config.gate or any(
            getattr(config, x) != getattr(self.config, x) for x in fixed[1:]
        ):
            raise ValueError(
                f"configure() may change schedule, collective and compression only (and a "
                f"capacity-mode f), not {fixed}: got {config!r}"
            )
        policy = POLICIES.get(config.schedule.policy)
        if config.schedule.policy == "search" and costs is None:
            raise ValueError(
                "policy 'search' needs a cost model: configure(config, costs=...) or attach "
                "schemoe.tuning.auto.AutoTuner"
            )
        self.algorithm = collectives.build(config.collective.algorithm, self.topology)
        opts = config.compression.options
        self.forward_compressor = compression.build(config.compression.forward, opts)
        self.backward_compressor = compression.build(config.compression.backward, opts)
        self.dispatcher = TokenDispatcher(
            self.topology,
            config.gate.num_experts,
            config.schedule.chunks,
            policy.partition,
            uniform_tokens=config.parallel.uniform_tokens,
            dedup=config.parallel.dedup,
        )
        links = tuple(self.algorithm.links)
        self._schedules = {}
        for direction in Direction:
            self._schedules[direction] = region_schedule(config, policy, links, direction, costs)
        self._running = config

    @property
    def running(self) -> MoEConfig | None:
        """The configuration the next call runs: `config`, or for policy "auto" what a tuner
        configured (None until then; `running.summary()` in one line)."""
        return self._running

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
        if self._running is None:
            raise RuntimeError(
                f"this MoELayer has policy {self.config.schedule.policy!r} and no configuration "
                "yet: attach a tuner (schemoe.tuning.auto.AutoTuner(model)) before the first call"
            )

    def dispatch(self, x: torch.Tensor, *, balance: bool = True):
        """Steps 1-2 of forward: route x ([T, M] or [B, L, M]) and encode it into this rank's
        dispatch buffer. Returns (rows [N, M], DispatchMeta, aux loss). Collective unless the
        splits follow from the config. (The stack runtime, schemoe.step.stack, calls the steps one
        by one per micro-chunk; `balance=False` leaves the load-balancing term out of aux, for
        a caller that computes it over several calls.)"""
        x_TM, routing, aux = self._route(x, balance)
        # 2. Tokens into the expert-major buffer; splits and the chunk plan.
        rows_NM, meta = self.dispatcher.dispatch(
            x_TM, routing, dropless=self._running.gate.dropless
        )
        return rows_NM, meta, aux

    def _route(self, x: torch.Tensor, balance: bool = True):
        """Step 1: (x_TM, Routing, aux loss) of x, after the input checks."""
        self._check(x)
        refuse_ddp_managed_experts(self.experts, self.topology.world, self._ddp_checked)
        cfg = self._running
        x_TM = x.reshape(-1, cfg.experts.model_dim)
        # 1. Route (fp32) and the router losses of this rank's tokens.
        routing = route(
            x_TM,
            self.gate_weight,
            cfg.gate,
            training=self.training,
            bias_E=self.expert_bias,
            logit_bias_E=self.gate_bias,
        )
        aux = routing.probs_TE.new_zeros(())
        if cfg.gate.aux_loss_weight > 0 and balance:
            aux = aux + cfg.gate.aux_loss_weight * load_balancing_loss(
                routing.probs_TE, routing.expert_TK
            )
        if cfg.gate.z_loss_weight > 0:
            aux = aux + cfg.gate.z_loss_weight * router_z_loss(routing.logits_TE)
        count = self.training and not replaying()  # a recomputation (recompute.py) counts once
        if self.expert_load is not None and count:
            with torch.no_grad():
                self.expert_load += torch.bincount(
                    routing.expert_TK.reshape(-1), minlength=cfg.gate.num_experts
                )
        if self.record_routing and count:
            self.routing_total = tally(self.routing_total, routing)  # a new tensor per call
        return x_TM, routing, aux

    def region(self, meta) -> Region:
        """Step 3's region for one call: the chunk plan of `meta` under the running schedules."""
        return self.region_of(meta.plan, meta.dedup)

    def region_of(self, plan, dedup=None) -> Region:
        """The region of one call's chunk plan (and token deduplication, `Dedup`) under the
        running schedules."""
        return Region(
            plan,
            self.algorithm,
            self.forward_compressor,
            self.backward_compressor,
            self.experts,
            self._schedules[Direction.FORWARD],
            self._schedules[Direction.BACKWARD],
            self.background,
            self.shared,
            dedup,
        )

    def schedule(self, direction: Direction | str) -> tuple[TaskGraph, Schedule]:
        """The running region's (TaskGraph, Schedule) of `direction`."""
        if self._running is None:
            raise RuntimeError(
                f"this MoELayer (policy {self.config.schedule.policy!r}) is not configured yet"
            )
        return self._schedules[Direction(direction)]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 1-2. Route, and the tokens into the expert-major buffer (N rows known from T).
        x_TM, routing, aux = self._route(x)
        # (With token deduplication the dispatcher encodes, once it has read the counts.)
        rows_NM = None if self.dispatcher.dedup else encode(x_TM, routing)
        # 3. Splits, chunk plan, and the scheduled dispatch / experts / combine (forward and
        # backward): eager under torch.compile, the layer's one graph break (opaque.py).
        out_NM, s_TM = expert_parallel(self, rows_NM, x_TM, routing)
        # 4. Weighted sum back in token order (with dedup done already), plus the shared
        # experts' output.
        y_TM = out_NM if self.dispatcher.dedup else decode(out_NM, routing, x.dtype)
        y_TM = y_TM if s_TM is None else y_TM + s_TM
        return y_TM.view(x.shape), aux

    # ---------------------------------------------------------------- routing statistics
    def take_load_metrics(self) -> LoadMetrics | None:
        """This rank's load since the last take (training calls while `record_routing`), then
        reset; None if none. Tallied on the device per call (no sync); one host sync here."""
        total, taken = self.routing_total, self._routing_taken
        if total is None or total is taken:
            return None
        self._routing_taken = total
        counts = total if taken is None else total - taken
        return LoadMetrics.from_counts(counts.tolist())  # host sync

    # ---------------------------------------------------------------- state
    def _check_expert_slice(self, state_dict, prefix, local_metadata, *_) -> None:
        got = local_metadata.get("schemoe_experts")
        want = self.expert_shard()
        if got is not None and list(got) != want:
            first, n, E = got
            raise ValueError(
                f"{prefix or 'MoELayer'}: this state_dict holds experts {first}..{first + n - 1} "
                f"of {E} (one rank's shard), this layer holds {want[0]}..{want[0] + want[1] - 1} "
                f"of {want[2]}; save and load with schemoe.checkpoint.store (it reshards), or "
                "load_global_state(global_state())"
            )

    @torch.no_grad()
    def update_expert_bias(self, dp_group=None) -> None:
        """Aux-loss-free balancing step: nudge the selection bias using the load seen since the
        last call, summed over the expert-parallel group and `dp_group` (the expert-data-parallel
        group, so that every replica takes the same bias from the global load). Collective."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs GateConfig(bias_update_rate > 0)")
        load = self.expert_load.clone()
        if self.topology.world > 1:
            dist.all_reduce(load, group=self.topology.group)
        if dp_group is not None:
            dist.all_reduce(load, group=dp_group)
        self.expert_bias.copy_(
            update_balance_bias(self.expert_bias, load, self.config.gate.bias_update_rate)
        )
        self.expert_load.zero_()

    def _apply(self, fn, recurse=True):
        bias = self.expert_bias  # stays fp32 under .to(bf16), as transformers keeps DeepSeek-V3's:
        super()._apply(fn, recurse)  # bf16 would round its small steps away
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(self.expert_bias.device, torch.float32)
        return self

    def expert_shard(self) -> list[int]:
        """[first global expert held here, how many, E]: what a state_dict records."""
        return [self.expert_slice().start, self.num_local, self.config.gate.num_experts]

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
