"""The stack's runtime; schemoe/stack.py is its API and says what it computes. Here: `Stage`
(re-exported there), `StackCall`, the per-call state whose forward and backward run the stack
schedule, the executor's task runner, and `StackFn`, the autograd Function that wraps a call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import trace
from ..layer.moe import MoELayer
from ..layer.region import (
    ChunkRunner,
    OrderedSum,
    expert_backward,
    expert_forward,
    expert_params,
    keep_graph,
)
from ..routing.losses import choice_fractions
from ..scheduling import Direction, Kind, StackGraph, Task, execute, make_stack_schedule


@dataclass(frozen=True)
class Stage:
    """One block: pre(x) -> (x_res, h), the MoELayer on h, post(x_res, y) -> out (None: add)."""

    pre: nn.Module
    moe: MoELayer
    post: nn.Module | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.moe, MoELayer):
            raise TypeError(f"a stage's MoE must be a MoELayer, got {type(self.moe).__name__}")
        for name in ("pre", "post"):
            v = getattr(self, name)
            if not (isinstance(v, nn.Module) or (name == "post" and v is None)):
                raise TypeError(f"a stage's {name} must be an nn.Module, got {type(v).__name__}")


def as_stages(stages: Sequence) -> list[Stage]:
    out = [s if isinstance(s, Stage) else Stage(*s) for s in stages]
    if not out:
        raise ValueError("a stack needs at least one stage")
    return out


def _unique(params) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


# Graphs and schedules are plain values: built once per shape (a graph of a few hundred tasks
# costs about a millisecond of Python to build).
_graph = functools.lru_cache(maxsize=64)(StackGraph)


@functools.lru_cache(maxsize=64)
def _schedule(policy: str, graph: StackGraph, regions: tuple[tuple[Task, ...], ...]):
    return make_stack_schedule(policy, graph, regions)


class StackCall:
    """One call: the stages, the micro-chunks and everything the tasks hand each other."""

    def __init__(self, stages: list[Stage], m: int, policy: str) -> None:
        self.stages, self.m, self.policy = stages, m, policy
        links = {tuple(s.moe.algorithm.links) for s in stages}
        if len(links) != 1:
            raise ValueError(f"every stage's all-to-all must use the same links, got {links}")
        self.links = links.pop()
        if any(s.moe.config.shared is not None for s in stages):  # no S task in a stack graph yet
            raise ValueError("a scheduled stack (micro_chunks > 1) cannot run shared experts yet")
        # The gradient queue of the scheduled sync (`is not None`: an empty one is falsy). The
        # stack pumps it between its tasks but does not hold buckets back while its own
        # all-to-alls are in flight (`execute(yield_link=False)`): a bucket shares the link
        # with them. Holding back, as a region does, measured 1.02-1.13x slower steps on the
        # testbed at 2 x 1 ranks and 0.99-1.05x at 2 x 2 (docs/results/stack_queue_2026-12-07/).
        self.background = next(
            (s.moe.background for s in stages if s.moe.background is not None), None
        )
        # Parameters: AT differentiates pre + the layer's dense weights (gate), E the experts,
        # PO the post. One flat list (deduplicated) for the autograd Function.
        self.at_p, self.e_p, self.po_p = [], [], []
        for s in stages:
            experts = {id(p) for p in expert_params(s.moe.experts)}
            dense = [p for p in s.moe.parameters() if id(p) not in experts]
            self.at_p.append(_unique([*s.pre.parameters(), *dense]))
            self.e_p.append(expert_params(s.moe.experts))
            self.po_p.append(_unique(s.post.parameters()) if s.post is not None else [])
        self.params = _unique(p for ps in (*self.at_p, *self.e_p, *self.po_p) for p in ps)
        self.index = {id(p): n for n, p in enumerate(self.params)}
        # Dense gradients go to the gradient sync (grad_ready) a weight at a time, as soon as
        # each is final in backward (the sync gathers them into transfers of a bucket's size).
        # On CPU a block's weights are handed over while its AT backward still runs (`_early`).
        self.grad_ready = next((s.moe.grad_ready for s in stages if s.moe.grad_ready), None)
        self.dense = {self.index[id(p)] for ps in (*self.at_p, *self.po_p) for p in ps}
        self.rec: dict[tuple[int, int], dict] = {}  # (block, micro) -> tensors of the call
        self.freed = False  # a backward without retain_graph ran
        self.f_E: dict[int, torch.Tensor] = {}  # block -> its choices' fractions per expert

    def schedule(self, direction: Direction, policy: str | None = None):
        chunks = tuple(s.moe.schedule(direction)[0].chunks for s in self.stages)
        graph = _graph(chunks, self.m, self.links, direction)
        regions = tuple(tuple(s.moe.schedule(direction)[1].order["compute"]) for s in self.stages)
        return graph, _schedule(policy or self.policy, graph, regions)

    # ------------------------------------------------------------ forward
    def forward(self, x_B: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self.grad, self.xs = grad, x_B.chunk(self.m)
        # m > 1: each (block, micro-chunk) draws its random numbers (router noise, dropout) from
        # a stream of its own, seeded from one draw of the global generator, so they do not
        # depend on the order a policy runs the tasks in. (m = 1: the plain loop's draws.)
        self.seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if self.m > 1 else None
        graph, sched = self.schedule(Direction.FORWARD)
        execute(
            sched,
            graph,
            _Tasks(Kind.AT, self._at, self._po),
            trace.active("forward"),
            self.background,
            yield_link=False,
        )
        last = len(self.stages) - 1
        out = torch.cat([self.rec[(last, j)]["out"].detach() for j in range(self.m)])
        aux = 0
        for b in range(last + 1):
            a = 0
            for j in range(self.m):  # the z-loss: a mean over tokens, so over micro-chunks
                a = a + self.rec[(b, j)]["aux"].detach() / self.m
            if self.rec[(b, 0)]["balance"] is not None:
                a = self._balance(b) + a
            aux = aux + a
        return out, aux

    def _balance(self, b: int) -> torch.Tensor:
        """Block b's load-balancing loss over the whole batch, w E sum_e f_e P_e, with f and P
        the means of the micro-chunks' (equal token counts): the value m = 1 gives, as
        gating.load_balancing_loss computes it."""
        f_E, P_E = None, None
        for j in range(self.m):
            f, P = self.rec[(b, j)]["balance"]
            f_E = f if f_E is None else f_E + f
            P_E = P.detach() if P_E is None else P_E + P.detach()
        gate = self.stages[b].moe.running.gate
        self.f_E[b] = f_E = f_E / self.m
        return gate.aux_loss_weight * (gate.num_experts * torch.sum(f_E * (P_E / self.m)))

    def _at(self, b: int, j: int) -> ChunkRunner:
        stage = self.stages[b]
        x = self.xs[j] if b == 0 else self.rec[(b - 1, j)]["out"]
        leaf = x.detach().requires_grad_(self.grad)
        with torch.set_grad_enabled(self.grad), _stream(self.seed, b, j):
            x_res, h = stage.pre(leaf)
            rows_NM, meta, aux = stage.moe.dispatch(h, balance=False)
            balance = None
            if stage.moe.running.gate.aux_loss_weight > 0:
                r = meta.routing
                balance = choice_fractions(r.probs_TE, r.expert_TK), r.probs_TE.mean(0)
        region = stage.moe.region(meta)
        if self.grad:
            fn = expert_forward(region)
        else:
            fn = lambda i, x, counts: region.experts(x, counts)
        self.rec[(b, j)] = {
            "leaf": leaf,
            "x_res": x_res,
            "shape": h.shape,
            "rows": rows_NM,
            "meta": meta,
            "aux": aux,
            "balance": balance,
            "region": region,
        }
        return ChunkRunner(region, rows_NM.detach(), region.forward_compressor, fn)

    def _po(self, b: int, j: int, runner: ChunkRunner) -> None:
        # PO's graph starts from leaves (the region's rows, x_res, the combine weights), so its
        # backward stops there and AT's backward takes their gradients over.
        stage, rec = self.stages[b], self.rec[(b, j)]
        meta, x_res = rec["meta"], rec["x_res"]
        leaves = [runner.result(), x_res, meta.routing.weight_TK]
        leaves = [
            t.detach().requires_grad_(self.grad and (n == 0 or t.requires_grad))
            for n, t in enumerate(leaves)
        ]
        o_NM, res, w_TK = leaves
        meta = replace(meta, routing=replace(meta.routing, weight_TK=w_TK))
        with torch.set_grad_enabled(self.grad):
            y = stage.moe.dispatcher.combine(o_NM, meta).view(rec["shape"])
            out = res + y if stage.post is None else stage.post(res, y)
        rec.update(leaves=leaves, out=out)
        if not self.grad:  # nothing to differentiate: keep only what the call still reads
            self.rec[(b, j)] = {k: rec[k] for k in ("out", "aux", "balance")}
            if b > 0:
                self.rec[(b - 1, j)]["out"] = None

    # ------------------------------------------------------------ backward
    def backward(self, g_out: torch.Tensor, g_aux: torch.Tensor):
        if self.freed:
            raise RuntimeError(
                "this MoE stack's backward already ran and freed its graphs; to run backward "
                "through it again, pass retain_graph=True the first time"
            )
        self.keep = keep_graph()
        self.freed = not self.keep
        self.g_outs, self.g_aux = g_out.chunk(self.m), g_aux
        graph, sched = self.schedule(Direction.BACKWARD)
        # Weight gradients are summed in the sequential policy's backward order, whatever runs.
        order = self.schedule(Direction.BACKWARD, "sequential")[1].order["compute"]
        self.acc = OrderedSum(len(self.params), self._expected(order), self._final)
        execute(
            sched,
            graph,
            _Tasks(Kind.PO, self._po_bwd, self._at_bwd),
            trace.active("backward"),
            self.background,
            yield_link=False,
        )
        g_x = torch.cat([self.rec[(0, j)]["g_in"] for j in range(self.m)])
        return g_x, self.acc.result(self.params)

    def _final(self, n: int) -> None:
        """Parameter n's gradient is complete: hand a dense one to the gradient sync."""
        if n in self.dense and self.grad_ready is not None:
            self.grad_ready([self.params[n]], [self.acc.total(n, self.params[n])])

    @contextmanager
    def _early(self, t: Task, params: list[torch.Tensor]):
        """While task t's autograd call runs, put each weight's gradient as autograd computes
        it (a hook per weight), so the weights that become final early in a long AT backward
        (a block's attention before the dense blocks below it) go to the sync before the call
        returns: the last stage's backward is the step's last compute, and what it still holds
        is all-reduced after it. Yields the indices put. CPU only: on CUDA a hook runs on
        autograd's device thread, where no collective may start; there the call's weights are
        put when it returns."""
        done: set[int] = set()
        hooks = []
        if self.grad_ready is not None and all(p.device.type == "cpu" for p in params):
            for p in params:
                n = self.index[id(p)]

                def put(g: torch.Tensor, n: int = n) -> None:
                    done.add(n)
                    self.acc.put(t, [n], [g])

                hooks.append(p.register_hook(put))
        try:
            yield done
        finally:
            for h in hooks:
                h.remove()

    def _owner(self, t: Task) -> list[torch.Tensor]:
        return {Kind.AT: self.at_p, Kind.E: self.e_p, Kind.PO: self.po_p}[t.kind][t.block]

    def _expected(self, order) -> dict[int, list[Task]]:
        out: dict[int, list[Task]] = {n: [] for n in range(len(self.params))}
        for t in order:
            if t.kind in (Kind.AT, Kind.E, Kind.PO):
                for p in self._owner(t):
                    out[self.index[id(p)]].append(t)
        return out

    def _put(self, t: Task, grads, skip: set[int] = frozenset()) -> None:
        """Put task t's gradients of its owner's weights, but those already put (`skip`)."""
        pairs = [(self.index[id(p)], g) for p, g in zip(self._owner(t), grads)]
        pairs = [(n, g) for n, g in pairs if n not in skip]
        self.acc.put(t, [n for n, _ in pairs], [g for _, g in pairs])

    def _po_bwd(self, b: int, j: int) -> ChunkRunner:
        rec = self.rec[(b, j)]
        last = b == len(self.stages) - 1
        g = self.g_outs[j] if last else self.rec[(b + 1, j)].pop("g_in")
        ins = rec.pop("leaves") if not self.keep else rec["leaves"]
        live = [t.requires_grad for t in ins]
        grads = _grad(
            [rec["out"]], [t for t, ok in zip(ins, live) if ok] + self.po_p[b], g, self.keep
        )
        it = iter(grads)
        g_o, g_res, g_w = (next(it) if ok else None for ok in live)
        self._put(Task(Kind.PO, 0, 0, None, b, j), list(it))
        rec.update(g_res=g_res, g_w=g_w)
        if not self.keep:
            del rec["out"]
        region = rec["region"]

        def on_grads(i: int, gs) -> None:
            self._put(Task(Kind.E, 0, i, None, b, j), gs)

        fn = expert_backward(region, self.e_p[b], self.keep, on_grads)
        if g_o is None:
            g_o = torch.zeros_like(ins[0])
        return ChunkRunner(region, g_o.contiguous(), region.backward_compressor, fn, backward=True)

    def _at_bwd(self, b: int, j: int, runner: ChunkRunner) -> None:
        rec = self.rec[(b, j)]
        outs = [
            (rec["rows"], runner.result()),
            (rec["x_res"], rec["g_res"]),
            (rec["meta"].routing.weight_TK, rec["g_w"]),
            (rec["aux"], self.g_aux / self.m),
        ]
        if rec["meta"].dedup is not None:  # the receivers applied the combine weights
            outs.append((rec["meta"].dedup.weights_N, runner.weight_grads()))
        if rec["balance"] is not None:  # d(w E sum f P)/dP_j = w E f / m (the chain's order)
            gate = self.stages[b].moe.running.gate
            g_P = self.f_E[b] * (gate.num_experts * (gate.aux_loss_weight * self.g_aux))
            outs.append((rec["balance"][1], g_P / self.m))
        outs = [(t, g) for t, g in outs if t.requires_grad and g is not None]
        task = Task(Kind.AT, 0, 0, None, b, j)
        with self._early(task, self.at_p[b]) as done:
            grads = _grad(
                [t for t, _ in outs], [rec["leaf"], *self.at_p[b]], [g for _, g in outs], self.keep
            )
        self._put(task, grads[1:], skip=done)
        g_in = grads[0] if grads[0] is not None else torch.zeros_like(rec["leaf"])
        if not self.keep:
            self.rec[(b, j)] = {"g_in": g_in}
        else:
            rec["g_in"] = g_in


