"""Greedy generation with a converted Hugging Face model whose experts span two ranks: the ranks
stop at different steps (different prompts, batch sizes and end tokens) and `hf_generate.generate`
still finishes, every rank with the tokens of its own one-process run of the unmodified model.
(Without it, `model.generate` on the rank that ends first stops calling forward and the other
waits in its next all-to-all until the process group's timeout.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_cases import GENERATE, build

from schemoe.integrations.hf import replace_moe_blocks
from schemoe.integrations.hf_generate import generate, needs_synced_generation

NEW = 8  # at most this many new tokens


def _prompt(rank: int) -> torch.Tensor:
    """Rank r: r + 1 sequences of 4 + r tokens."""
    return torch.randint(3, 64, (rank + 1, 4 + rank), generator=torch.Generator().manual_seed(rank))


def _greedy(model, ids: torch.Tensor, eos: int | None, gen=None) -> torch.Tensor:
    kw = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    kw["attention_mask"] = torch.ones_like(ids)
    return (gen or (lambda m, *a, **k: m.generate(*a, **k)))(model, ids, **kw)


def _unstopped(name: str):
    """The family's tiny model with no end token of its own (each call says which)."""
    model = build(name)
    model.generation_config.eos_token_id = None
    return model


def _stopping_apart(rank: int, world: int, name: str) -> list[int]:
    ref = _unstopped(name)
    model = copy.deepcopy(ref)
    replace_moe_blocks(model)  # experts over both ranks
    assert needs_synced_generation(model)
    ids = _prompt(rank)
    free = _greedy(ref, ids, None)[:, ids.shape[1] :]
    # Rank 0 ends at its second new token, rank 1 runs to NEW tokens (an id it never makes).
    eos = int(free[0, 1]) if rank == 0 else min(set(range(64)) - set(free.flatten().tolist()))
    want = _greedy(ref, ids, eos)
    got = _greedy(model, ids, eos, gen=generate)
    assert torch.equal(got, want), f"{name} rank {rank}: {got.tolist()} != {want.tolist()}"
    return [want.shape[1] - ids.shape[1]]


@pytest.mark.parametrize("name", GENERATE)
def test_generation_on_two_ranks_that_stop_at_different_steps_finishes_with_one_process_tokens(
    name, ranks
):
    new = ranks(2).run(_stopping_apart, name, run_timeout=90)
    assert new[0][0] <= 2 < NEW == new[1][0]  # rank 0 ends early, rank 1 at max_new_tokens


def _refuses_unsynced(rank: int, world: int) -> bool:
    model = build("mixtral")
    replace_moe_blocks(model)
    with pytest.raises(ValueError, match="synced_gpus=False: this model's experts span"):
        generate(model, _prompt(0), max_new_tokens=2, synced_gpus=False)
    return True


def test_generation_without_synced_steps_is_refused_when_experts_span_ranks(ranks):
    assert ranks(2).run(_refuses_unsynced) == [True, True]


def test_generation_on_one_process_is_the_models_own():
    ref = _unstopped("mixtral")
    model = copy.deepcopy(ref)
    replace_moe_blocks(model)
    assert not needs_synced_generation(model)
    ids = _prompt(1)
    assert torch.equal(_greedy(model, ids, None, gen=generate), _greedy(ref, ids, None))
