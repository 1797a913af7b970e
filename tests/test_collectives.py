"""Every all-to-all algorithm against `naive` (bitwise) and against a single-process reference.

One test item per (layout, case), run on ranks shared through the `ranks` fixture (a pool per
world size); each returns what failed, by check. Every rank builds every rank's input from the
case's seed, so it knows what it should receive.
"""

from __future__ import annotations

import pytest
import torch
from conftest import registered

from moe_cases import ALGOS
from schemoe.collectives import ALGORITHMS, Naive, build
from schemoe.dist.topology import Topology

# world -> ranks_per_node values (nodes x ranks per node) to run on that world's ranks.
LAYOUTS = {1: (1,), 4: (2, 1, 4), 6: (3, 2)}
DTYPES = (torch.float32, torch.bfloat16)
TRAILS = ((3,), ())  # rows of shape [N, 3] and [N]
KINDS = ("random", "random", "silent", "empty")


class UserAlgo:
    """A user's algorithm registered from outside the package (it delegates to naive)."""

    name = "test_user_algo"
    links = ("net",)

    def __init__(self, topology: Topology) -> None:
        self.inner = Naive(topology)

    def start(self, x, send_splits, recv_splits, *, link=None, out=None):
        return self.inner.start(x, send_splits, recv_splits, link=link, out=out)


def _counts(seed: int, world: int, kind: str) -> list[list[int]]:
    """C[s][d]: rows rank s sends to rank d; about a third of the pairs are empty."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 6, (world, world), generator=g)
    c[torch.rand(world, world, generator=g) < 0.3] = 0
    if kind == "silent":  # one rank sends nothing, another receives nothing
        c[seed % world, :] = 0
        c[:, (seed + 1) % world] = 0
    if kind == "empty":  # no rows anywhere
        c.zero_()
    return c.tolist()


def _input(seed: int, src: int, rows: int, trail: tuple[int, ...], dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + src)
    return torch.randn((rows, *trail), generator=g).to(dtype)


def _case(seed, kind, dtype, trail, rank, world):
    """(x, send, recv, expected) of `rank` for one case, from the seed alone."""
    c = _counts(seed, world, kind)
    x = _input(seed, rank, sum(c[rank]), trail, dtype)
    parts = []
    for s in range(world):
        off = sum(c[s][:rank])
        parts.append(_input(seed, s, sum(c[s]), trail, dtype)[off : off + c[s][rank]])
    return x, c[rank], [c[s][rank] for s in range(world)], torch.cat(parts)


def _garbage(like: torch.Tensor) -> torch.Tensor:
    # NaN never equals itself, so a row an algorithm forgot to write makes torch.equal fail.
    return torch.full_like(like, float("nan"))


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return "no ValueError"


CASES = [(k, d, t) for k in KINDS for d in DTYPES for t in TRAILS]
LAYOUT_PARAMS = [(w, rpn) for w, rpns in LAYOUTS.items() for rpn in rpns]


def _one_case(rank: int, world: int, rpn: int, i: int) -> dict:
    """One (layout, case): naive vs the reference, every algorithm vs naive (with and without
    out=), and Pipe-A2A's two parts into one buffer; the failures, by check."""
    kind, dtype, trail = CASES[i]
    topo = Topology.from_group(None, ranks_per_node=rpn)
    algos = {name: build(name, topo) for name in ALGOS}
    rep: dict = {"reference": [], "naive": [], "parts": []}
    seed = 17 * rpn + i
    label = f"{world // rpn}x{rpn} {kind} seed={seed} {dtype} shape=[N{', 3' * len(trail)}]"
    x, send, recv, want = _case(seed, kind, dtype, trail, rank, world)
    got = {n: a.start(x, send, recv).wait() for n, a in algos.items()}
    if not torch.equal(got["naive"], want):
        rep["reference"].append(label)
    for n in ALGOS[1:]:
        if got[n].shape != want.shape or not torch.equal(got[n], got["naive"]):
            rep["naive"].append(f"{n}: {label}")
        given = _garbage(want)
        if algos[n].start(x, send, recv, out=given).wait() is not given:
            rep["naive"].append(f"{n} (out=) did not return the given buffer: {label}")
        elif not torch.equal(given, got["naive"]):
            rep["naive"].append(f"{n} (out=): {label}")
    out = _garbage(want)
    inter = algos["pipe"].start(x, send, recv, link="inter", out=out)
    intra = algos["pipe"].start(x, send, recv, link="intra", out=out)
    intra.wait()
    inter.wait()
    if not torch.equal(out, got["naive"]):
        rep["parts"].append(label)
    return rep