@contextmanager
def _stream(seed: int | None, b: int, j: int):
    """The CPU generator seeded for block b, micro-chunk j (restored after); None: untouched.
    CUDA generators are not forked (not yet run on CUDA: draws there follow the task order)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed + 1_000_003 * b + j)
        yield


def _grad(outputs, inputs, grad_outputs, keep: bool):
    if len(outputs) == 0 or len(inputs) == 0:
        return [None] * len(inputs)
    return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, retain_graph=keep)


class _Tasks:
    """The executor's TaskRunner for a stack: head/tail tasks (AT/PO forward, PO/AT backward)
    by the stack, region tasks by the ChunkRunner of their block and micro-chunk."""

    def __init__(self, first: Kind, head, tail) -> None:
        self.first, self.head, self.tail = first, head, tail
        self.runners: dict[tuple[int, int], ChunkRunner] = {}

    def run(self, t: Task) -> None:
        key = (t.block, t.micro)
        if t.kind == self.first:
            self.runners[key] = self.head(*key)
        elif t.kind in (Kind.AT, Kind.PO):
            self.tail(*key, self.runners.pop(key))
        else:
            self.runners[key].run(t)

    def start(self, t: Task):
        return self.runners[(t.block, t.micro)].start(t)

    def finish(self, t: Task, result) -> None:
        self.runners[(t.block, t.micro)].finish(t, result)


class StackFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st: StackCall, x: torch.Tensor, *params: torch.Tensor):
        out, aux = st.forward(x, grad=True)
        ctx.st = st
        return out, aux

    @staticmethod
    def backward(ctx, g_out: torch.Tensor, g_aux: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through a scheduled MoE stack is not "
                "supported: its backward runs autograd per stage outside the graph"
            )
        g_x, g_params = ctx.st.backward(g_out.contiguous(), g_aux)
        return (None, g_x, *g_params)
