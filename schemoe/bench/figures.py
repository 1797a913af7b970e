"""Every figure of docs/results.md, docs/costmodel.md and docs/reliability.md as data: where it
runs, the commands that make it (argv after the Python executable), its raw output files and a
table maker (`schemoe.bench.tables`). `{out}` in an argument is the report's output folder,
`{home}` the figure's own empty HOME (`Step.fresh_home`: auto and --predict read the profile
store there).

The measured-bound figures (`step_bound_*`, `step_auto_400mbit_m512`) came after the full report
runs of 2026-12-04: their blocks were pasted from runs of their own (`--paste --only NAMES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from . import tables

__all__ = ["FIGURES", "Figure", "Step", "TestbedSpec", "by_name"]

CLI = ("-m", "schemoe.cli")


@dataclass(frozen=True)
class TestbedSpec:
    """The `schemoe testbed up` arguments of a figure."""

    rate: str
    nodes: int = 2
    intra_rate: str | None = None
    ranks_per_node: int | None = None
    intra_link: str | None = None

    def up_argv(self) -> list[str]:
        argv = [*CLI, "testbed", "up", "--nodes", str(self.nodes), "--rate", self.rate]
        if self.intra_rate:
            argv += ["--intra-rate", self.intra_rate, "--ranks-per-node", str(self.ranks_per_node)]
            argv += ["--intra-link", self.intra_link or "shared"]
        return argv

    def describe(self) -> str:
        return " ".join(self.up_argv()[4:])


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    out: str  # raw output file name in the report folder
    fresh_home: bool = False


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    where: TestbedSpec | None  # None: loopback on this host
    steps: tuple[Step, ...]
    minutes: float  # estimate: its wall time in the first full run on this 2-core box, +30%
    table: Callable[[Sequence[str]], tables.Table]
    committed: tuple[str | None, ...] = ()  # docs/results files a past run wrote, per step

    @property
    def outputs(self) -> list[str]:
        return [s.out for s in self.steps]


def _bench(kind: str, *flags: str, ranks_per_node: int = 2) -> tuple[str, ...]:
    return (*CLI, "bench", kind, "--testbed", "--ranks-per-node", str(ranks_per_node), *flags)


def _on_testbed(*argv: str, ranks_per_node: int = 2) -> tuple[str, ...]:
    return (*CLI, "testbed", "run", "--ranks-per-node", str(ranks_per_node), "--", *argv)


LAYER = ("--policies", "sequential,tutel,schemoe,fastermoe")
A2A_ALL = ("--algorithms", "naive,pairwise,pipe,hier2d,leader")
SEPARATE = TestbedSpec("300mbit", intra_rate="100mbit", ranks_per_node=2, intra_link="separate")
SHARED = TestbedSpec("300mbit", intra_rate="100mbit", ranks_per_node=2, intra_link="shared")
M256 = ("--model-dim", "256", "--hidden-dim", "512")
STEP = ("--grad-syncs", "ddp,scheduled", "--grad-compressors", "none,bf16", "--grad-algorithm", "hier")  # fmt: skip
COMPRESSORS = ("none", "fp16", "bf16", "fp8", "int8", "zfp")
AUTO_SHAPES = {1: (1024, 256, 1024, 8), 2: (2048, 256, 1024, 4), 3: (512, 512, 1024, 8), 4: (1024, 128, 512, 16)}  # fmt: skip
COST_SHAPES = {1: (1024, 256, 1024, 8), 2: (512, 256, 2048, 8), 3: (2048, 128, 512, 8), 4: (1024, 512, 512, 4)}  # fmt: skip


def _shape(t: int, m: int, h: int, e: int) -> tuple[str, ...]:
    return ("--tokens", str(t), "--model-dim", str(m), "--hidden-dim", str(h), "--experts", str(e))


def _step_figure(name: str, stem: str, title: str, rate: str, flags: tuple[str, ...],
                 minutes: float, validate: bool) -> Figure:  # fmt: skip
    """bench step on the testbed (to STEM.txt), then (validate=True) a profile at its shape and
    validate."""
    bench = Step(_bench("step", *flags), f"{stem}.txt")
    steps = [bench]
    if validate:
        prof = f"{{out}}/{stem}.profile.json"
        steps.append(Step(_on_testbed(*CLI, "profile", "--link-rate", rate, "--path", prof,
                                      "--model-dim", "128", "--hidden-dim", "256", "--tokens",
                                      "512", "--experts", "8"), f"{stem}.profile.txt"))  # fmt: skip
        steps.append(Step((*CLI, "validate", f"{{out}}/{stem}.txt={prof}"), f"{stem}.validate.txt"))  # fmt: skip
    return Figure(name, title, TestbedSpec(rate), tuple(steps), minutes, tables.step,
                  tuple(s.out for s in steps))  # fmt: skip


def _transfer_figures() -> list[Figure]:
    """The all-to-all algorithms and the layer on the shaped testbeds."""
    return [
        Figure("layer_400mbit", "One MoE layer, forward + backward, 400 Mbit/s (results.md)",
               TestbedSpec("400mbit"),
               (Step(_bench("layer", *LAYER, "--algorithms", "naive,pipe", "--chunks", "1,2,4",
                            "--peer", "deepspeed", "--repeats", "6"), "layer_2node_400mbit.txt"),),
               3, tables.layer_vs_baseline, ("layer_2node_400mbit.txt",)),
        Figure("a2a_2gbit", "All-to-all algorithms, 2 Gbit/s (results.md)", TestbedSpec("2gbit"),
               (Step(_bench("a2a", *A2A_ALL, "--sizes", "256K,2M,8M,32M", "--repeats", "7"),
                     "a2a_2node_2gbit.txt"),), 1, tables.a2a, ("a2a_2node_2gbit.txt",)),
        Figure("a2a_10gbit", "All-to-all algorithms, 10 Gbit/s (results.md, in the text)",
               TestbedSpec("10gbit"),
               (Step(_bench("a2a", *A2A_ALL, "--sizes", "2M,8M,32M", "--repeats", "7"),
                     "a2a_2node_10gbit.txt"),), 1, tables.a2a, ("a2a_2node_10gbit.txt",)),
        Figure("a2a_separate", "Pipe-A2A's regime: both links shaped, separate rank links (results.md)",
               SEPARATE,
               (Step(_bench("a2a", *A2A_ALL, "--sizes", "2M,8M,32M", "--repeats", "7",
                            "--timeout", "900"), "a2a_2node_300mbit_intra100mbit_separate.txt"),),
               5, tables.a2a, ("a2a_2node_300mbit_intra100mbit_separate_run1.txt",)),
        Figure("a2a_shared", "The same with --intra-link shared (results.md)", SHARED,
               (Step(_bench("a2a", *A2A_ALL, "--sizes", "2M,8M,32M", "--repeats", "7",
                            "--timeout", "900"), "a2a_2node_300mbit_intra100mbit_shared.txt"),),
               9, tables.a2a, ("a2a_2node_300mbit_intra100mbit_shared.txt",)),
        Figure("layer_separate", "The layer on the separate-links testbed (results.md)", SEPARATE,
               (Step(_bench("layer", *LAYER, "--algorithms", "naive,pipe,pairwise", "--chunks",
                            "1,2,4", "--repeats", "5", "--timeout", "1200"),
                     "layer_2node_300mbit_intra100mbit_separate.txt"),),
               4, tables.layer_per_algorithm,
               ("layer_2node_300mbit_intra100mbit_separate_run1.txt",)),
        Figure("layer_compress_200mbit", "Compression in the layer, 200 Mbit/s (results.md)",
               TestbedSpec("200mbit"),
               (Step(_bench("layer", "--policies", "tutel,schemoe", "--compressors",
                            "none,fp16,int8,zfp/none", "--chunks", "2,4", "--repeats", "5"),
                     "layer_compress_2node_200mbit.txt"),),
               2, tables.layer_compress, ("layer_compress_2node_200mbit.txt",)),
    ]  # fmt: skip


def _step_figures() -> list[Figure]:
    """Training accuracy, whole steps, and training on the testbed."""
    return [
        Figure("train_compress_accuracy", "Training accuracy with compressed all-to-alls (results.md)",
               None,
               tuple(Step((*CLI, "train", "--nproc", "2", "--steps", "60", "--compressor", c,
                           "--compressor-backward", c), f"train_compress_{c}.txt")
                     for c in COMPRESSORS),
               2, partial(tables.train_compress, names=COMPRESSORS)),
        _step_figure("step_300mbit", "step_2node_300mbit", "Whole training steps, 300 Mbit/s (results.md)", "300mbit",
                     ("--policies", "schemoe", "--chunks", "4", *STEP, "--peer", "deepspeed",
                      "--bucket-mb", "0.25", "--repeats", "7", "--trace", "{out}/step_trace"),
                     2, validate=True),
        _step_figure("step_200mbit", "step_2node_200mbit", "Whole steps, 200 Mbit/s, 1 MiB buckets (results.md, in the text)",
                     "200mbit",
                     ("--policies", "schemoe", "--chunks", "4", *STEP, "--peer", "deepspeed",
                      "--bucket-mb", "1", "--repeats", "7"), 2, validate=True),
        _step_figure("step_300mbit_chunks", "step_2node_300mbit_chunks", "Whole steps over r = 1, 2, 4 (results.md, in the text)",
                     "300mbit",
                     ("--policies", "schemoe", "--chunks", "1,2,4", *STEP, "--peer", "deepspeed",
                      "--bucket-mb", "0.25", "--repeats", "7"), 2, validate=False),
        Figure("step_600mbit_micro", "Whole steps with micro-chunks, 600 Mbit/s (results.md)",
               TestbedSpec("600mbit"),
               (Step(_bench("step", "--policies", "sequential,schemoe", "--chunks", "1,4",
                            "--micro-chunks", "1,2,4", *STEP, "--bucket-mb", "0.25", "--peer",
                            "deepspeed", "--repeats", "7", "--trace", "{out}/step_trace_600mbit"),
                     "step_2node_600mbit_micro.txt"),),
               9, tables.step_micro, ("step_2node_600mbit_micro.txt",)),
        _step_figure("step_600mbit_m256", "step_2node_600mbit_m256",
                     "Whole steps at the gradient-sync issue's shape, M=256 H=512, 600 Mbit/s (results.md)",
                     "600mbit",
                     ("--policies", "schemoe", "--chunks", "4", *STEP, "--peer", "deepspeed",
                      *M256, "--repeats", "5"), 2, validate=False),
        Figure("step_600mbit_m256_micro", "Whole steps with micro-chunks, M=256 H=512, 600 Mbit/s (results.md)",
               TestbedSpec("600mbit"),
               (Step(_bench("step", "--policies", "sequential,schemoe", "--chunks", "1",
                            "--micro-chunks", "1,2,4", *STEP, *M256, "--repeats", "5"),
                     "step_2node_600mbit_m256_micro.txt"),),
               4, tables.step_micro, ("step_2node_600mbit_m256_micro.txt",)),
        Figure("train_auto_100mbit", "Training on the testbed, auto vs sequential (results.md)",
               TestbedSpec("100mbit"),
               (Step(_on_testbed(*CLI, "profile", "--ranks-per-node", "2", "--model-dim", "256",
                                 "--hidden-dim", "512"), "train_testbed_100mbit.profile.txt", True),
                Step(_on_testbed("-m", "schemoe", "train", "--steps", "30", "--model-dim", "256",
                                 "--hidden-dim", "512", "--policy", "auto"),
                     "train_testbed_100mbit_auto.txt", True),
                Step(_on_testbed("-m", "schemoe", "train", "--steps", "30", "--model-dim", "256",
                                 "--hidden-dim", "512", "--policy", "sequential", "--chunks", "1"),
                     "train_testbed_100mbit_sequential.txt", True)),
               5, partial(tables.train_policies, names=("auto", "sequential")),
               (None, "train_testbed_100mbit_auto.txt", "train_testbed_100mbit_sequential.txt")),
    ]  # fmt: skip


def _cost_figures() -> list[Figure]:
    """The executor's overhead, the DeepSpeed compute reference, auto without a profile and the
    cost model against measured rows, per shape."""
    f = [
        Figure("overhead", "Executor overhead (results.md)", None,
               (Step(("-m", "schemoe.bench.overhead"), "overhead.txt"),), 1, tables.overhead),
        Figure("layer_vs_deepspeed_loopback", "Layer compute against DeepSpeed (reliability.md)",
               None,
               (Step((*CLI, "bench", "layer", "--nproc", "4", "--policies", "sequential", "--peer",
                      "deepspeed", "--repeats", "15"), "layer_vs_deepspeed_loopback.txt"),),
               1, tables.layer_vs_deepspeed, ("layer_vs_deepspeed_loopback_run1.txt",)),
    ]  # fmt: skip
    for i, shape in AUTO_SHAPES.items():
        f.append(Figure(
            f"auto_noprofile_shape{i}", f"auto with no profile on disk, shape {i} (costmodel.md)",
            TestbedSpec("400mbit"),
            (Step(_bench("layer", "--policies", "auto,schemoe,tutel", "--chunks", "1,2,4,8",
                         "--warmup", "2", "--repeats", "15", *_shape(*shape)),
                  f"auto_noprofile_400mbit_shape{i}.txt", True),),
            5, tables.auto_noprofile, (f"auto_noprofile_400mbit_shape{i}.txt",)))  # fmt: skip
    for i, shape in COST_SHAPES.items():
        prof = "{home}/.cache/schemoe/profiles.json"  # where bench --predict reads it
        f.append(Figure(
            f"costmodel_s{i}", f"simulated vs measured, shape s{i} (costmodel.md)",
            TestbedSpec("400mbit"),
            (Step(_on_testbed(*CLI, "profile", "--ranks-per-node", "2", *_shape(*shape)),
                  f"costmodel_s{i}.profile.txt", True),
             Step(_bench("layer", "--policies", "sequential,tutel,schemoe,fastermoe,auto",
                         "--algorithms", "naive,pipe", "--chunks", "1,2,4,8", *_shape(*shape),
                         "--warmup", "2", "--repeats", "11", "--predict"),
                  f"costmodel_s{i}.txt", True),
             Step((*CLI, "validate", f"{{out}}/costmodel_s{i}.txt={prof}"),
                  f"costmodel_s{i}.validate.txt", True)),
            8, tables.costmodel, (None, f"costmodel_s{i}.txt", None)))  # fmt: skip
    return f


# The candidates that cover issues 16/17's best rows at M=256 H=512 (baseline sequential r=1
# m=1 DDP fp32 first; m=4 never won there), each with its measured bound (bench/bound.py).
BOUND = ("--policies", "sequential,schemoe", "--chunks", "1,4", "--micro-chunks", "1,2", *STEP,
         "--peer", "deepspeed", "--repeats", "5", "--timeout", "1200", "--measured-bound")  # fmt: skip


def _priced(stem: str, k: int, shape: tuple[str, ...], bench: tuple[str, ...]) -> tuple[Step, ...]:
    """On the figure's testbed with k ranks per node: `schemoe profile` at the step's MoE shape
    (tokens = batch 8 x seq 64) into {out}/STEM.profile.json, bench step with --auto-step on
    it (to STEM.txt), then `schemoe validate` of its rows on it."""
    prof = f"{{out}}/{stem}.profile.json"
    return (
        Step(_on_testbed(*CLI, "profile", "--ranks-per-node", str(k), "--path", prof, *shape,
                         "--tokens", "512", ranks_per_node=k), f"{stem}.profile.txt"),
        Step(_bench("step", *bench, *shape, "--auto-step", "--profile", prof, ranks_per_node=k),
             f"{stem}.txt"),
        Step((*CLI, "validate", f"{{out}}/{stem}.txt={prof}"), f"{stem}.validate.txt"),
    )  # fmt: skip


def _bound_figure(rate: str) -> Figure:
    """bench step --measured-bound --auto-step at M=256 H=512 on one `rate` testbed: 2 nodes x 2
    ranks, then 2 nodes x 1 rank (a testbed without --intra-rate takes any ranks per node), each
    after a profile of its own topology and followed by `schemoe validate` on it."""
    stem = f"step_bound_{rate}_m256"
    steps = tuple(s for k in (2, 1) for s in _priced(f"{stem}_2x{k}", k, M256, BOUND))
    title = f"Whole steps against their measured bound, M=256 H=512, {rate[:-4]} Mbit/s"
    # minutes: 7.8 (600mbit) and 10.0 (200mbit) for the bench steps in their second run, +profiles
    return Figure(f"step_bound_{rate}_m256", title, TestbedSpec(rate), steps, 20,
                  partial(tables.step_bound, names=("2x2", "2x1")))  # fmt: skip


def _auto_step_figure() -> Figure:
    """auto's step choice on a shape nothing was tuned on (M=512 H=1024), 400 Mbit/s, 2 x 2."""
    stem = "step_auto_400mbit_m512"
    # 16 rows (schemoe at r = 1 is the sequential order): 32 models of this size, one per row,
    # on 4 ranks did not fit in this box's 23 GiB (a rank was killed in the first run)
    bench = ("--policies", "schemoe", "--chunks", "1,4", "--micro-chunks", "1,2", *STEP,
             "--repeats", "5", "--timeout", "1200")  # fmt: skip
    steps = _priced(f"{stem}_2x2", 2, ("--model-dim", "512", "--hidden-dim", "1024"), bench)
    return Figure(stem, "auto's step choice on an untuned shape, M=512 H=1024, 400 Mbit/s",
                  TestbedSpec("400mbit"), steps, 12, partial(tables.step_bound, names=("2x2",)))  # fmt: skip


FIGURES = [
    *_transfer_figures(),
    *_step_figures(),
    *_cost_figures(),
    _bound_figure("600mbit"),
    _bound_figure("200mbit"),
    _auto_step_figure(),
]


def by_name(names: Sequence[str]) -> list[Figure]:
    """The figures named, in FIGURES' order; unknown names: ValueError naming them and the known."""
    known = {f.name: f for f in FIGURES}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown figure(s) {', '.join(bad)}; known: {', '.join(known)}")
    return [f for f in FIGURES if f.name in names]
