"""Grouped experts: torch's grouped kernel, its loop fallback, the per-expert loop and the
single-process reference agree, forward and backward; the layer with grouped experts matches the
reference on 1, 2 and 4 ranks, capacity and dropless.

Tolerances: the grouped kernel and the loop fallback compute the same products (bitwise equal on
this build); BatchedFFN against the reference's per-expert matmuls is fp32 rounding (moe_cases
tolerances); bf16 against an fp32 reference allows bf16's 8 mantissa bits (rtol 2e-2 of O(1)
values summed over K = M or H terms).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from moe_cases import check_against_reference, close
from schemoe import ExpertConfig, GateConfig, MoEConfig
from schemoe.bench import cli as bench_cli
from schemoe.bench import layer as bench_layer
from schemoe.experts import grouped
from schemoe.experts.ffn import BatchedFFN
from schemoe.experts.grouped import group_mm, grouped_kernel, loop_mm
from schemoe.layer.reference import _expert

HAS_KERNEL = grouped_kernel("cpu", torch.float32)
COUNTS = {
    "uneven": (5, 1, 0, 9),
    "one-row-each": (1, 1, 1, 1),
    "all-in-one": (0, 0, 12, 0),
    "no-rows": (0, 0, 0, 0),
}


def _grads(fn, x, w, gy):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    y = fn(x, w)
    gx, gw = torch.autograd.grad(y, (x, w), gy, allow_unused=True)
    return y.detach(), gx if gx is not None else torch.zeros_like(x), gw


@pytest.mark.skipif(not HAS_KERNEL, reason="this torch build has no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(COUNTS))
def test_the_grouped_kernel_equals_the_loop_bitwise_forward_and_backward(name, dtype):
    counts = COUNTS[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(sum(counts), 16, generator=g).to(dtype)
    w = torch.randn(4, 16, 24, generator=g).to(dtype)
    gy = torch.randn(sum(counts), 24, generator=g).to(dtype)
    kernel = _grads(lambda a, b: group_mm(a, b, counts), x, w, gy)
    loop = _grads(lambda a, b: loop_mm(a, b, counts), x, w, gy)
    for what, a, b in zip(("y", "grad x", "grad w"), kernel, loop):
        assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max()}"


def test_shapes_the_kernel_cannot_take_run_the_loop_with_the_same_result(monkeypatch):
    calls, kernel = [], grouped._KERNEL
    monkeypatch.setattr(grouped, "_KERNEL", lambda *a: calls.append(1) or kernel(*a))
    counts = (2, 0, 3)
    g = torch.Generator().manual_seed(3)
    # K = 10 floats = 40 bytes: not 16-byte aligned; float64: no kernel.
    for x, w in (
        (torch.randn(5, 10, generator=g), torch.randn(3, 10, 8, generator=g)),
        (torch.randn(5, 8, generator=g).double(), torch.randn(3, 8, 8, generator=g).double()),
    ):
        want = torch.cat([x[:2] @ w[0], x[2:] @ w[2]])
        assert torch.equal(group_mm(x, w, counts), want)
    assert not calls
    assert not grouped_kernel("cpu", torch.float64)


def _ffn(impl: str, act: str, bias: bool, dtype=torch.float32) -> BatchedFFN:
    cfg = ExpertConfig(model_dim=12, hidden_dim=20, activation=act, bias=bias, impl=impl)
    ffn = BatchedFFN(cfg, 4, first_expert=4, seed=3).to(dtype)
    if bias:  # non-zero biases, so a bias picked for the wrong expert shows
        with torch.no_grad():
            for b in (ffn.b1_EH, ffn.b2_EM):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(9)))
    return ffn


def _reference(ffn: BatchedFFN, x: torch.Tensor, counts, act: str) -> torch.Tensor:
    w = {f"experts.{n}": p for n, p in ffn.named_parameters()}
    parts = torch.split(x, list(counts))
    return torch.cat([_expert(p, w, e, act) for e, p in enumerate(parts)])


def _run(ffn, fn, x, gy):
    x = x.detach().requires_grad_(True)
    ffn.zero_grad(set_to_none=True)
    y = fn(ffn, x)
    (y.float() * gy).sum().backward()
    grads = {n: p.grad.float() for n, p in ffn.named_parameters()}
    return y.detach().float(), x.grad.float(), grads


FFN_CASES = [(a, b, c) for a in ("gelu", "swiglu") for b in (False, True) for c in COUNTS]
FFN_CASES += [("relu", True, "uneven")]


@pytest.mark.parametrize("case", FFN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_grouped_and_loop_experts_match_the_reference_forward_and_backward(case):
    act, bias, name = case
    counts = COUNTS[name]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(counts), 12, generator=g)
    gy = torch.randn(sum(counts), 12, generator=g)
    ref = _run(_ffn("loop", act, bias), lambda f, a: _reference(f, a, counts, act), x, gy)
    for impl in ("grouped", "loop"):
        got = _run(_ffn(impl, act, bias), lambda f, a: f(a, counts), x, gy)
        close(got[0], ref[0], f"{impl} output")
        close(got[1], ref[1], f"{impl} input grad")
        for n in ref[2]:
            close(got[2][n], ref[2][n], f"{impl} grad {n}")


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_grouped_experts_in_bf16_match_the_fp32_reference_within_bf16_rounding(act):
    counts = COUNTS["uneven"]
    g = torch.Generator().manual_seed(12)
    x = torch.randn(sum(counts), 12, generator=g)
    gy = torch.randn(sum(counts), 12, generator=g)
    ref = _run(_ffn("loop", act, False), lambda f, a: _reference(f, a, counts, act), x, gy)
    # M=12 bf16 rows are 24 bytes (the kernel needs 16-byte multiples): those run the loop;
    # H=20 is aligned neither. Both paths still must be right.
    for impl in ("grouped", "loop"):
        f = _ffn(impl, act, False, torch.bfloat16)
        got = _run(f, lambda m, a: m(a.bfloat16(), counts), x, gy)
        for what, a, b in zip(("output", "input grad"), got[:2], ref[:2]):
            close(a, b, f"{impl} bf16 {what}", atol=5e-2, rtol=5e-2)
        for n in ref[2]:
            close(got[2][n], ref[2][n], f"{impl} bf16 grad {n}", atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(not grouped_kernel("cpu", torch.bfloat16), reason="no bf16 grouped kernel")
def test_grouped_experts_in_bf16_on_the_kernel_match_the_fp32_reference():
    counts = COUNTS["uneven"]
    cfg = ExpertConfig(model_dim=16, hidden_dim=32, impl="grouped")
    ffn = BatchedFFN(cfg, 4, seed=4)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(sum(counts), 16, generator=g)
    gy = torch.randn(sum(counts), 16, generator=g)
    ref = _run(ffn, lambda f, a: _reference(f, a, counts, "gelu"), x, gy)
    low = BatchedFFN(cfg, 4, seed=4).to(torch.bfloat16)  # the same weights, rounded
    got = _run(low, lambda f, a: f(a.bfloat16(), counts), x, gy)
    for what, a, b in zip(("output", "input grad"), got[:2], ref[:2]):
        close(a, b, f"bf16 kernel {what}", atol=5e-2, rtol=5e-2)
    for n in ref[2]:
        close(got[2][n], ref[2][n], f"bf16 kernel grad {n}", atol=5e-2, rtol=5e-2)


def test_an_unknown_experts_impl_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="grouped.*loop.*'bmm'"):
        ExpertConfig(model_dim=4, hidden_dim=4, impl="bmm")


def test_both_impls_hold_the_same_parameters_so_checkpoints_load_into_either():
    a, b = _ffn("grouped", "swiglu", True), _ffn("loop", "swiglu", True)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[n], sb[n]) for n in sa)
    b.load_state_dict(sa)


# ------------------------------------------------------------------ the layer, 1 / 2 / 4 ranks
def _layer_cfg(f: float, impl: str) -> MoEConfig:
    return MoEConfig(
        gate=GateConfig(num_experts=8, top_k=2, capacity_factor=f, z_loss_weight=0.001),
        experts=ExpertConfig(model_dim=12, hidden_dim=20, activation="swiglu", impl=impl),
    )


def _layer(rank, world, f, impl):
    tokens = [9 + 5 * q for q in range(world)]  # uneven token counts per rank
    cfg = _layer_cfg(f, impl)
    check_against_reference(cfg, tokens, seed=21 + world)
    # The same weights give the same result with the other impl (shown on the reference too).
    other = dataclasses.replace(cfg.experts, impl="loop" if impl == "grouped" else "grouped")
    check_against_reference(dataclasses.replace(cfg, experts=other), tokens, seed=21 + world)
    return True


@pytest.mark.parametrize("f", [0.0, 1.25], ids=["dropless", "capacity"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_layer_with_grouped_experts_matches_the_reference(ranks, world, f):
    assert all(ranks(world).run(_layer, f, "grouped"))


# ------------------------------------------------------------------ bench layer's expert rows
def _bench_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="schemoe")
    bench_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "layer", "--tokens", "32", "--model-dim", "16",
                              "--hidden-dim", "24", "--warmup", "0", "--repeats", "1",
                              "--timeout", "120", *extra])  # fmt: skip


def test_bench_layer_times_grouped_loop_dropless_padded_and_dense_rows_in_one_run(capfd):
    args = _bench_args(
        "--nproc", "1", "--experts-impl", "grouped,loop", "--dense-bound", "--dedup"
    )  # fmt: skip
    assert args.func(args) == 0
    out = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    rows = {(r["policy"], r["algorithm"], r["compressor"]) for r in out["experts"]["rows"]}
    for shape in ("E8 k2 H24", "E64 k6 H8"):  # k x H = 48 for both
        for impl in ("grouped", "loop"):
            modes = ("dropless", "dropless dedup", "f=1.25", "experts only")
            assert {(shape, impl, m) for m in modes} <= rows
        assert any(r[:2] == (shape, "dense bound") for r in rows)
    assert set(out["experts"]["ratios"]) >= {
        "E8 k2 H24: dropless grouped / loop f=1.25",
        "E64 k6 H8: grouped experts / dense bound",
        "dropless grouped: E64 k6 H8 / E8 k2 H24",
        "dropless dedup grouped: E64 k6 H8 / E8 k2 H24",
        "E64 k6 H8: dedup grouped / dropless grouped",
    }
    assert [r["policy"] for r in out["results"]] == ["sequential"]  # the usual rows stay


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--experts-impl", "bmm"], "--experts-impl: unknown bmm"),
        (["--dense-bound"], "--dense-bound .* add --experts-impl"),
        (["--dedup"], "--dedup .* add --experts-impl"),
        (["--experts-impl", "grouped", "--expert-shapes", "8x2,64x5"], "--hidden-dim 24"),
        (["--experts-impl", "grouped", "--expert-shapes", "4x6"], "k must be in 1..E"),
    ],
)
def test_bench_layer_refuses_expert_flags_that_cannot_run_naming_the_flag(extra, message):
    with pytest.raises(ValueError, match=message):
        bench_layer.validate(_bench_args(*extra))
