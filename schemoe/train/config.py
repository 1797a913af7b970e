"""TrainConfig: every setting of a `schemoe train` run, frozen and validated, built once.

    cfg = TrainConfig.from_args(parse_args(argv))      # the command line
    cfg = TrainConfig(steps=100, experts=8, device="cpu")   # or from Python
    cfg.validate(world)      # what needs the rank count, the files and the installed packages
    train(rank, world, cfg)

One validation path: construction checks every value (types, ranges, plug-in names, the model's
shape, the MoEConfig and compression options it builds); `validate(world)` adds what depends on
the machine (the rank count, --device cuda, optional packages, the corpus, the paths).
`schemoe train` runs both before any rank starts. Nothing mutates a TrainConfig: what a run
resolves later (--micro-chunks auto's m, the default expert count) is a `dataclasses.replace`
copy. Field names are the command line's (`grad_accum` is --grad-accum), and every error names
the flag and value as typed; MoEConfig's own errors are spelled with the flags by `MOE_FLAGS`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .. import compression
from .. import config as layer_config
from ..cliargs import for_flag
from ..collectives import ALGORITHMS
from ..scheduling import POLICIES
from ..step.gradsync import COMPRESS, GRAD_SYNCS, SYNCS
from ..tuning.replan import EVERY, MAX_DROP
from .checks import check_corpus, check_machine, check_paths, check_settings
from .model import GPTConfig, corpus_size

__all__ = ["MOE_FLAGS", "TrainConfig", "flag", "spelled_with_flags"]

DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16")
# Namespace entries that are not settings: the sub-command, its function, the typed flags.
NOT_SETTINGS = ("func", "command", "explicit")

# Each MoEConfig section: its class and its fields (as its errors name them) -> the TrainConfig
# field (the flag). The MoEConfig is built from this table and its errors are spelled by it.
MOE_FLAGS: dict[str, tuple[type, dict[str, str]]] = {
    "gate": (layer_config.GateConfig, {
        "num_experts": "experts", "top_k": "top_k", "capacity_factor": "capacity_factor",
        "renormalize": "renormalize", "noise_std": "noise_std", "priority": "priority",
        "aux_loss_weight": "aux_loss_weight", "z_loss_weight": "z_loss_weight",
        "bias_update_rate": "bias_update_rate", "score": "score", "groups": "expert_groups",
        "top_groups": "top_groups", "scale": "routed_scale", "group_score": "group_score",
        "logit_bias": "router_bias", "weights_on": "weights_on"}),
    "experts": (layer_config.ExpertConfig, {
        "model_dim": "model_dim", "hidden_dim": "hidden_dim", "activation": "activation",
        "bias": "expert_bias", "impl": "experts_impl"}),
    "parallel": (layer_config.ParallelConfig, {
        "ranks_per_node": "ranks_per_node", "uniform_tokens": "uniform_tokens", "dedup": "dedup"}),
    "schedule": (layer_config.ScheduleConfig, {
        "policy": "policy", "chunks": "chunks", "accuracy_budget": "budget", "trials": "trials",
        "shortlist": "shortlist"}),
    "collective": (layer_config.CollectiveConfig, {"algorithm": "algorithm"}),
    "compression": (layer_config.CompressionConfig, {
        "forward": "compressor", "backward": "compressor_backward",
        "options": "compressor_option"}),
}  # fmt: skip
# Lower bounds: ints, then floats (name, low, high, low is strict).
INT_MIN = (("nproc", 1), ("steps", 1), ("batch", 1), ("grad_accum", 1), ("seq_len", 1),
           ("layers", 1), ("heads", 1), ("moe_every", 1), ("ep_size", 1), ("experts", 1),
           ("model_dim", 1), ("hidden_dim", 1), ("top_k", 1), ("chunks", 1), ("trials", 0),
           ("shortlist", 1), ("ranks_per_node", 1), ("save_every", 0), ("eval_every", 0),
           ("eval_seqs", 0), ("warmup", 0), ("stop_after", 0), ("log_every", 1), ("threads", 1),
           ("corpus_bytes", 10_000), ("shared_experts", 0), ("replan_every", 1))  # fmt: skip
FLOAT_RANGE = (("lr", 0.0, math.inf, True), ("min_lr_ratio", 0.0, 1.0, False),
               ("weight_decay", 0.0, math.inf, False), ("clip", 0.0, math.inf, False),
               ("timeout", 0.0, 1e9, True),  # beyond ~30 years timedelta overflows
               ("replan_max_drop", 0.0, 0.99, False))  # fmt: skip
CHOICES = {"device": DEVICES, "dtype": DTYPES, "grad_sync": SYNCS,
           "grad_compressor": tuple(sorted(COMPRESS)), "grad_algorithm": tuple(GRAD_SYNCS.names())}  # fmt: skip
# What --fsdp needs of other settings (what it cannot do yet): FSDP reduces the dense gradients
# itself (no DDP bucket, hook or scheduled sync), the micro-chunk stack calls blocks' parts
# outside their FSDP hooks. (Checkpoints write the DTensors through DCP.)
FSDP_NEEDS = {"grad_sync": "ddp", "grad_compressor": "none", "bucket_mb": None, "micro_chunks": 1}
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
TUPLES = {"compressor_option": ((str,), "strings"),
          "replan_capacity_factors": ((int, float), "numbers")}  # fmt: skip


def flag(name: str) -> str:
    """The command-line spelling of setting `name`."""
    return "--" + name.replace("_", "-")


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _options(items: tuple[str, ...]) -> dict[str, dict]:
    """("zfp.rate=4", ...) -> {"zfp": {"rate": 4}}; values are JSON, else strings."""
    out: dict[str, dict] = {}
    for it in items:
        name, _, rest = it.partition(".")
        key, eq, val = rest.partition("=")
        if not (name and key and eq):
            raise ValueError(f"--compressor-option must look like NAME.KEY=VALUE, got {it!r}")
        try:
            val = json.loads(val)
        except json.JSONDecodeError:
            pass  # a plain string
        out.setdefault(name, {})[key] = val
    return out


def spelled_with_flags(e: Exception, names: Mapping[str, str], section: str) -> Exception:
    """`e` with every config field it names spelled as its flag: "top_k=9 must be <=
    num_experts=4" -> "--top-k 9 must be <= --experts 4"."""
    text = str(e)
    for name in sorted(names, key=len, reverse=True):
        at = rf"(?<![\w.-])(?:{section}\.)?{name}"
        text = re.sub(at + "=", flag(names[name]) + " ", text)
        text = re.sub(at + r"\b", flag(names[name]), text)
    return type(e)(text)


