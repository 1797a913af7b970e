"""`schemoe train --micro-chunks m`: the blocks run as a wavefront stack (schemoe/stack.py) and,
dropless, the losses follow m = 1's."""

from __future__ import annotations

import math

import pytest

from schemoe.train import loop as T
from schemoe.train.plan import candidates
from train_cases import tiny

# Dropless (default aux loss weight): the same arithmetic up to the order of floating-point sums.
DROPLESS = ["--capacity-factor", "0", "--steps", "4"]


def _run(rank, world, extra):
    return T.train(rank, world, tiny(*extra))


def test_training_with_micro_chunks_follows_the_losses_of_one_micro_chunk(ranks):
    # The scheduled gradient sync: its Background queue is handed to the stack's executor.
    one = ranks(2).run(_run, [*DROPLESS, "--grad-sync", "scheduled"])[0]
    four = ranks(2).run(_run, [*DROPLESS, "--grad-sync", "scheduled", "--micro-chunks", "4"])[0]
    assert four["micro_chunks"] == 4 and one["micro_chunks"] == 1
    # Rounding differences (a few fp32 ulps per sum) grow through 4 Adam steps to ~1e-6
    # relative here; 5 significant digits is 1e-5 relative.
    for a, b in zip(four["losses"], one["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (four["losses"], one["losses"])
    assert math.isclose(four["eval_loss"], one["eval_loss"], rel_tol=1e-5)


@pytest.mark.parametrize("bad", ["0", "-1", "x"])
def test_micro_chunks_takes_auto_or_an_int_of_at_least_one(bad):
    assert tiny("--micro-chunks", "auto").micro_chunks == "auto"
    assert tiny("--micro-chunks", "2").micro_chunks == 2
    want = repr(int(bad)) if bad != "x" else repr(bad)
    with pytest.raises(ValueError, match=f"--micro-chunks must be an int >= 1 or auto, got {want}"):
        tiny("--micro-chunks", bad)


def test_micro_chunks_auto_needs_a_fixed_policy():
    with pytest.raises(ValueError, match="--micro-chunks auto needs a fixed --policy, got 'auto'"):
        tiny("--micro-chunks", "auto", "--policy", "auto")


def test_micro_chunks_auto_chooses_m_by_the_stack_model_the_same_on_every_rank(ranks):
    # No profile on disk (the tests' empty HOME): a quick one is measured, as --policy auto does.
    out = ranks(2).run(_run, ["--steps", "2", "--micro-chunks", "auto"])
    for r in out:
        auto = r["micro_chunks_auto"]
        preds = {int(m): ms for m, ms in auto["predicted_ms"].items()}
        assert set(preds) == {1, 2, 4}  # the candidates dividing --batch 4
        assert auto["chosen"] == r["micro_chunks"] == min(preds, key=lambda m: (preds[m], m))
        assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])
    assert out[0]["micro_chunks_auto"] == out[1]["micro_chunks_auto"]


# ------------------------------------------------------------------ --auto-step
def test_auto_step_refuses_a_policy_or_m_it_would_choose_itself():
    with pytest.raises(
        ValueError, match="--auto-step chooses the policy, r and m itself: drop --policy auto"
    ):
        tiny("--auto-step", "--policy", "auto")
    with pytest.raises(ValueError, match="drop --micro-chunks auto"):
        tiny("--auto-step", "--micro-chunks", "auto")


def test_auto_step_candidates_are_what_the_run_can_run():
    plans = candidates(tiny("--auto-step"), world=2, ep=2)
    assert {p.micro_chunks for p in plans} == {1, 2, 4}  # dividing --batch 4
    assert {p.grad_sync for p in plans} == {"ddp", "scheduled"}
    assert not [p for p in plans if p.policy == "fastermoe" and p.chunks > 2]  # 2 peer groups
    assert {p.grad_compress for p in plans} == {"none"}
    alone = candidates(tiny("--auto-step", "--shared-experts", "1"), world=2, ep=2)
    assert {p.micro_chunks for p in alone} == {1}  # the stack has no shared-expert task
    assert {p.grad_sync for p in candidates(tiny("--auto-step"), world=1, ep=1)} == {"ddp"}


def test_auto_step_builds_the_models_plan_the_same_on_every_rank(ranks):
    # No profile on disk (the tests' empty HOME): a quick one is measured, as --policy auto does.
    out = ranks(2).run(_run, ["--steps", "2", "--auto-step"])
    for r in out:
        auto = r["auto_step"]
        preds = auto["predicted_ms"]
        assert auto["chosen"] == min(preds, key=preds.get)  # the fastest predicted
        plan = auto["plan"]
        got = {k: r[k] for k in ("policy", "chunks", "micro_chunks", "grad_sync")}
        assert got == {k: plan[k] for k in got}
        assert auto["reason"].startswith(f"{auto['chosen']}: predicted")
        assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])
    assert out[0]["auto_step"] == out[1]["auto_step"]