def _in_flight_and_errors(rank: int, world: int, rpn: int) -> dict:
    """Two transfers of every algorithm in flight at once (waited in reverse order), bad input
    refused before any communication, and a user's algorithm built by name."""
    topo = Topology.from_group(None, ranks_per_node=rpn)
    algos = {name: build(name, topo) for name in ALGOS}
    rep: dict = {"flight": [], "errors": {}}
    a = _case(1000 + rpn, "random", torch.float32, (3,), rank, world)
    b = _case(2000 + rpn, "random", torch.float32, (), rank, world)
    for n, algo in algos.items():
        first, second = algo.start(*a[:3]), algo.start(*b[:3])
        if not (torch.equal(second.wait(), b[3]) and torch.equal(first.wait(), a[3])):
            rep["flight"].append(f"{n} {world // rpn}x{rpn}")
    x, send, recv, _ = _case(3000, "random", torch.float32, (3,), rank, world)
    negative = [-1] + list(send[1:])
    for n, algo in algos.items():
        rep["errors"][(n, "length")] = _error(algo.start, x, send[:-1], recv)
        rep["errors"][(n, "negative")] = _error(algo.start, x, negative, recv)
    rep["errors"][("pipe", "link")] = _error(algos["pipe"].start, x, send, recv, link="net")
    with registered(ALGORITHMS, "test_user_algo", UserAlgo):
        user = build("test_user_algo", topo)
        if not (isinstance(user, UserAlgo) and torch.equal(user.start(*a[:3]).wait(), a[3])):
            rep["flight"].append(f"test_user_algo {world // rpn}x{rpn}")
    return rep


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i][:2])))
@pytest.mark.parametrize("world,rpn", LAYOUT_PARAMS, ids=lambda v: str(v))
def test_every_algorithm_delivers_what_naive_and_the_reference_deliver(ranks, world, rpn, i):
    reps = ranks(world).run(_one_case, rpn, i)
    failed = {k: [f"rank {r}: {f}" for r, rep in enumerate(reps) for f in rep[k]] for k in reps[0]}
    assert failed == {"reference": [], "naive": [], "parts": []}


@pytest.mark.parametrize("world,rpn", LAYOUT_PARAMS, ids=lambda v: str(v))
def test_two_transfers_in_flight_at_once_both_arrive_intact(ranks, world, rpn):
    reps = ranks(world).run(_in_flight_and_errors, rpn)
    assert [f for rep in reps for f in rep["flight"]] == []


@pytest.mark.parametrize("world,rpn", LAYOUT_PARAMS, ids=lambda v: str(v))
def test_wrong_splits_length_or_negative_split_raises_value_error_naming_the_value(
    ranks, world, rpn
):
    errors = ranks(world).run(_in_flight_and_errors, rpn)[0]["errors"]
    for n in ALGOS:
        assert f"got {world - 1} and {world}" in errors[(n, "length")], (n, errors)
        assert "-1" in errors[(n, "negative")], (n, errors)
    assert "'net'" in errors[("pipe", "link")]


def test_a_user_algorithm_registered_outside_the_package_is_built_by_name(plugin):
    plugin(ALGORITHMS, "test_user_algo", UserAlgo)
    algo = build("test_user_algo", Topology(world=1, rank=0, ranks_per_node=1))
    assert isinstance(algo, UserAlgo)
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(algo.start(x, [3], [3]).wait(), x)
    assert "test_user_algo" in ALGORITHMS.names()
