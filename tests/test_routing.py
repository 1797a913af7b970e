"""Routing modes (GateConfig score / groups / top_groups / scale / renormalize and the aux-loss-free
bias): choices and weights computed by hand, Hugging Face's DeepSeek-V3 and Qwen3-MoE routers
reproduced, the router in fp32 whatever the model's dtype, the bias update under gradient
accumulation and data parallelism, and every mode against the single-process reference, forward
and backward, on 1, 2 and 4 ranks, capacity and dropless."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moe_cases import check_against_reference
from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, init_expert_parallel
from schemoe.routing.router import route, select
from schemoe.train.step import train_step
from train_cases import tiny

E = 8
# One token's scores over 8 experts in 4 groups of 2. Expert 0 has the best score but a weak
# partner (group 0 scores 0.95); groups 1 (0.62 + 0.58) and 2 (0.7 + 0.45) are the best two.
S = [0.95, 0.0, 0.62, 0.58, 0.7, 0.45, 0.1, 0.2]


def gate(**kw) -> GateConfig:
    kw = {"num_experts": E, "top_k": 2, "capacity_factor": 0.0} | kw
    return GateConfig(**kw)


def test_plain_top_k_takes_the_best_scores_wherever_they_are():
    assert select(torch.tensor([S]), gate(groups=4)).tolist() == [[0, 4]]


def test_group_limited_top_k_chooses_inside_the_groups_with_the_best_two_scores():
    assert select(torch.tensor([S]), gate(groups=4, top_groups=2)).tolist() == [[4, 2]]
    # one group of 2 experts: its two experts, best first
    assert select(torch.tensor([S]), gate(groups=4, top_groups=1)).tolist() == [[2, 3]]


def test_the_bias_moves_the_groups_and_the_choice_but_not_the_weights():
    # +1 on expert 7: group 3 scores 0.1 + 1.2 = 1.3 and leads; group 1 (1.2) is second.
    bias = torch.zeros(E)
    bias[7] = 1.0
    cfg = gate(score="sigmoid", groups=4, top_groups=2, renormalize=False)
    logits = torch.logit(torch.tensor([S]).clamp(1e-6, 1 - 1e-6))
    r = route(logits, torch.eye(E), cfg, bias_E=bias)  # x = logits, W = I
    assert r.expert_TK.tolist() == [[7, 2]]
    torch.testing.assert_close(r.weight_TK, torch.tensor([[0.2, 0.62]]))


def test_sigmoid_weights_are_renormalised_then_scaled():
    x = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5, -2.0, 0.0, -3.0]])
    r = route(x, torch.eye(E), gate(score="sigmoid", scale=2.5))
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0)]
    assert r.expert_TK.tolist() == [[0, 2]]
    torch.testing.assert_close(r.weight_TK, torch.tensor([[2.5 * v / sum(s) for v in s]]))
    # the aux loss balances the sigmoid scores normalised per token
    torch.testing.assert_close(r.probs_TE.sum(-1), torch.ones(1))


def test_softmax_weights_without_renormalisation_are_the_probabilities_times_the_scale():
    x = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5, -2.0, 0.0, -3.0]])
    r = route(x, torch.eye(E), gate(renormalize=False, scale=2.0))
    p = torch.softmax(x, -1)
    torch.testing.assert_close(r.weight_TK, 2.0 * p[:, [0, 2]])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"score": "tanh"}, "score must be one of"),
        ({"groups": 3}, "divisible by groups=3"),
        ({"groups": 4, "top_groups": 5}, "top_groups=5 must be <= groups=4"),
        ({"groups": 4, "top_groups": 1, "top_k": 3}, "top_k=3 must be <= top_groups"),
        ({"top_groups": 0}, "top_groups must be >= 1"),
        ({"scale": 0.0}, "scale must be > 0"),
        ({"scale": math.inf}, "scale must be > 0 and finite"),
    ],
)
def test_gate_config_names_the_wrong_routing_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        gate(**kw)


# ---------------------------------------------------------------- Hugging Face, exactly
def _same_choices(r, hf_idx, hf_w) -> None:
    """The same expert set per token and the same weight per expert (order aside: HF's top-k is
    unsorted). Weights to the last bits: the k-term sum may be added in another order."""
    ours, order = r.expert_TK.sort(-1)
    theirs, horder = hf_idx.sort(-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(
        r.weight_TK.gather(1, order), hf_w.float().gather(1, horder), rtol=1e-6, atol=0
    )


def test_deepseek_v3_routing_is_reproduced():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    hf = DeepseekV3TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 16, generator=g))
        hf.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=g))
    x = torch.randn(64, 16, generator=g)
    _, hf_w, hf_idx = hf(x)
    cfg = GateConfig(num_experts=16, top_k=4, capacity_factor=0.0, score="sigmoid", groups=4,
                     top_groups=2, scale=2.5)  # fmt: skip
    _same_choices(route(x, hf.weight, cfg, bias_E=hf.e_score_correction_bias), hf_idx, hf_w)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_routing_is_reproduced(norm):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf_cfg = transformers.Qwen3MoeConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm
    )
    hf = Qwen3MoeTopKRouter(hf_cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 16, generator=g))
    x = torch.randn(64, 16, generator=g)
    _, hf_w, hf_idx = hf(x)
    _same_choices(route(x, hf.weight, gate(renormalize=norm)), hf_idx, hf_w)


# ---------------------------------------------------------------- fp32 router
DEEPSEEK = {"score": "sigmoid", "groups": 4, "top_groups": 2, "scale": 2.5}


def _layer(**gate_kw) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(gate=gate(**gate_kw), experts=ExpertConfig(model_dim=12, hidden_dim=16))
    return MoELayer(cfg, seed=0)


def test_the_router_computes_in_fp32_under_bf16_autocast():
    layer = _layer(**DEEPSEEK)
    x = torch.randn(20, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = route(x, layer.gate_weight, layer.config.gate)
        y, _ = layer(x)
    assert r.logits_TE.dtype == r.weight_TK.dtype == torch.float32
    assert torch.equal(r.logits_TE, x @ layer.gate_weight.t())
    assert y.dtype == x.dtype and torch.isfinite(y).all()


def test_a_bf16_layer_routes_in_fp32_and_counts_its_load_exactly():
    layer = _layer(**DEEPSEEK, bias_update_rate=0.01).to(torch.bfloat16)
    x = torch.randn(300, 12).to(torch.bfloat16)
    r = route(x, layer.gate_weight, layer.config.gate, bias_E=layer.expert_bias)
    assert r.logits_TE.dtype == r.weight_TK.dtype == torch.float32
    assert torch.equal(r.logits_TE, x.float() @ layer.gate_weight.float().t())
    y, _ = layer(x)
    assert y.dtype == torch.bfloat16
    # 600 choices: past bf16's 256 exact integers, the load buffer stays an exact count
    assert layer.expert_load.dtype == torch.long and int(layer.expert_load.sum()) == 600
    # the bias stays fp32: a step of 0.01 on 0.5 survives (bf16 would round it away)
    layer.expert_bias.fill_(0.5)
    layer.update_expert_bias()
    assert layer.expert_bias.dtype == torch.float32
    assert sorted({round(b, 6) for b in layer.expert_bias.tolist()}) <= [0.49, 0.5, 0.51]
    assert layer.expert_bias.tolist() != [0.5] * E


# ---------------------------------------------------------------- the aux-loss-free bias
class _Toy(nn.Module):
    """Embedding -> MoE (sigmoid, 2 groups of 2, one kept, aux-free bias, capacity) -> head."""

    def __init__(self) -> None:
        super().__init__()
        gate_kw = {"score": "sigmoid", "groups": 2, "top_groups": 1, "capacity_factor": 1.0}
        cfg = MoEConfig(gate=GateConfig(num_experts=4, bias_update_rate=0.01, **gate_kw),
                        experts=ExpertConfig(model_dim=16, hidden_dim=16))  # fmt: skip
        self.emb, self.moe, self.head = (
            nn.Embedding(64, 16),
            MoELayer(cfg, seed=0),
            nn.Linear(16, 64),
        )

    def forward(self, x_BL):
        y, aux = self.moe(self.emb(x_BL))
        return self.head(y), aux


def _bias_after_one_step(batches: list, accum: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = _Toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = iter(batches)
    train_step(model, model, opt, lambda: next(it), None, clip=1.0, grad_accum=accum)
    return model.moe.expert_bias.clone()


def test_four_accumulated_micro_batches_move_the_bias_as_one_batch_of_their_tokens():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    micro = _bias_after_one_step([(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)], 4)
    whole = _bias_after_one_step([(x, y)], 1)
    assert torch.equal(micro, whole)
    assert micro.abs().max() == pytest.approx(0.01)  # one update per optimizer step, not four


def _dp_bias(rank: int, world: int, ep_size: int) -> list[float]:
    ep = init_expert_parallel(ep_size)
    torch.manual_seed(0)
    cfg = MoEConfig(gate=gate(bias_update_rate=0.01, **DEEPSEEK),
                    experts=ExpertConfig(model_dim=12, hidden_dim=16))  # fmt: skip
    layer = MoELayer(cfg, group=ep.ep_group, seed=0)
    x = torch.randn(world, 40, 12, generator=torch.Generator().manual_seed(3))
    layer(x[rank])
    layer.update_expert_bias(ep.dp_group if ep.dp_size > 1 else None)
    return layer.expert_bias.tolist()


@pytest.mark.parametrize("ep_size", [1, 2], ids=["ep1-dp2", "ep2"])
def test_every_replica_takes_the_bias_of_the_global_load(ranks, ep_size):
    got = ranks(2).run(_dp_bias, ep_size)
    torch.manual_seed(0)
    cfg = MoEConfig(gate=gate(bias_update_rate=0.01, **DEEPSEEK),
                    experts=ExpertConfig(model_dim=12, hidden_dim=16))  # fmt: skip
    one = MoELayer(cfg, seed=0)
    one(torch.randn(2, 40, 12, generator=torch.Generator().manual_seed(3)).reshape(80, 12))
    one.update_expert_bias()
    assert got[0] == got[1] == one.expert_bias.tolist()


# ---------------------------------------------------------------- against the reference
GATES = {
    # DeepSeek-V3 style: sigmoid, 4 groups of 2, the best 2 groups, top-3, scaled, a bias
    "sigmoid-groups-bias": {**DEEPSEEK, "top_k": 3, "bias_update_rate": 0.01},
    # softmax, 2 groups of 4, one kept, no renormalisation, scaled, score priority
    "softmax-groups-score": {"groups": 2, "top_groups": 1, "renormalize": False, "scale": 2.0,
                             "priority": "score"},
    # GPT-OSS / DeepSeek-V2 / Llama 4 variants: a logit bias, groups scored by their best
    # expert, the weights on the experts' inputs
    "logit-bias-max-groups-input": {"logit_bias": True, "groups": 4, "top_groups": 2,
                                    "group_score": "max", "weights_on": "input"},
}  # fmt: skip
BIAS = torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4, 0.2, 0.05, -0.1])


def _parity(rank, world, name, f):
    kw = {"num_experts": E, "top_k": 2, "capacity_factor": f, "z_loss_weight": 0.001}
    cfg = MoEConfig(gate=GateConfig(**(kw | GATES[name])),
                    experts=ExpertConfig(model_dim=12, hidden_dim=20))  # fmt: skip
    bias = BIAS if cfg.gate.bias_update_rate > 0 else None
    check_against_reference(cfg, [13 + 7 * q for q in range(world)], seed=40, bias=bias)
    return True


@pytest.mark.parametrize("f", [0.0, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("name", list(GATES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_routing_mode_matches_the_reference_forward_and_backward(ranks, world, name, f):
    assert all(ranks(world).run(_parity, name, f))


# ---------------------------------------------------------------- schemoe train's flags
def test_schemoe_train_flags_reach_the_gate_config_and_errors_name_them():
    flags = ("--experts", "8", "--top-k", "3", "--score", "sigmoid", "--expert-groups", "4",
             "--top-groups", "2", "--routed-scale", "2.5")  # fmt: skip
    g = tiny(*flags).moe_config(1).gate
    assert (g.score, g.groups, g.top_groups, g.scale, g.top_k) == ("sigmoid", 4, 2, 2.5, 3)
    with pytest.raises(ValueError, match="--top-groups 5 must be <= --expert-groups 4"):
        tiny(*flags[:-4], "--top-groups", "5")
    with pytest.raises(ValueError, match="--top-k 3 must be <= --top-groups"):
        tiny(*flags[:-4], "--top-groups", "1")
