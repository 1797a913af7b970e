"""Every converted Hugging Face MoE family (schemoe.integrations.hf_families) against the
unmodified model: logits, loss and every parameter gradient in fp32 at the family's default
initialisation and at std 0.5, on one process and expert-parallel on two ranks; greedy
generation; the refusals and the report of replace_moe_blocks; the weight map.

Tolerance (fp32), as in tests/test_hf.py: the same products in another order move O(1) results by
a few ulps times sqrt(terms), ~1e-6 (measured: logits <= 3e-7, gradients <= 1.3e-6, see
docs/training.md); atol 2e-5 leaves >10x headroom, while a wrong routing choice, scale, bias,
weight layout or a dropped shared expert shows as an error of 1e-2 or more.

Training (5 AdamW steps, lr 1e-2, the loss falling ~25%): each step's loss on 2 ranks within
rel 1e-5 of the one-process unmodified model's (measured <= 3e-7, docs/training.md); AdamW
normalises each update, so rounding differences grow over the steps but stay ~1e-7 here, while
dense gradients left un-averaged move Qwen2-MoE's loss by 9.4e-3 (relative) within the 5 steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from schemoe.integrations.hf import from_hf_block, replace_moe_blocks
from schemoe.integrations.hf_families import (
    FAMILIES,
    REFUSED,
    family_of,
    from_moe_experts,
    to_moe_experts,
)
from schemoe.integrations.hf_tiny import (
    REFUSED_TINY,
    TINY,
    bf16_routing_mismatch,
    compare,
    same_greedy_tokens,
    tiny,
    train_steps,
)

ATOL = 2e-5


def _check(res: dict, what: str) -> None:
    assert res["blocks"] == 2, what
    for key in ("logits", "loss", "grads"):
        assert res[key] <= ATOL, f"{what}: {key} max|diff| {res[key]:.3e} > {ATOL}"


@pytest.mark.parametrize("std", [None, 0.5], ids=["default-init", "std0.5"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_a_converted_family_gives_the_logits_and_gradients_of_the_original(family, std):
    _check(compare(family, std), f"{family} std={std}")


def _two_ranks(rank: int, world: int, family: str) -> dict:
    torch.set_num_threads(1)
    return compare(family, 0.5, rank, world)


# Two ranks: the families that exercise each part of the conversion (gated and ungated shared
# experts, sigmoid group-limited routing with its selection bias and scale, the logit bias and
# per-expert modules, weights on the experts' inputs); scripts/hf_families.py measures every
# family on two ranks.
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss", "llama4"])
def test_a_converted_family_matches_the_original_expert_parallel_on_two_ranks(ranks, family):
    for rank, res in enumerate(ranks(2).run(_two_ranks, family)):
        _check(res, f"{family} rank {rank}/2")


def _train_two_ranks(rank: int, world: int, family: str) -> list[float]:
    return train_steps(family, 0.5, rank, world)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_five_adamw_steps_on_two_ranks_track_the_one_process_run_of_the_original(ranks, family):
    one = train_steps(family, 0.5)  # the unmodified model, both ranks' batches
    assert one[-1] < 0.9 * one[0], one  # the run moves: the comparison is not of a fixed point
    for rank, losses in enumerate(ranks(2).run(_train_two_ranks, family)):
        assert losses == pytest.approx(one, rel=1e-5, abs=0), f"{family} rank {rank}/2"


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_converted_family_generates_the_same_greedy_tokens(family):
    assert same_greedy_tokens(family, 0.5)


def test_in_bf16_deepseek_v3_picks_the_experts_transformers_picks():
    # transformers routes DeepSeek-V3 in fp32 too (bias, groups, scale): no choice may differ;
    # the families it routes in bf16 differ on near ties (docs/training.md).
    assert bf16_routing_mismatch("deepseek_v3", 0.5, batch=4) == 0.0


@pytest.mark.parametrize("family", sorted(REFUSED_TINY))
def test_a_family_moe_layer_cannot_compute_is_refused_saying_why(family):
    model = tiny(family)
    block_class = next(c for c, (f, _) in REFUSED.items() if f == family)
    with pytest.raises(ValueError, match=f"{block_class} \\({family}\\) cannot be converted"):
        replace_moe_blocks(model)
    assert not any(type(m).__name__ == "HFMoEBlock" for m in model.modules())  # untouched


class _OddMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


def test_an_unknown_moe_like_block_is_refused_by_class_name_before_anything_changes():
    model = tiny("mixtral")
    model.model.layers[1].mlp = _OddMoE()
    with pytest.raises(TypeError, match="unsupported MoE block _OddMoE: schemoe converts only"):
        replace_moe_blocks(model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"
    with pytest.raises(ValueError, match="no sparse MoE block"):
        replace_moe_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_the_report_names_each_replaced_module_and_its_family():
    model = tiny("deepseek_v3")
    report = replace_moe_blocks(model)
    assert list(report) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert report.families == dict.fromkeys(report, "deepseek_v3")
    assert report.summary() == {"deepseek_v3": 2}
    assert len(replace_moe_blocks(model)) == 0  # converted blocks are left alone


def test_deepseek_v2_greedy_routing_matches_and_an_unknown_topk_method_is_refused():
    block = tiny("deepseek_v2", 0.5).model.layers[0].mlp  # the tiny model is group-limited
    block.gate.topk_method = "greedy"
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    want = block(x)
    assert (from_hf_block(block)(x) - want).abs().max() <= ATOL
    block.gate.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        from_hf_block(block)


def _at(module: nn.Module, path: str) -> torch.Tensor:
    parent, _, leaf = path.rpartition(".")
    return getattr(module.get_submodule(parent), leaf)


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_weight_map_lists_every_tensor_of_the_block_and_each_is_held_there(family):
    model = tiny(family, 0.5)
    block = next(m for m in model.modules() if family_of(m))
    spec = FAMILIES[family]
    original = {k: v.clone() for k, v in block.state_dict().items()}
    assert {link.hf for link in spec.weights(block)} == set(original)
    conv = from_hf_block(block)
    state = conv.state_dict()
    moe = {k.removeprefix("moe."): v for k, v in state.items() if k.startswith("moe.")}
    for link in spec.weights(block):
        if link.kind == "tied":  # one storage under both names, the family's in state_dict
            held = _at(conv, link.moe[0])
            assert held.data_ptr() == _at(conv, link.hf).data_ptr(), link
            assert torch.equal(state[link.hf], original[link.hf]), link
        elif link.kind == "per_expert":  # one process: local index = global index
            rows = [state[link.moe[0].format(e=e)] for e in range(original[link.hf].shape[0])]
            assert torch.equal(torch.stack(rows), original[link.hf]), link
    if spec.experts == "gpt_oss":
        return
    back = from_moe_experts(moe, spec.experts)
    for k, v in back.items():
        assert torch.equal(v, original[k]), k
    again = to_moe_experts(back["experts.gate_up_proj"], back["experts.down_proj"], spec.experts)
    assert all(torch.equal(v, moe[k]) for k, v in again.items())
