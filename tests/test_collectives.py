"""Every all-to-all algorithm against `naive` (bitwise) and against a single-process reference.

One spawn per world size; each worker loops over every layout (ranks per node), algorithm and
case and returns a report of what failed, so a single run shows all failures at once. Every
rank builds every rank's input from the case's seed, so it knows what it should receive.
"""

from __future__ import annotations

import torch

from schemoe._dist import spawn
from schemoe.collectives import ALGORITHMS, Naive, build
from schemoe.topology import Topology

ALGOS = ("naive", "pairwise", "pipe", "hier2d", "leader")
# world -> ranks_per_node values to run in that world's single spawn (nodes x ranks per node).
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


def _run_cases(rank: int, world: int, layouts: tuple[int, ...]) -> dict:
    rep: dict = {"checks": 0, "reference": [], "naive": [], "parts": [], "flight": [], "errors": {}}
    for rpn in layouts:
        topo = Topology.from_group(None, ranks_per_node=rpn)
        algos = {name: build(name, topo) for name in ALGOS}
        pipe = algos["pipe"]
        for i, (kind, dtype, trail) in enumerate(
            (k, d, t) for k in KINDS for d in DTYPES for t in TRAILS
        ):
            seed = 17 * rpn + i
            label = f"{world // rpn}x{rpn} {kind} seed={seed} {dtype} shape=[N{', 3' * len(trail)}]"
            x, send, recv, want = _case(seed, kind, dtype, trail, rank, world)
            got = {n: a.start(x, send, recv).wait() for n, a in algos.items()}
            rep["checks"] += 1
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
            inter = pipe.start(x, send, recv, link="inter", out=out)
            intra = pipe.start(x, send, recv, link="intra", out=out)
            intra.wait()
            inter.wait()
            if not torch.equal(out, got["naive"]):
                rep["parts"].append(label)
        # Two transfers of every algorithm in flight at once, waited in reverse order.
        a = _case(1000 + rpn, "random", torch.float32, (3,), rank, world)
        b = _case(2000 + rpn, "random", torch.float32, (), rank, world)
        for n, algo in algos.items():
            first, second = algo.start(*a[:3]), algo.start(*b[:3])
            if not (torch.equal(second.wait(), b[3]) and torch.equal(first.wait(), a[3])):
                rep["flight"].append(f"{n} {world // rpn}x{rpn}")
        # Bad input is refused before any communication, identically on every rank.
        x, send, recv, _ = _case(3000, "random", torch.float32, (3,), rank, world)
        negative = [-1] + list(send[1:])
        for n, algo in algos.items():
            rep["errors"][(n, "length")] = _error(algo.start, x, send[:-1], recv)
            rep["errors"][(n, "negative")] = _error(algo.start, x, negative, recv)
        rep["errors"][("pipe", "link")] = _error(pipe.start, x, send, recv, link="net")
        user = build("test_user_algo", topo)
        if not (isinstance(user, UserAlgo) and torch.equal(user.start(*a[:3]).wait(), a[3])):
            rep["flight"].append(f"test_user_algo {world // rpn}x{rpn}")
    return rep


_REPORTS: dict[int, list[dict] | BaseException] = {}


def _reports() -> dict[int, list[dict]]:
    """One spawn per world size, shared by the tests below (each spawn costs seconds).

    A world whose run failed fails every test that reads it, not only the first one."""
    for world, layouts in LAYOUTS.items():
        if world not in _REPORTS:
            try:
                _REPORTS[world] = spawn(_run_cases, world, layouts, timeout=60)
            except (RuntimeError, TimeoutError) as e:
                _REPORTS[world] = e
    for rep in _REPORTS.values():
        if isinstance(rep, BaseException):
            raise rep
    return _REPORTS


def _failures(key: str) -> list[str]:
    return [
        f"world {w} rank {r}: {f}"
        for w, reps in _reports().items()
        for r, rep in enumerate(reps)
        for f in rep[key]
    ]


def test_naive_delivers_what_a_single_process_reference_expects():
    assert all(rep["checks"] == 16 * len(LAYOUTS[w]) for w, rs in _reports().items() for rep in rs)
    assert _failures("reference") == []


def test_every_algorithm_returns_bitwise_what_naive_returns_with_and_without_out():
    assert _failures("naive") == []


def test_pipe_started_inter_first_then_intra_into_one_buffer_matches_naive():
    assert _failures("parts") == []


def test_two_transfers_in_flight_at_once_both_arrive_intact():
    assert _failures("flight") == []


def test_wrong_splits_length_or_negative_split_raises_value_error_naming_the_value():
    for world, reps in _reports().items():
        errors = reps[0]["errors"]
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
