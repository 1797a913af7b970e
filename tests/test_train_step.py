"""`schemoe train` and `schemoe bench step` run one training step (schemoe/train/step.py): the
same function object, called by both, giving the same losses for the same set-up; and the step
itself: accumulation equals the larger batch, a non-finite loss skips the optimizer step."""

from __future__ import annotations

import math

import pytest
import torch

from schemoe.bench import step as bench_step
from schemoe.train import loop as T
from schemoe.train import step as S
from schemoe.train.model import GPT, GPTConfig
from schemoe.train.setup import optimizer, setup
from train_cases import tiny

# lr_at(step) == --lr at every step, so a bench sample (which sets no learning rate) takes the
# optimizer step schemoe train takes.
CONSTANT_LR = ("--warmup", "0", "--min-lr-ratio", "1", "--eval-seqs", "0")
# Dropless, no aux loss: each token's loss and gradient do not depend on the others in its call.
EXACT = ("--capacity-factor", "0", "--aux-loss-weight", "0")


def test_train_and_bench_step_hold_the_same_step_function():
    assert T.train_step is S.train_step
    assert bench_step.train_step is S.train_step


def test_train_and_a_bench_sample_both_call_it(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["grad_accum"])
        return S.train_step(*args, **kwargs)

    monkeypatch.setattr(T, "train_step", spy)
    monkeypatch.setattr(bench_step, "train_step", spy)
    T.train(0, 1, tiny("--steps", "1", "--eval-seqs", "0", "--grad-accum", "2"))
    core, opt = _tiny_model()
    x, y = _tokens(4)
    bench_step.timed_step(core, core, opt, lambda: (x, y), grad_accum=3)()
    assert calls == [2, 3]


def _train_then_bench(rank: int, world: int, extra: list[str]) -> tuple[list, list]:
    cfg = tiny("--steps", "3", *CONSTANT_LR, *extra)
    trained = T.train(rank, world, cfg)["losses"]
    run = setup(rank, world, cfg)  # the same seeds: the same model, optimizer and data stream
    sample = bench_step.timed_step(
        run.model, run.core, run.opt, run.next_batch, grad_accum=cfg.grad_accum, clip=cfg.clip,
        ep=run.ep,
    )  # fmt: skip
    return trained, [sample().loss for _ in range(3)]


@pytest.mark.parametrize(
    "extra",
    [[], ["--grad-accum", "2", "--ep-size", "1"]],  # ep 1 x dp 2: the experts' all-reduce runs
    ids=["ep2", "ep1-dp2-accum2"],
)
def test_bench_samples_reproduce_the_losses_of_schemoe_train_exactly(ranks, extra):
    for trained, benched in ranks(2).run(_train_then_bench, extra):
        assert len(trained) == 3 and benched == trained  # bitwise: same floats


def _tiny_model() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    core = GPT(GPTConfig(seq_len=32, layers=2, heads=2), tiny(*EXACT).moe_config(1), seed=0)
    return core, optimizer(core, 1e-3, 0.1)


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, 32), generator=g), torch.randint(0, 256, (n, 32), generator=g)


def test_two_micro_batches_of_b_take_the_step_of_one_batch_of_2b():
    x, y = _tokens(4)
    halves = iter([(x[:2], y[:2]), (x[2:], y[2:])])
    accum, accum_opt = _tiny_model()
    a = S.train_step(accum, accum, accum_opt, lambda: next(halves), None, clip=1.0, grad_accum=2)
    whole, whole_opt = _tiny_model()
    b = S.train_step(whole, whole, whole_opt, lambda: (x, y), None, clip=1.0)
    assert a.loss == pytest.approx(b.loss, rel=1e-6)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for p, q in zip(accum.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_non_finite_loss_skips_the_step_before_the_optimizer_steps():
    core, opt = _tiny_model()
    with torch.no_grad():
        core.embed.weight[0, 0] = float("nan")
    before = [p.detach().clone() for p in core.parameters()]
    x, y = _tokens(2)
    x[0, 0] = 0  # the token whose embedding is NaN
    rec = S.train_step(core, core, opt, lambda: (x, y), None, clip=1.0)
    assert rec.skipped and math.isnan(rec.loss) and math.isnan(rec.grad_norm)
    for p, q in zip(core.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
    assert not opt.state  # AdamW never stepped
