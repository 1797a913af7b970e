"""Configuration: frozen, keyword-only dataclasses validated on construction.

    MoEConfig(
        gate=GateConfig(num_experts=8, top_k=2, capacity_factor=1.25),
        experts=ExpertConfig(model_dim=512, hidden_dim=2048, activation="gelu"),
        schedule=ScheduleConfig(policy="schemoe", chunks=2),
        collective=CollectiveConfig(algorithm="pipe"),
        compression=CompressionConfig(forward="fp16"),
    )

Names of plug-ins (policy, algorithm, compressors) are checked against their registries when the
layer is built, so a plug-in registered after the config is made still works; unknown names raise
ValueError listing the known ones there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "CollectiveConfig",
    "CompressionConfig",
    "ExpertConfig",
    "GateConfig",
    "MoEConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "SharedExpertConfig",
    "field_default",
]

ACTIVATIONS = ("relu", "gelu", "swiglu")
EXPERT_IMPLS = ("grouped", "loop")
PRIORITIES = ("position", "score")
SCORES = ("softmax", "sigmoid")
GROUP_SCORES = ("top2", "max")
WEIGHTS_ON = ("output", "input")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    _need(v >= lo, f"{name} must be >= {lo}, got {v}")


def _num(name: str, v: Any, lo: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r}")
    _need(not math.isnan(v) and v >= lo, f"{name} must be >= {lo}, got {v}")


def _one_of(name: str, v: Any, choices: tuple[str, ...]) -> None:
    _need(v in choices, f"{name} must be one of {choices}, got {v!r}")


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name`, for a field elsewhere (a command's setting,
    a cost model's shape) that takes the layer's default: one place says what it is."""
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    """Router settings.

    Attributes:
        num_experts: E, experts in the layer (all ranks together).
        top_k: k, experts per token, 1 <= k <= E.
        capacity_factor: f; capacity C = ceil(f * k * T / E) rows per expert per rank, tokens past
            C are dropped. f = 0 means dropless: every token is kept and splits vary per call.
        renormalize: rescale each token's k weights to sum to 1.
        noise_std: std of Gaussian noise added to the router logits, in training only.
        priority: which tokens keep their slot when an expert overflows: "position" (earlier
            tokens first) or "score" (batch-prioritised routing: higher top-1 score first).
        aux_loss_weight: weight of the load-balancing loss (GShard/Switch form).
        z_loss_weight: weight of the router z-loss (ST-MoE).
        bias_update_rate: > 0 enables the aux-loss-free expert bias (DeepSeek-V3): a per-expert
            bias added to the scores for expert selection only, nudged by this rate towards
            balance each time `MoELayer.update_expert_bias()` is called.
        score: how logits become scores: "softmax" over the E experts (Mixtral, Qwen2/3-MoE) or
            an independent "sigmoid" per expert (DeepSeek-V3). The top-k weights are the chosen
            experts' scores, rescaled to sum to 1 when `renormalize` (Mixtral always, Qwen
            `norm_topk_prob`, DeepSeek-V3 `norm_topk_prob`), then multiplied by `scale`.
        groups: G, the experts split into G groups of E / G consecutive experts (DeepSeek-V3
            `n_group`); 1: no groups.
        top_groups: group-limited routing (DeepSeek-V3 `topk_group`): each token scores every
            group by the sum of its two highest (bias-corrected) expert scores, keeps the
            `top_groups` best groups and takes its top-k among their experts. None: all groups
            (plain top-k).
        scale: multiplies every combine weight (DeepSeek-V3 `routed_scaling_factor`), > 0.
        group_score: how group-limited routing scores a group: "top2" (the sum of its two
            highest selection scores, DeepSeek-V3) or "max" (its highest, DeepSeek-V2's
            group_limited_greedy).
        logit_bias: a learned per-expert bias added to the router logits (GPT-OSS's router
            bias): MoELayer.gate_bias [E], dense like the gate weight.
        weights_on: where a choice's weight applies: "output" (y = sum_j w_j expert_j(x), every
            family but one) or "input" (y = sum_j expert_j(w_j x), Llama 4).
    """

    num_experts: int
    top_k: int = 2
    capacity_factor: float = 1.25
    renormalize: bool = True
    noise_std: float = 0.0
    priority: str = "position"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    bias_update_rate: float = 0.0
    score: str = "softmax"
    groups: int = 1
    top_groups: int | None = None
    scale: float = 1.0
    group_score: str = "top2"
    logit_bias: bool = False
    weights_on: str = "output"

    def __post_init__(self) -> None:
        _int("num_experts", self.num_experts, 1)
        _int("top_k", self.top_k, 1)
        _need(
            self.top_k <= self.num_experts,
            f"top_k={self.top_k} must be <= num_experts={self.num_experts}",
        )
        _num("capacity_factor", self.capacity_factor, 0.0)
        _need(
            math.isfinite(self.capacity_factor),
            f"capacity_factor must be finite (0 for dropless), got {self.capacity_factor}",
        )
        _num("noise_std", self.noise_std, 0.0)
        _one_of("priority", self.priority, PRIORITIES)
        _num("aux_loss_weight", self.aux_loss_weight, 0.0)
        _num("z_loss_weight", self.z_loss_weight, 0.0)
        _num("bias_update_rate", self.bias_update_rate, 0.0)
        self._check_routing()

    def _check_routing(self) -> None:
        _one_of("score", self.score, SCORES)
        _int("groups", self.groups, 1)
        E, G = self.num_experts, self.groups
        _need(E % G == 0, f"num_experts={E} must be divisible by groups={G}")
        if self.top_groups is not None:
            _int("top_groups", self.top_groups, 1)
            _need(self.top_groups <= G, f"top_groups={self.top_groups} must be <= groups={G}")
        reach = self.kept_groups * (E // G)
        _need(
            self.top_k <= reach,
            f"top_k={self.top_k} must be <= top_groups * num_experts / groups = {reach} (the "
            "experts a token can reach)",
        )
        _need(
            self.group_score in GROUP_SCORES,
            f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}",
        )
        _need(
            self.weights_on in WEIGHTS_ON,
            f"weights_on must be one of {WEIGHTS_ON}, got {self.weights_on!r}",
        )
        if not isinstance(self.logit_bias, bool):
            raise TypeError(f"logit_bias must be a bool, got {self.logit_bias!r}")
        _num("scale", self.scale, 0.0)
        _need(
            math.isfinite(self.scale) and self.scale > 0,
            f"scale must be > 0 and finite, got {self.scale}",
        )

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == 0

    @property
    def kept_groups(self) -> int:
        """The groups each token keeps: top_groups, or all G."""
        return self.groups if self.top_groups is None else self.top_groups


