"""Activation checkpointing of blocks that hold MoE layers, with selective recompute.

Legend: N dispatch-buffer rows of this rank, T tokens of this rank, M model dim.

A block run under `torch.utils.checkpoint` (non-reentrant) drops the tensors its forward saved
for backward and recomputes them, by running the block's forward again, when backward first needs
one. Run naively, that second forward repeats each MoE layer's expert-parallel step (the counts
exchange, the dispatch and combine all-to-alls, the experts), and the region's backward, whose
per-chunk gradients are separate autograd calls, triggers yet more recomputations. The context
below recomputes the block but never its all-to-alls:

  * first forward ("record"): each MoE layer call runs its scheduled region as usual, its outputs
    (combined rows [N, M], shared output [T, M]) go on a tape in call order, and the region's own
    autograd Function keeps its backward state outside the block's checkpoint. With
    `recompute_experts` (the default) each chunk's expert call (and the shared experts' call) runs
    under a checkpoint of its own: the region keeps the rows the dispatch all-to-all delivered and
    the region's backward recomputes the experts' activations from them (local compute, no
    transfer); without it the region keeps the experts' activations too;
  * recomputation ("replay"): each MoE layer call routes and encodes again (its saved tensors are
    among those the checkpoint dropped) but takes its region outputs from the tape: no all-to-all,
    no expert forward, no host sync. The region's backward runs exactly once per call, from the
    first forward's graph, so every rank issues the plain run's collectives in the same order.

Kept per MoE layer call: the combined rows [N, M], the received rows [N, M] and each chunk's
expert output (the root its backward starts from), with shared experts their input and output
[T, M]; with `recompute_experts=False` also every saved expert activation (e.g. [N, H] per FFN
layer). Recomputed: everything else in the block (attention, norms, the router, encode and
decode). The tape lives with the checkpoint's frame: it is freed with the graph.

Why not torch's selective checkpointing (`create_selective_checkpoint_contexts` with a policy
that saves the region's outputs): it caches the outputs of dispatcher ops, and the region is an
autograd Function around a Python executor, not an op; a custom op wrapping it could not hand
its backward the region's per-chunk graphs.

Use `checkpoint_block(block, *args)`, or pass `context_fn=moe_checkpoint_context` to
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` or to torch's `checkpoint_wrapper`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .region import keep_graph

__all__ = ["checkpoint_block", "moe_checkpoint_context", "replaying", "selective"]

# The innermost active checkpoint context of this thread: ("record" | "replay", _Tape). Thread-local
# because autograd recomputes on its device thread (CUDA) and the region computes on the caller's.
_active = threading.local()


class _Tape:
    """The expert-parallel outputs of one checkpointed call's MoE layer calls, in call order."""

    def __init__(self, recompute_experts: bool) -> None:
        self.recompute_experts = recompute_experts
        self.entries: list[tuple[int, Any]] = []  # (id of the layer, its outputs)
        self.cursor = 0  # next entry a replay hands out


class _Mode:
    """A re-enterable context manager (torch enters the recompute context once per backward that
    recomputes, e.g. twice with retain_graph=True) that makes `tape` this thread's active one."""

    def __init__(self, mode: str, tape: _Tape) -> None:
        self.mode, self.tape = mode, tape

    def __enter__(self) -> None:
        if self.mode == "replay":
            self.tape.cursor = 0
        stack = _active.__dict__.setdefault("stack", [])
        stack.append((self.mode, self.tape))

    def __exit__(self, *exc) -> None:
        _active.stack.pop()