def _layer(setting: str) -> Any:
    """The default of the MoEConfig field that MOE_FLAGS maps TrainConfig field `setting` to,
    as that field's default (the layer's defaults and the command line's are one)."""
    cls, name = next((c, n) for c, names in MOE_FLAGS.values() for n, s in names.items()
                     if s == setting)  # fmt: skip
    return layer_config.field_default(cls, name)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every `schemoe train` setting; the defaults are the command line's (see `--help`), and
    those of the layer's and the model's settings are the MoEConfig's and the GPTConfig's."""

    nproc: int = 4
    steps: int = 40
    batch: int = 8
    grad_accum: int = 1
    seq_len: int = layer_config.field_default(GPTConfig, "seq_len")
    layers: int = layer_config.field_default(GPTConfig, "layers")
    heads: int = layer_config.field_default(GPTConfig, "heads")
    moe_every: int = layer_config.field_default(GPTConfig, "moe_every")
    ep_size: int | None = None
    device: str = field(default_factory=_default_device)
    dtype: str = "fp32"
    model_dim: int = 128
    hidden_dim: int = 256
    experts: int | None = None
    top_k: int = _layer("top_k")
    capacity_factor: float = _layer("capacity_factor")
    renormalize: bool = _layer("renormalize")
    noise_std: float = _layer("noise_std")
    priority: str = _layer("priority")
    aux_loss_weight: float = _layer("aux_loss_weight")
    z_loss_weight: float = _layer("z_loss_weight")
    bias_update_rate: float = _layer("bias_update_rate")
    score: str = _layer("score")
    expert_groups: int = _layer("expert_groups")
    top_groups: int | None = _layer("top_groups")
    routed_scale: float = _layer("routed_scale")
    group_score: str = _layer("group_score")
    router_bias: bool = _layer("router_bias")
    weights_on: str = _layer("weights_on")
    activation: str = _layer("activation")
    expert_bias: bool = _layer("expert_bias")
    experts_impl: str = _layer("experts_impl")
    shared_experts: int = 0  # always-on experts of hidden dim hidden_dim (MoEConfig.shared)
    ranks_per_node: int | None = _layer("ranks_per_node")
    uniform_tokens: bool = True  # not the layer's False: every rank routes batch x seq_len
    dedup: bool = _layer("dedup")
    policy: str = _layer("policy")
    chunks: int = _layer("chunks")
    micro_chunks: int | str = layer_config.field_default(GPTConfig, "micro_chunks")
    auto_step: bool = False
    activation_checkpointing: bool = False
    budget: str = _layer("budget")
    trials: int = _layer("trials")
    shortlist: int = _layer("shortlist")
    replan: bool = False
    replan_every: int = EVERY
    replan_capacity_factors: tuple[float, ...] = ()  # Replanner(capacity_factors, max_drop)
    replan_max_drop: float = MAX_DROP
    algorithm: str = _layer("algorithm")
    compressor: str = _layer("compressor")
    compressor_backward: str = _layer("compressor_backward")
    compressor_option: tuple[str, ...] = ()
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 20
    eval_seqs: int = 64
    seed: int = 0
    corpus: str | None = None
    corpus_bytes: int = 4_000_000
    grad_sync: str = "ddp"
    grad_compressor: str = "none"
    grad_algorithm: str = "flat"
    bucket_mb: float | None = None
    fsdp: bool = False
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    stop_after: int | None = None
    export: str | None = None
    plot: str | None = None
    log_every: int = 5
    log_file: str | None = None
    tensorboard: str | None = None
    check_finite: bool = False
    allow_unverified_checkpoint: bool = False
    threads: int = 1
    timeout: float = 600.0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> TrainConfig:
        """The settings of parsed `schemoe train` arguments (validated on construction)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(vars(a)) - names - set(NOT_SETTINGS))
        if unknown:
            raise TypeError(f"TrainConfig has no setting {', '.join(map(flag, unknown))}")
        return cls(**{k: v for k, v in vars(a).items() if k in names})

    def __post_init__(self) -> None:
        for n in TUPLES:
            object.__setattr__(self, n, tuple(getattr(self, n)))
        self._check_types()
        check_settings(self)  # the ranges every command shares; --warmup vs --steps
        self._check_ranges()
        GPTConfig(seq_len=self.seq_len, layers=self.layers, heads=self.heads,
                  moe_every=self.moe_every)  # fmt: skip
        if self.model_dim % self.heads:
            raise ValueError(
                f"--model-dim {self.model_dim} must be divisible by --heads {self.heads}"
            )
        names = [("algorithm", ALGORITHMS)] + (
            [("policy", POLICIES)] if self.policy != "auto" else []
        )
        for n, registry in names:
            with for_flag(flag(n)):
                registry.get(getattr(self, n))  # ValueError listing the known names
        # Before the rank count is known the default E is unknown: one that fits top_k stands in.
        known = self.experts is not None or self.ep_size is not None
        self._moe(self.num_experts(None) if known else self.expert_groups * max(2, self.top_k))
        if self.ep_size is not None and self.experts is not None and self.experts % self.ep_size:
            raise ValueError(
                f"--experts {self.experts} must be divisible by --ep-size {self.ep_size}"
            )
        if self.grad_sync == "ddp" and self.grad_algorithm != "flat":
            raise ValueError(f"--grad-algorithm {self.grad_algorithm} needs --grad-sync scheduled")
        if self.fsdp and (bad := [f"{flag(n)} {getattr(self, n)}" for n, ok in FSDP_NEEDS.items()
                                  if getattr(self, n) != ok]):  # fmt: skip
            raise ValueError(f"--fsdp does not support {', '.join(bad)} yet: drop them or --fsdp")

    def _check_types(self) -> None:
        for f in fields(self):
            v, hint = getattr(self, f.name), str(f.type)
            if (v is None and "None" in hint) or f.name in (*TUPLES, "micro_chunks"):
                continue
            want = _TYPES[hint.split(" |")[0]]
            if isinstance(v, bool) != (bool in want) or not isinstance(v, want):
                raise TypeError(f"{flag(f.name)} must be {hint}, got {type(v).__name__} {v!r}")
        for n, (want, what) in TUPLES.items():
            if not all(isinstance(v, want) and not isinstance(v, bool) for v in getattr(self, n)):
                raise TypeError(f"{flag(n)} takes {what}, got {getattr(self, n)!r}")
        for n, allowed in CHOICES.items():
            if getattr(self, n) not in allowed:
                raise ValueError(f"{flag(n)} must be one of {allowed}, got {getattr(self, n)!r}")

    def _check_ranges(self) -> None:
        for n, lo in INT_MIN:
            if (v := getattr(self, n)) is not None and v < lo:
                raise ValueError(f"{flag(n)} must be >= {lo}, got {v}")
        m = self.micro_chunks
        if m != "auto":
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"--micro-chunks must be an int >= 1 or auto, got {m!r}")
            if self.batch % m:
                raise ValueError(f"--batch {self.batch} must be divisible by --micro-chunks {m}")
        if self.auto_step and (self.policy in ("auto", "search") or m == "auto"):
            given = f"--policy {self.policy}" if m != "auto" else "--micro-chunks auto"
            raise ValueError(f"--auto-step chooses the policy, r and m itself: drop {given}")
        if (m == "auto" or m > 1) and self.policy in ("auto", "search"):
            raise ValueError(f"--micro-chunks {m} needs a fixed --policy, got {self.policy!r}")
        if (m == "auto" or m > 1) and self.shared_experts:  # the stack has no S task yet
            raise ValueError(f"--micro-chunks {m} cannot run --shared-experts yet; use 1")
        fs = self.replan_capacity_factors
        if fs and not (self.replan and self.capacity_factor > 0 and min(fs) > 0):
            raise ValueError(f"--replan-capacity-factors needs --replan, capacity mode "
                             f"(--capacity-factor > 0) and each f > 0, got {','.join(f'{f:g}' for f in fs)}")  # fmt: skip
        if (m == "auto" or m > 1) and self.replan:  # its calls bypass the layers' forward hooks
            raise ValueError(f"--micro-chunks {m} cannot run --replan yet; use 1")
        if (m == "auto" or m > 1) and self.activation_checkpointing:  # the stack runs its own
            raise ValueError(f"--micro-chunks {m} cannot run --activation-checkpointing yet; use 1")
        for n, lo, hi, strict in FLOAT_RANGE:
            v = getattr(self, n)
            if not (math.isfinite(v) and (v > lo if strict else v >= lo) and v <= hi):
                where = f"> {lo:g}" if strict else f">= {lo:g}"
                where += f" and <= {hi:g}" if math.isfinite(hi) else " and finite"
                raise ValueError(f"{flag(n)} must be {where}, got {v:g}")
        if self.bucket_mb is not None and not (
            math.isfinite(self.bucket_mb) and self.bucket_mb > 0
        ):
            raise ValueError(f"--bucket-mb must be > 0 and finite, got {self.bucket_mb:g}")

    def num_experts(self, world: int | None) -> int:
        """--experts, else 2 per expert-parallel rank (--ep-size, else every rank, else 2)."""
        if self.experts is not None:
            return self.experts
        return 2 * (self.ep_size or world or 1)

    def moe_config(self, world: int | None = None) -> layer_config.MoEConfig:
        """Every MoEConfig field (`world`: the rank count, for the default expert count)."""
        return self._moe(self.num_experts(world))

    def _moe(self, experts: int) -> layer_config.MoEConfig:
        """The MoEConfig with E = `experts`, built by MOE_FLAGS; an error names the flags."""
        sections = {"compression": self._compression()}
        for section, (cls, names) in MOE_FLAGS.items():
            if section == "compression":
                continue
            kwargs = {k: getattr(self, n) for k, n in names.items()}
            if section == "gate":
                kwargs["num_experts"] = experts
            try:
                sections[section] = cls(**kwargs)
            except (ValueError, TypeError) as e:
                raise spelled_with_flags(e, names, section) from None
        n = self.shared_experts
        shared = layer_config.SharedExpertConfig(num=n, hidden_dim=self.hidden_dim) if n else None
        try:
            return layer_config.MoEConfig(**sections, shared=shared)
        except (ValueError, TypeError) as e:  # across sections (--dedup with --capacity-factor)
            for section, (_, names) in MOE_FLAGS.items():
                e = spelled_with_flags(e, names, section)
            raise e from None

    def _compression(self) -> layer_config.CompressionConfig:
        """The compression section, after checking its options (every one names a compressor
        the run uses, unless --policy auto may choose others; an option it takes; a value of its
        type) and building the compressors the run names: an unknown name is blamed on its
        flag, an option on --compressor-option."""
        options = _options(self.compressor_option)  # ValueError naming --compressor-option
        used = (self.compressor, self.compressor_backward)
        for n in ("compressor", "compressor_backward"):
            with for_flag(flag(n)):
                compression.COMPRESSORS.get(getattr(self, n))
        with for_flag("--compressor-option"):
            compression.check_options(options, None if self.policy == "auto" else used)
        for n, name in zip(("compressor", "compressor_backward"), used, strict=True):
            with for_flag("--compressor-option" if options.get(name) else flag(n)):
                compression.build(name, options)  # ImportError: a package it needs is missing
        return layer_config.CompressionConfig(forward=used[0], backward=used[1], options=options)

    def validate(self, world: int | None) -> None:
        """What depends on the machine (`world`: the rank count, None when not known yet): the
        experts and --ranks-per-node over the ranks, --device cuda, the optional packages, the
        corpus (sized from its files' lengths, not read) and the paths (folders created)."""
        if world is not None:
            ep = self.ep_size or world
            if world % ep:
                raise ValueError(f"--ep-size {self.ep_size} must divide the {world} ranks")
            if self.num_experts(world) % ep:
                raise ValueError(
                    f"--experts {self.num_experts(world)} must be divisible by the {ep} "
                    "expert-parallel ranks"
                )
            if self.ranks_per_node is not None and world % self.ranks_per_node:
                raise ValueError(
                    f"--ranks-per-node {self.ranks_per_node} must divide the {world} ranks"
                )
            self.moe_config(world)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch.cuda.is_available() is False; use --device cpu")
        if self.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'schemoe[plot]'")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard")
        check_machine(self, world)  # cores, memory, --chunks' rows, the corpus is text
        check_corpus(corpus_size(self.corpus, self.corpus_bytes), seq_len=self.seq_len,
                     eval_seqs=self.eval_seqs, corpus_bytes=self.corpus_bytes)  # fmt: skip
        check_paths(**{k: getattr(self, k) for k in ("resume", "save", "export", "plot",
                                                     "log_file", "tensorboard")})  # fmt: skip

    def resolved(self, world: int, micro_chunks: int) -> TrainConfig:
        """This config with what the run resolved: E and --micro-chunks auto's m."""
        return dataclasses.replace(self, experts=self.num_experts(world), micro_chunks=micro_chunks)

    def settings(self) -> dict[str, Any]:
        """Every setting by name (JSON-ready: the checkpoint's "args")."""
        out = dataclasses.asdict(self)
        out |= {n: list(getattr(self, n)) for n in TUPLES}
        return out