@dataclass(frozen=True, kw_only=True)
class ExpertConfig:
    """The built-in expert FFN: y = W2 act(W1 x) (swiglu: W2 (silu(W1 x) * W3 x)).

    Attributes:
        impl: how the local experts run: "grouped" (rows sorted by expert, one grouped matmul
            per projection, `torch._grouped_mm` where the build has it, see
            schemoe.experts.grouped) or "loop" (one matmul per expert and projection). Same
            weights and results either way; "grouped" is the default: on this project's CPU it
            is 1-2% faster than the loop in dropless mode at E=8 k=2 and E=64 k=6, and it is
            the path torch's grouped kernels speed up on GPUs (docs/usage.md).
    """

    model_dim: int
    hidden_dim: int
    activation: str = "gelu"
    bias: bool = False
    impl: str = "grouped"

    def __post_init__(self) -> None:
        _int("model_dim", self.model_dim, 1)
        _int("hidden_dim", self.hidden_dim, 1)
        _one_of("activation", self.activation, ACTIVATIONS)
        _one_of("experts impl", self.impl, EXPERT_IMPLS)


SHARED_PLACEMENTS = ("scheduled", "before")


@dataclass(frozen=True, kw_only=True)
class SharedExpertConfig:
    """Always-on (shared) experts: every token goes through them, added to the routed output
    (Qwen2-MoE, DeepSeek-V2/V3). Their compute is one task of the layer's schedule ("S"), with
    no dependency on the all-to-alls, so a policy runs it while they are on the wire.

    Attributes:
        num: shared experts; n experts of hidden dim H sum to one FFN of hidden dim n H, which
            is how they run (one task, three or two GEMMs).
        hidden_dim: H of each shared expert (the activation is the routed experts').
        gated: scale the output by sigmoid(x w_g), w_g [M, 1] (Qwen2-MoE's shared_expert_gate).
        placement: "scheduled" (the policy places the task: every built-in one right after the
            dispatch all-to-alls are posted, under them; its backward under the backward
            exchanges) or "before" (first, before any dispatch transfer starts: no overlap, as
            running it outside the layer; for comparison).
    """

    num: int = 1
    hidden_dim: int
    gated: bool = False
    placement: str = "scheduled"

    def __post_init__(self) -> None:
        _int("shared num", self.num, 1)
        _int("shared hidden_dim", self.hidden_dim, 1)
        _one_of("shared placement", self.placement, SHARED_PLACEMENTS)

    @property
    def total_hidden(self) -> int:
        """num x hidden_dim: the hidden dim of the one FFN the shared experts make."""
        return self.num * self.hidden_dim


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Expert-parallel layout. ranks_per_node overrides the launcher's LOCAL_WORLD_SIZE, so tests
    can treat 4 local ranks as 2 nodes x 2. uniform_tokens declares that every rank of the group
    routes the same number of tokens at every call (the usual training case): in capacity mode
    the all-to-all splits then follow from the config, with no counts exchange and no host sync
    (see schemoe.layer.dispatcher); a wrong declaration makes the all-to-alls' splits disagree.

    dedup (dropless routing, weights on the experts' outputs): every all-to-all carries a token
    once per rank holding any of its chosen experts, not once per expert: that rank copies it to
    those experts and returns their weighted sum (schemoe.routing.dedup). Rows moved: T x
    (ranks reached) instead of T k, at E=64 k=6 on 2 ranks a third. Same results up to the
    order of the sums over a token's experts."""

    ranks_per_node: int | None = None
    uniform_tokens: bool = False
    dedup: bool = False

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None:
            _int("ranks_per_node", self.ranks_per_node, 1)
        if not isinstance(self.uniform_tokens, bool):
            raise TypeError(f"uniform_tokens must be a bool, got {self.uniform_tokens!r}")
        if not isinstance(self.dedup, bool):
            raise TypeError(f"dedup must be a bool, got {self.dedup!r}")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Task scheduling: the policy that orders the tasks and r, the number of chunks.

    policy="auto" is resolved by a tuner (`schemoe.tuning.auto.AutoTuner`, which `schemoe train`
    and `schemoe bench` attach): on the layer's first call the cost model chooses policy, r,
    all-to-all algorithm and compressors within accuracy_budget: "lossless" (no compression),
    "fp16" (none/fp16/bf16) or "lossy" (every compressor). With trials > 0 the model shortlists
    the `shortlist` most promising configurations and the layer's first shortlist x (trials + 1)
    calls run them in turn, timed; the fastest measured one is kept. trials=0: the model's first
    choice, unmeasured. policy="search" takes its cost model from the same tuner.

    The default, policy="schemoe" with chunks=2, is what `schemoe train` runs: it overlaps each
    chunk's all-to-alls with the other chunk's experts in forward and backward (the ordering of
    Theorem 1 of the ScheMoE paper) at the cost of one extra, smaller GEMM per expert, and
    computes the same result as policy="sequential", chunks=1 (no overlap, the GShard/DeepSpeed
    order; the reference the tests compare every policy against). On one process there is no
    transfer to hide and sequential r=1 is slightly cheaper."""

    policy: str = "schemoe"
    chunks: int = 2
    accuracy_budget: str = "lossless"
    trials: int = 5
    shortlist: int = 4

    def __post_init__(self) -> None:
        _need(
            isinstance(self.policy, str) and bool(self.policy),
            f"policy must be a name, got {self.policy!r}",
        )
        _int("chunks", self.chunks, 1)
        budgets = ("lossless", "fp16", "lossy")
        _one_of("accuracy_budget", self.accuracy_budget, budgets)
        _int("trials", self.trials, 0)
        _int("shortlist", self.shortlist, 1)


@dataclass(frozen=True, kw_only=True)
class CollectiveConfig:
    """The all-to-all algorithm. How long a transfer may take before it raises is the process
    group's timeout (`init_process_group(timeout=...)`), which bounds every collective."""

    algorithm: str = "naive"

    def __post_init__(self) -> None:
        _need(
            isinstance(self.algorithm, str) and bool(self.algorithm),
            f"algorithm must be a name, got {self.algorithm!r}",
        )


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Compressors for the all-to-all payloads, chosen separately for activations (forward) and
    gradients (backward). options maps a compressor name to its keyword arguments, e.g.
    {"zfp": {"rate": 4}}."""

    forward: str = "none"
    backward: str = "none"
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n in ("forward", "backward"):
            v = getattr(self, n)
            _need(isinstance(v, str) and bool(v), f"compression.{n} must be a name, got {v!r}")
        if not isinstance(self.options, Mapping):
            raise TypeError(f"compression.options must be a mapping, got {self.options!r}")
        for name, kwargs in self.options.items():
            if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
                raise TypeError(
                    f"compression.options[{name!r}] must map option names to values, e.g. "
                    f'{{"zfp": {{"rate": 4}}}}, got {kwargs!r}'
                )


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Everything that defines one MoE layer."""

    gate: GateConfig
    experts: ExpertConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    shared: SharedExpertConfig | None = None  # always-on experts, a scheduled task (None: none)

    def summary(self) -> dict:
        """{policy, chunks, algorithm, compression}: what a layer runs, in one line."""
        f, b = self.compression.forward, self.compression.backward
        return {
            "policy": self.schedule.policy,
            "chunks": self.schedule.chunks,
            "algorithm": self.collective.algorithm,
            "compression": f if f == b else f"{f}/{b}",
        }

    def __post_init__(self) -> None:
        for name, typ in (
            ("gate", GateConfig),
            ("experts", ExpertConfig),
            ("parallel", ParallelConfig),
            ("schedule", ScheduleConfig),
            ("collective", CollectiveConfig),
            ("compression", CompressionConfig),
        ):
            v = getattr(self, name)
            if not isinstance(v, typ):
                raise TypeError(
                    f"MoEConfig.{name} must be a {typ.__name__}, got {type(v).__name__}"
                )
        if self.shared is not None and not isinstance(self.shared, SharedExpertConfig):
            raise TypeError(
                f"MoEConfig.shared must be a SharedExpertConfig or None, "
                f"got {type(self.shared).__name__}"
            )
        if self.parallel.dedup and not self.gate.dropless:
            raise ValueError(
                f"parallel.dedup needs dropless routing (gate.capacity_factor=0), got "
                f"capacity_factor={self.gate.capacity_factor}"
            )
        if self.parallel.dedup and self.gate.weights_on != "output":
            raise ValueError(
                f"parallel.dedup needs the weights on the experts' outputs (a token's copies "
                f"must be equal), got gate.weights_on={self.gate.weights_on!r}"
            )