def moe_checkpoint_context(*, recompute_experts: bool = True) -> tuple[_Mode, _Mode]:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)` that
    makes the MoE layers inside `fn` keep their all-to-alls' results instead of recomputing them
    (module docstring). `recompute_experts=False` (pass it through functools.partial) keeps the
    experts' activations too: no expert recomputation, more memory. Returns (forward context,
    recompute context)."""
    tape = _Tape(recompute_experts)
    return _Mode("record", tape), _Mode("replay", tape)


def checkpoint_block(
    block: Callable,
    *args: Any,
    recompute_experts: bool = True,
    use_reentrant: bool = False,
    **kwargs: Any,
):
    """`block(*args, **kwargs)` under non-reentrant activation checkpointing, its MoE layers'
    all-to-alls and experts kept rather than recomputed (module docstring).

    Args:
        block: the module or function to checkpoint (e.g. a transformer block).
        *args: its positional arguments (tensors as for torch.utils.checkpoint).
        recompute_experts: recompute the experts' activations in the region's backward from the
            kept received rows (default: least memory); False keeps them (no expert recompute).
        use_reentrant: must be False (the default): reentrant checkpointing runs the first forward
            without autograd and cannot keep the region's backward state.
        **kwargs: passed to `block`, except those torch.utils.checkpoint.checkpoint takes
            itself (`preserve_rng_state`, `determinism_check`, `debug`, `early_stop`).

    Returns: what `block` returns.
    """
    if use_reentrant:
        raise ValueError(
            "checkpoint_block(use_reentrant=True) is not supported: reentrant checkpointing "
            "recomputes the whole block, all-to-alls included; use use_reentrant=False (the "
            "default), or torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False, "
            "context_fn=schemoe.moe_checkpoint_context)"
        )
    if "context_fn" in kwargs:
        raise ValueError(
            "checkpoint_block sets context_fn itself (schemoe.moe_checkpoint_context); call "
            "torch.utils.checkpoint.checkpoint directly for another context_fn"
        )
    context_fn = functools.partial(moe_checkpoint_context, recompute_experts=recompute_experts)
    return checkpoint(block, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _current() -> tuple[str, _Tape] | None:
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def replaying() -> bool:
    """Whether this thread is recomputing a checkpointed block under `moe_checkpoint_context`
    (a MoE layer then skips its side effects: load counters, routing statistics)."""
    cur = _current()
    return cur is not None and cur[0] == "replay"


def _pack(t: torch.Tensor) -> torch.Tensor:
    # Saved as is (detached: a saved output would otherwise hold its own grad_fn in a cycle).
    return t.detach() if t.requires_grad else t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _like(t: torch.Tensor | None) -> torch.Tensor | None:
    # A leaf with the first forward's values and requires_grad, so the recomputed ops save the
    # same tensors as the first forward did (what torch.utils.checkpoint matches them by).
    return None if t is None else t.detach().requires_grad_(t.requires_grad)


class _Recomputed:
    """A region's experts (or shared experts) whose every call under autograd runs under a
    checkpoint of its own: the graph keeps the call's input rows and recomputes the activations
    when the region's backward differentiates it. Inside the record's hooks (`_pack`), so those
    input rows are kept rather than dropped by the block's checkpoint."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def parameters(self):
        return self.module.parameters()

    def __call__(self, *args):
        if not torch.is_grad_enabled():
            return self.module(*args)
        return checkpoint(self.module, *args, use_reentrant=False)


def _recomputed(region):
    shared = None if region.shared is None else _Recomputed(region.shared)
    return replace(region, experts=_Recomputed(region.experts), shared=shared)


def _same(region):
    return region


def selective(layer: torch.nn.Module, rows: int, run: Callable[[Callable], tuple]):
    """`run(wrap)`, a MoE layer's expert-parallel step on N = `rows` rows that runs the region
    `wrap(region)` and returns (out [N, M], shared out [T, M] or None), under the active
    checkpoint context, if any:

      * none: `run` as is;
      * record: `run` with torch's saved-tensor hooks set aside (the region keeps its backward
        state itself), its experts checkpointed if the context recomputes them, its outputs put
        on the tape;
      * replay: the outputs the record put on the tape for this call, `run` not called.
    """
    cur = _current()
    if cur is None:
        return run(_same)
    mode, tape = cur
    if mode == "record" and any(m == "replay" for m, _ in _active.stack):
        raise RuntimeError(
            "checkpoint_block (or moe_checkpoint_context) nested inside another is not "
            "supported: the outer recomputation would run the inner block's all-to-alls again; "
            "checkpoint the blocks side by side, each once"
        )
    if mode == "record":
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            out = run(_recomputed if tape.recompute_experts else _same)
        tape.entries.append((id(layer), tuple(_like(t) for t in out)))
        return out
    if tape.cursor >= len(tape.entries) or tape.entries[tape.cursor][0] != id(layer):
        raise RuntimeError(
            "the recomputation of a checkpointed block called its MoE layers in another order "
            "than its first forward did (moe_checkpoint_context replays their all-to-all "
            "results by call order): make the block's forward call the same layers each time"
        )
    kept = tape.entries[tape.cursor][1]
    if kept is None:
        raise RuntimeError(
            "this checkpointed block was already recomputed once and its kept MoE outputs "
            "freed; to run backward through it again, pass retain_graph=True the first time"
        )
    if not keep_graph():  # this graph's one recomputation: the tape lets go of the outputs
        tape.entries[tape.cursor] = (id(layer), None)
    tape.cursor += 1
    out_NM, s_TM = kept
    if out_NM.shape[0] != rows:
        raise RuntimeError(
            f"the recomputation of a checkpointed block routed {rows} rows into a MoE "
            f"layer whose first forward routed {out_NM.shape[0]}: the block's forward must be "
            "deterministic (torch.utils.checkpoint restores the RNG state; other state must not "
            "change between forward and backward)"
        )
    return _like(out_NM), _like(s_TM)
