"""FSDP2 with expert parallelism on 4 ranks: dense weights sharded by `fully_shard` over every
rank, experts expert-parallel on their own groups. An FSDP-sharded MoE layer matches the
single-process reference forward and backward (and its global gradient norm), `schemoe train
--fsdp` takes the same losses as the DDP run of the same model and seed, and what --fsdp cannot
do yet is refused before any rank starts, naming the flags."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from moe_cases import close, global_weights, inputs, layer_config, run_reference
from schemoe import MoELayer, cli
from schemoe.layer.fsdp import fully_shard_dense, is_fully_sharded
from schemoe.layer.parallel import average_expert_gradients, clip_grad_norm_, init_expert_parallel
from schemoe.train import loop as T
from train_cases import TINY, tiny


def _sharded_layer(ep_size: int, seed: int = 3):
    """An MoE layer on the EP groups of `ep_size`, its global weights loaded, then sharded."""
    ep = init_expert_parallel(ep_size)
    cfg = layer_config("schemoe", "naive", chunks=2)
    torch.manual_seed(seed)
    layer = MoELayer(cfg, group=ep.ep_group)
    weights = global_weights(layer, seed=seed)
    layer.load_global_state(weights)
    return ep, cfg, fully_shard_dense(layer), weights


def _placements(rank, world):
    ep, _, layer, _ = _sharded_layer(2)
    gate = layer.gate_weight
    experts = [p for n, p in layer.named_parameters() if n.startswith("experts.")]
    return (
        is_fully_sharded(layer)
        and isinstance(gate, DTensor)
        and gate.placements == (Shard(0),)
        and gate.device_mesh.size() == world
        and all(not isinstance(p, DTensor) and p.schemoe_expert for p in experts)
        and experts[0].shape[0] == layer.num_local == 8 // ep.ep_size
    )


def test_fully_shard_dense_shards_dense_weights_over_every_rank_and_leaves_experts_plain(ranks):
    assert all(ranks(4).run(_placements))


def _against_reference(rank, world, ep_size):
    ep, cfg, layer, weights = _sharded_layer(ep_size)
    tokens = [13 + 7 * q for q in range(world)]  # every rank of the world has its own batch
    xs, gys = inputs(world, tokens, cfg.experts.model_dim, seed=3)
    x = xs[rank].clone().requires_grad_(True)
    y, aux = layer(x)
    ((y * gys[rank]).sum() + aux).backward()
    average_expert_gradients(layer, ep)
    ry, _, rgx, rgrads = run_reference(weights, cfg, xs, gys)
    close(y.detach(), ry[rank].detach(), f"output rank {rank}")
    close(x.grad, rgx[rank], f"input grad rank {rank}")
    # Reference gradients are of the summed loss; FSDP's dense and the averaged expert
    # gradients are of the mean over the world.
    sl = layer.expert_slice()
    for name, p in layer.named_parameters():
        if isinstance(p.grad, DTensor):
            close(p.grad.full_tensor() * world, rgrads[name], f"dense grad {name} rank {rank}")
        else:
            close(p.grad * world, rgrads[name][sl], f"expert grad {name} rank {rank}")
    want = math.sqrt(sum(float((g / world).pow(2).sum()) for g in rgrads.values()))
    got = clip_grad_norm_(layer, 0.0, ep)  # measure only
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)
    return True


@pytest.mark.parametrize("ep_size", [2, 4])
def test_an_fsdp_sharded_moe_layer_matches_the_single_process_reference(ranks, ep_size):
    assert all(ranks(4).run(_against_reference, ep_size))


def _clipped(rank, world):
    ep, cfg, layer, _ = _sharded_layer(2)
    x = torch.randn(16, cfg.experts.model_dim, generator=torch.Generator().manual_seed(rank))
    (layer(x)[0].square().sum() * 100).backward()
    average_expert_gradients(layer, ep)
    before = clip_grad_norm_(layer, 0.5, ep)
    after = clip_grad_norm_(layer, 0.0, ep)
    return before > 0.5 and math.isclose(after, 0.5, rel_tol=1e-4)


def test_clipping_scales_sharded_dense_and_expert_gradients_to_the_global_norm(ranks):
    assert all(ranks(4).run(_clipped))


def _train(rank, world, extra):
    return T.train(rank, world, tiny(*extra))


@pytest.mark.parametrize("ep_size", ["2"])  # EP 2 x shard 2; EP 4: scripts/fsdp_vs_ddp.py
def test_fsdp_training_takes_the_same_losses_as_the_ddp_run_of_the_same_model(ranks, ep_size):
    extra = ["--ep-size", ep_size, "--steps", "6", "--eval-seqs", "0"]
    ddp = ranks(4).run(_train, extra)[0]
    fsdp = ranks(4).run(_train, [*extra, "--fsdp"])[0]
    assert (fsdp["ep_size"], fsdp["dp_size"]) == (int(ep_size), 4 // int(ep_size))
    assert len(fsdp["losses"]) == 6 and fsdp["losses"][-1] < fsdp["losses"][0]
    for a, b in zip(fsdp["losses"], ddp["losses"], strict=True):
        assert f"{a:.5g}" == f"{b:.5g}" or math.isclose(a, b, rel_tol=1e-6), (a, b)


REFUSED = {
    "scheduled sync": (["--grad-sync", "scheduled"], "--grad-sync scheduled"),
    "grad compressor": (["--grad-compressor", "bf16"], "--grad-compressor bf16"),
    "bucket size": (["--bucket-mb", "4"], "--bucket-mb 4.0"),
    "micro-chunks": (["--micro-chunks", "2"], "--micro-chunks 2"),
    "micro-chunks auto": (["--micro-chunks", "auto"], "--micro-chunks auto"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_fsdp_refuses_what_it_cannot_do_yet_before_any_rank_starts(case, capsys):
    flags, named = REFUSED[case]
    rc = cli.main(["train", *TINY, "--nproc", "2", "--steps", "2", "--fsdp", *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (out, err)
    assert err.startswith("schemoe train: error: --fsdp does not support ") and named in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_fsdp_names_every_flag_it_cannot_take_in_one_line():
    with pytest.raises(ValueError) as e:
        tiny("--fsdp", "--micro-chunks", "2", "--bucket-mb", "4")
    assert str(e.value) == (
        "--fsdp does not support --bucket-mb 4.0, --micro-chunks 2 yet: drop them or --fsdp"
    )
