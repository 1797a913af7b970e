"""The way back from `replace_moe_blocks`: a converted (and changed, as by training) Hugging Face
model saved with `hf_export.save_pretrained` loads into its unmodified family class with no
missing or unexpected weight and computes the converted model's logits; `load_pretrained_into`
puts the checkpoint back into a converted model exactly. One process, and expert-parallel on two
ranks (the experts gathered from both), for every family `tests/test_hf.py` builds.

Tolerance: the saved weights are the converted model's bit for bit; the logits of the family's
own class and of the converted model are the same math summed in another order (test_hf.py's
atol 2e-5 / rtol 2e-4); a lost, swapped or stale expert shows as 1e-2 or more.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hf_cases import FAMILIES, build

from moe_cases import close
from schemoe.integrations.hf import replace_moe_blocks, to_schemoe_experts
from schemoe.integrations.hf_export import (
    _to_schemoe,
    from_schemoe_experts,
    hf_state_dict,
    load_hf_state_dict,
    load_pretrained_into,
    save_pretrained,
)
from schemoe.integrations.hf_tiny import perturb


def _trained(name: str) -> torch.nn.Module:
    """A converted model whose every weight moved after conversion (as training moves them);
    the same on every rank: each expert's change depends on its global index only."""
    model = build(name)
    replace_moe_blocks(model)
    rank, world = (dist.get_rank(), dist.get_world_size()) if _dist() else (0, 1)
    perturb(model, rank, world)
    return model


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(30 + rank))


def _round_trip(name: str, path: str, rank: int) -> float:
    """Save, load into the family class and into a fresh converted model; the max|diff| of the
    family class's logits from the converted model's."""
    conv = _trained(name)
    save_pretrained(conv, path)
    family = type(conv)
    back, info = family.from_pretrained(path, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not bad and not info.get("error_msgs"), f"{name}: loading reported {info}"
    ids = _ids(rank)
    want = conv(ids).logits.detach()  # collective on 2 ranks: both compute their own ids
    got = back(ids).logits.detach()
    close(got, want, f"{name} logits of the family's class, rank {rank}")
    saved = hf_state_dict(conv)  # collective on 2 ranks (gathers the experts)
    for n, t in back.state_dict().items():
        assert torch.equal(t, saved[n]), f"{name}: {n} changed on the way out"
    fresh = build(name)  # every weight as before the change: each must come from the file
    replace_moe_blocks(fresh)
    load_pretrained_into(fresh, path)
    loaded = fresh.state_dict()
    for n, t in conv.state_dict().items():
        assert torch.equal(loaded[n], t), f"{name}: {n} after load_pretrained_into"
    reloaded = fresh(ids).logits.detach()
    assert torch.equal(reloaded, want), f"{name}: logits after load_pretrained_into"
    return (got - want).abs().max().item()


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_converted_model_loads_in_its_family_class_with_the_same_weights_and_logits(
    name, tmp_path
):
    _round_trip(name, str(tmp_path), 0)


def _two_ranks(rank: int, world: int, name: str, path: str) -> float:
    return _round_trip(name, path, rank)


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_gathers_experts_from_two_expert_parallel_ranks(name, tmp_path, ranks):
    ranks(2).run(_two_ranks, name, str(tmp_path))


def _write_into_a_file(rank: int, world: int, path: str) -> str:
    conv = _trained("mixtral")
    try:
        save_pretrained(conv, path)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


def test_a_failed_write_on_rank_0_raises_on_every_rank_instead_of_hanging(tmp_path, ranks):
    path = tmp_path / "a-file"
    path.write_text("")
    got = ranks(2).run(_write_into_a_file, str(path))
    assert got[0] == f"ValueError: {path} is a file; save_pretrained writes a folder"
    assert got[1] == f"RuntimeError: rank 0 failed to write {path} (see its error)"


def test_expert_layout_conversion_back_is_the_exact_inverse_with_gate_rows_first():
    E, I, M = 3, 2, 4
    gate_up = torch.arange(E * 2 * I * M, dtype=torch.float32).view(E, 2 * I, M)
    down = torch.arange(E * M * I, dtype=torch.float32).view(E, M, I)
    ours = to_schemoe_experts(gate_up, down)
    assert ours["experts.w1_EMH"][1, 3, 0].item() == gate_up[1, 0, 3].item()  # gate row 0
    assert ours["experts.w3_EMH"][1, 3, 0].item() == gate_up[1, I, 3].item()  # up row 0
    back = from_schemoe_experts(ours)
    assert torch.equal(back["experts.gate_up_proj"], gate_up)
    assert torch.equal(back["experts.down_proj"], down)
    transposed = from_schemoe_experts(ours, "fused_t")  # Llama 4: [E, M, 2I], [E, I, M]
    assert torch.equal(transposed["experts.gate_up_proj"], gate_up.transpose(1, 2))
    assert torch.equal(transposed["experts.down_proj"], down.transpose(1, 2))
    again = _to_schemoe(
        transposed["experts.gate_up_proj"], transposed["experts.down_proj"], "fused_t"
    )
    assert all(torch.equal(again[n], t) for n, t in ours.items())


def test_unconverted_model_and_foreign_state_dicts_are_refused_by_name():
    plain = build("mixtral")
    with pytest.raises(ValueError, match="no converted MoE block"):
        hf_state_dict(plain)
    conv = copy.deepcopy(plain)
    replace_moe_blocks(conv)
    state = plain.state_dict()
    state.pop("model.layers.1.mlp.experts.down_proj")
    with pytest.raises(ValueError, match="experts.down_proj"):
        load_hf_state_dict(conv, state)
    with pytest.raises(ValueError, match="unexpected \\['extra'\\]"):
        load_hf_state_dict(conv, {**plain.state_dict(), "extra": torch.zeros(1)})


def test_a_weight_held_only_by_the_moe_layer_or_a_foreign_layout_is_not_written():
    conv = build("mixtral")
    replace_moe_blocks(conv)
    moe = conv.model.layers[0].mlp.moe
    moe.gate_weight = torch.nn.Parameter(moe.gate_weight.detach().clone())  # untied
    with pytest.raises(TypeError, match=r"\['gate_weight'\] are not tied"):
        hf_state_dict(conv)
    conv = build("mixtral")
    replace_moe_blocks(conv)
    conv.config.num_local_experts = 8  # the family's class would now hold 8 experts a block
    with pytest.raises(ValueError, match="do not map onto MixtralForCausalLM's own layout"):
        hf_state_dict(conv)
