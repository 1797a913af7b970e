"""Compressors: each one's stated error bound, inf/NaN behaviour, wire size and row-splittability.

The bounds checked here are the ones the compressors' docstrings state; zfp's are empirical.
zfp tests skip when zfpy is not installed.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from schemoe.compression import COMPRESSORS, base, build

LOSSY = ["fp16", "bf16", "fp8", "int8", "zfp"]
ALL = ["none", *LOSSY]
BLOCK_SCALED = ["fp8", "int8", "zfp"]
EPS32 = 2.0**-24


def make(name: str, **options):
    if name == "zfp":
        pytest.importorskip("zfpy")
    return build(name, {name: options} if options else None)


def roundtrip(c, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return c.decode(c.encode(x), dtype, x.shape[1])


def bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The per-value error bound each compressor states, in float64, for x [N, M]."""
    x = x.double()
    ax = x.abs()
    if name == "fp16":
        return torch.clamp(ax * 2.0**-11, min=2.0**-25)
    if name == "bf16":
        return torch.clamp(ax * 2.0**-8, min=2.0**-134)
    if name == "fp8":
        s = (ax.amax(1, keepdim=True) / 448).float().double()
        return torch.maximum(ax / 16, s / 1024) * (1 + 2.0**-20) + 448 * 2.0**-150
    if name == "int8":
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        big = torch.maximum(lo.abs(), hi.abs())
        return ((hi - lo) / 255 / 2 * (1 + 2.0**-13) + 4 * EPS32 * big).expand_as(x)
    if name == "zfp":  # empirical, rate 8, any data: 0.25 of the row's max |x|, + 2^-98 flush
        return (0.25 * ax.amax(1, keepdim=True) + 2.0**-98).expand_as(x)
    raise AssertionError(name)


def assert_within_bound(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    err = (y.double() - x.double()).abs()
    b = bound(name, x)
    worst = (err / b.clamp(min=1e-300)).max().item()
    assert (err <= b).all(), f"{name}: error reaches {worst:.3g} x its bound"


def activations(rows: int = 256, cols: int = 384, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gamma = 1 + 0.2 * torch.randn(cols, generator=g)
    gamma[:4] = 20.0  # a few outlier channels, as layer-normed transformer states have
    return {
        "gelu": F.gelu(torch.randn(rows, cols, generator=g) * 2),
        "layernorm": F.layer_norm(torch.randn(rows, cols, generator=g) * 3 + 1, (cols,)) * gamma,
    }


@pytest.mark.parametrize("kind", ["gelu", "layernorm"])
@pytest.mark.parametrize("name", LOSSY)
def test_round_trip_error_is_within_the_stated_bound_on_realistic_activations(name, kind):
    x = activations()[kind]
    assert_within_bound(name, x, roundtrip(make(name), x))


@pytest.mark.parametrize("name", LOSSY)
def test_a_transposed_input_compresses_like_its_contiguous_copy(name):
    c = make(name)
    x = activations()["gelu"][:, :128].t()
    assert torch.equal(c.encode(x), c.encode(x.contiguous()))


@pytest.mark.parametrize("name", ALL)
def test_zero_rows_decode_to_exact_zeros(name):
    x = torch.zeros(8, 40)
    assert torch.equal(roundtrip(make(name), x), x)


@pytest.mark.parametrize("name", LOSSY)
def test_constant_rows_stay_within_the_bound_and_int8_keeps_them_exact(name):
    x = torch.tensor([3.14159, -2.5e-3, 7e4, -1.0]).repeat_interleave(64).view(4, 64)
    if name == "fp16":
        x = x.clamp(max=6e4)
    y = roundtrip(make(name), x)
    assert_within_bound(name, x, y)
    if name == "int8":
        assert torch.equal(y, x)


@pytest.mark.parametrize("scale", [1e30, 1e-30])
@pytest.mark.parametrize("name", LOSSY)
def test_huge_and_tiny_magnitudes_stay_within_the_bound(name, scale):
    if name == "fp16" and scale > 1:
        pytest.skip("fp16 overflows to inf beyond 65504 (tested below)")
    x = activations(64, 128)["gelu"] * scale
    assert_within_bound(name, x, roundtrip(make(name), x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp16_turns_finite_overflow_into_inf_instead_of_saturating(dtype):
    # 65519 is within half a step of 65504 and rounds to it; from 65520 on IEEE rounding gives inf.
    x = torch.tensor([[1.0, 7e4, -1e30, 65519.0, 65520.0, float("inf"), -float("inf"), 0.0]])
    x[0, -1] = float("nan")
    y = roundtrip(make("fp16"), x.to(dtype))
    inf = float("inf")
    want = torch.tensor([[1.0, inf, -inf, 65504.0, inf, inf, -inf, 0.0]])
    assert y[0, -1].isnan() and torch.equal(y[:, :-1], want[:, :-1])


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("out", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", LOSSY)
def test_no_compressor_turns_inf_or_nan_into_a_finite_value(name, dtype, out, bad):
    x = activations(3, 64)["gelu"].to(dtype)
    x[1, 17] = bad
    y = roundtrip(make(name), x, out)
    assert not torch.isfinite(y[1, 17]) and torch.isfinite(y[[0, 2]]).all()


def test_bf16_keeps_inf_and_nan_and_the_rest_of_their_row():
    x = torch.tensor([[1.0, 1e30, float("inf"), -float("inf"), float("nan")]])
    y = roundtrip(make("bf16"), x)
    assert y[0, 2] == float("inf") and y[0, 3] == -float("inf") and y[0, 4].isnan()
    assert_within_bound("bf16", x[:, :2], y[:, :2])


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("name", BLOCK_SCALED)
def test_a_row_with_inf_or_nan_decodes_to_all_nan_and_leaves_other_rows_alone(name, bad):
    c = make(name)
    x = activations(6, 64)["gelu"]
    x[2, 17] = bad
    y = roundtrip(c, x)
    assert y[2].isnan().all()
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(y[keep], roundtrip(c, x[keep]))
    assert_within_bound(name, x[keep], y[keep])


def test_int8_treats_a_row_whose_range_overflows_fp32_as_non_finite():
    x = torch.tensor([[-3e38, 3e38], [-1e38, 1e38]])
    y = roundtrip(make("int8"), x)
    assert y[0].isnan().all() and not y[1].isnan().any()


def test_zfp_turns_values_past_two_to_the_127_into_a_nan_row_but_not_values_just_below():
    c = make("zfp")
    x = activations(3, 64)["gelu"]
    x[0, 40] = 2.0**127
    x[1, 40] = 1.7e38  # just below 2^127 ~ 1.7014e38
    y = roundtrip(c, x)
    assert y[0].isnan().all() and not y[1:].isnan().any()


@pytest.mark.parametrize("cols", [1, 3, 4, 7, 64, 1001])
@pytest.mark.parametrize("name", ALL)
def test_wire_bytes_equals_the_encoded_payload_size(name, cols):
    c = make(name)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        b = c.encode(torch.randn(5, cols).to(dtype))
        assert b.nbytes == c.wire_bytes(5, cols, dtype)
        if name != "none":
            assert b.dtype == torch.uint8 and b.shape == (5, c.wire_bytes(1, cols))


@pytest.mark.parametrize("name", ALL)
def test_an_empty_batch_encodes_and_decodes(name):
    c = make(name)
    b = c.encode(torch.empty(0, 48))
    assert b.shape[0] == 0
    y = c.decode(b, torch.float32, 48)
    assert y.shape == (0, 48) and y.dtype == torch.float32


@pytest.mark.parametrize("name", ALL)
def test_any_run_of_rows_decodes_alone_as_it_does_in_the_whole_payload(name):
    c = make(name)
    x = activations(97, 90)["layernorm"]  # 90 columns: zfp pads each row
    b = c.encode(x)
    whole = c.decode(b, torch.float32, 90)
    for lo, hi in [(0, 1), (5, 37), (40, 41), (60, 97), (96, 97)]:
        assert torch.equal(c.decode(b[lo:hi], torch.float32, 90), whole[lo:hi])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", LOSSY)
def test_bf16_and_fp16_inputs_round_trip_to_their_own_dtype(name, dtype):
    c = make(name)
    x = activations(32, 128)["gelu"].to(dtype)
    y = roundtrip(c, x, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    y32 = roundtrip(c, x)
    assert_within_bound(name, x.float(), y32)
    assert torch.equal(y, y32.to(dtype))
    if name == {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]:
        assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_none_is_a_bitwise_identity_for_every_dtype(dtype):
    c = make("none")
    x = torch.randn(9, 33).to(dtype)
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    b = c.encode(x)
    assert b is x and c.decode(b, dtype, 33) is x and c.lossless


@pytest.mark.parametrize("name", LOSSY)
def test_encode_leaves_its_input_unchanged(name):
    x = activations(8, 64)["gelu"]
    x[3, 3] = float("nan")
    before = x.clone()
    make(name).encode(x)
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(
        x.nan_to_num(), before.nan_to_num()
    )


@pytest.mark.parametrize("name", LOSSY)
def test_bad_inputs_raise_errors_that_name_them(name):
    c = make(name)
    with pytest.raises(ValueError, match="2-D"):
        c.encode(torch.randn(4))
    with pytest.raises(TypeError, match="floating"):
        c.encode(torch.ones(2, 4, dtype=torch.int32))
    b = c.encode(torch.randn(3, 16))
    with pytest.raises(ValueError, match="bytes per row"):
        c.decode(b, torch.float32, 17 if name != "zfp" else 40)


def test_a_compressor_registered_by_a_user_is_built_by_name_with_its_options(plugin):
    class ScaledFP32:
        name = "test-scaled-fp32"
        lossless = True

        def __init__(self, k: float = 1.0) -> None:
            self.k = k

        def encode(self, x):
            return (x.float() * self.k).contiguous().view(torch.uint8)

        def decode(self, b, dtype, cols):
            return (b.view(torch.float32) / self.k).to(dtype)

        def wire_bytes(self, rows, cols, dtype=torch.float32):
            return 4 * rows * cols

    plugin(COMPRESSORS, "test-scaled-fp32", ScaledFP32)

    c = build("test-scaled-fp32", {"test-scaled-fp32": {"k": 2.0}, "zfp": {"rate": 4}})
    x = torch.randn(3, 5)
    assert c.k == 2.0 and torch.equal(roundtrip(c, x), x)
    assert "test-scaled-fp32" in COMPRESSORS.names()


def test_an_unknown_compressor_name_raises_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown compressor 'fp4'") as e:
        build("fp4")
    for name in ALL:
        assert name in str(e.value)


def test_zfp_takes_its_rate_from_the_options():
    c = make("zfp", rate=4)
    assert c.rate == 4 and c.wire_bytes(1, 1024) == 512
    assert make("zfp").wire_bytes(1, 1024) == 1024  # the default, 8 bits/value: 4x for fp32


@pytest.mark.parametrize("rate", [2, 33, 8.1, 0])
def test_zfp_rejects_rates_it_cannot_code_at_a_fixed_width(rate):
    with pytest.raises(ValueError, match="rate"):
        make("zfp", rate=rate)


def test_zfp_without_zfpy_raises_import_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zfpy", None)  # makes `import zfpy` fail
    with pytest.raises(ImportError, match=r"pip install 'schemoe\[zfp\]'"):
        build("zfp")


@pytest.mark.parametrize("rate,limit", [(8, 0.03), (12, 0.003), (16, 0.0003)])
def test_zfp_error_on_smooth_rows_is_within_its_empirical_bound(rate, limit):
    c = make("zfp", rate=rate)
    g = torch.Generator().manual_seed(1)
    t = torch.linspace(0, 6.28, 512)
    x = torch.sin(t * 4 * torch.rand(256, 1, generator=g) + 6 * torch.rand(256, 1, generator=g))
    x = x * 10 * torch.rand(256, 1, generator=g)
    rel = (roundtrip(c, x) - x).abs().amax(1) / x.abs().amax(1)
    assert rel.max() < limit


@pytest.mark.parametrize("rate,limit", [(12, 0.02), (16, 0.002)])
def test_zfp_error_on_random_rows_shrinks_with_the_rate(rate, limit):
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(2))
    rel = (roundtrip(make("zfp", rate=rate), x) - x).abs().amax(1) / x.abs().amax(1)
    assert rel.max() < limit


def test_zfp_flushes_values_below_two_to_the_minus_98_so_tiny_blocks_do_not_decode_to_garbage():
    c = make("zfp")
    x = torch.full((2, 64), 1e-31)
    x[0, :4] = torch.tensor([1.0, -2.0, 0.5, 3.0])  # one normal block, the rest tiny
    x[:, 8:12] = torch.tensor([4e-30, -5e-30, 6e-30, 3.5e-30])  # block max >= 2^-98: kept
    y = roundtrip(c, x)
    assert torch.equal(y[:, 12:], torch.zeros(2, 52))
    assert ((y[:, 8:12] - x[:, 8:12]).abs() <= 0.25 * 6e-30).all()
    assert_within_bound("zfp", x, y)


@pytest.mark.parametrize("rate", [2.25, 9, 12.5, 32])
def test_zfp_rows_split_at_any_rate_because_rows_fill_whole_bytes(rate):
    c = make("zfp", rate=rate)
    x = activations(41, 90)["gelu"]
    b = c.encode(x)
    assert b.nbytes == c.wire_bytes(41, 90)
    whole = c.decode(b, torch.float32, 90)
    for lo, hi in [(0, 1), (3, 17), (40, 41)]:
        assert torch.equal(c.decode(b[lo:hi], torch.float32, 90), whole[lo:hi])


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8", "int8"])
def test_encoding_in_row_chunks_gives_the_same_bytes_as_one_chunk(name, monkeypatch):
    c = make(name)
    x = activations(50, 64)["layernorm"]
    x[7, 3], x[31, 0] = float("inf"), float("nan")
    whole = c.encode(x)
    monkeypatch.setattr(base, "CHUNK_VALUES", 3 * 64 + 5)  # 3-row chunks, last one short
    assert len(base.row_chunks(50, 64)) == 17
    assert torch.equal(c.encode(x), whole)
