"""A small GPT-style language model with MoE FFNs, for `schemoe train` and the examples.

Legend: B batch, L sequence length, M model dim, V vocabulary.

Also the data side of `schemoe train`: the byte-level corpus, training batches and the held-out
windows of the eval loss.

Blocks alternate a dense FFN and an MoE FFN (MoE in every other block, starting with the second),
pre-norm, causal self-attention via scaled_dot_product_attention, tied input/output embeddings.

With `micro_chunks` m > 1 the blocks run as a scheduled stack (schemoe/stack.py): each MoE block
is a stage (pre: the dense blocks before it, its norm, attention and residual, its MoE norm;
post: the residual, and in the last stage any dense blocks after it), the batch cut into m
micro-chunks under `stack_policy`. m = 1, or a batch m does not divide (an eval remainder), runs
the plain per-block loop. With `checkpoint` that loop runs every block under
`schemoe.checkpoint_block` (activation checkpointing that keeps the MoE all-to-alls).
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from ..dist.devices import control_zeros
from ..layer.moe import MoELayer
from ..layer.recompute import checkpoint_block
from ..scheduling import STACK_POLICIES
from ..step.stack import Stage, run_stack

__all__ = ["GPT", "MIN_CORPUS_BYTES", "GPTConfig", "load_corpus", "read_corpus", "text_problem"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    layers: int = 4
    heads: int = 4
    moe_every: int = 2
    micro_chunks: int = 1
    stack_policy: str = "wavefront"
    checkpoint: bool = False  # every block under checkpoint_block (activation checkpointing)

    def __post_init__(self) -> None:
        for n in ("vocab", "seq_len", "layers", "heads", "moe_every", "micro_chunks"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{n} must be a positive int, got {v!r}")
        STACK_POLICIES.get(self.stack_policy)  # ValueError listing the known ones
        if self.checkpoint and self.micro_chunks > 1:
            raise ValueError("checkpoint=True cannot run micro_chunks > 1 (the stack) yet")


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model dim {dim} must be divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BLM: torch.Tensor) -> torch.Tensor:
        B, L, M = x_BLM.shape
        q, k, v = self.qkv(x_BLM).view(B, L, 3, self.heads, M // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(o.transpose(1, 2).reshape(B, L, M))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: nn.Module, moe: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.ffn, self.moe = _Attention(dim, heads), ffn, moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if self.moe:
            y, aux = self.ffn(h)
        else:
            y, aux = self.ffn(h), h.new_zeros(())
        return x + y, aux


class _Pre(nn.Module):
    """A stack stage's pre: the dense blocks before an MoE block, then its attention half."""

    def __init__(self, dense: list[_Block], block: _Block) -> None:
        super().__init__()
        self.dense, self.block = nn.ModuleList(dense), block

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for blk in self.dense:
            x, _ = blk(x)
        x = x + self.block.attn(self.block.ln1(x))
        return x, self.block.ln2(x)


class _Post(nn.Module):
    """The last stage's post: the residual, then the dense blocks after the last MoE block."""

    def __init__(self, dense: list[_Block]) -> None:
        super().__init__()
        self.dense = nn.ModuleList(dense)

    def forward(self, x_res: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x_res + y
        for blk in self.dense:
            x, _ = blk(x)
        return x


def _stack_stages(blocks: list[_Block]) -> list[Stage]:
    stages, dense = [], []
    for blk in blocks:
        if blk.moe:
            stages.append(Stage(_Pre(dense, blk), blk.ffn))
            dense = []
        else:
            dense.append(blk)
    if stages and dense:
        stages[-1] = Stage(stages[-1].pre, stages[-1].moe, _Post(dense))
    return stages


class GPT(nn.Module):
    """forward(tokens [B, L]) -> (logits [B, L, V], summed aux loss of the MoE layers)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, *, group=None, seed: int = 0) -> None:
        super().__init__()
        M = moe.experts.model_dim
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, M)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, M))
        blocks = []
        for i in range(cfg.layers):
            is_moe = (i + 1) % cfg.moe_every == 0
            if is_moe:
                ffn: nn.Module = MoELayer(moe, group=group, seed=seed * 1000 + i)
            else:
                H = moe.experts.hidden_dim
                ffn = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
            blocks.append(_Block(M, cfg.heads, ffn, is_moe))
        self.blocks = nn.ModuleList(blocks)
        # The same blocks as stack stages (a plain list: not registered twice as submodules).
        self._stages = _stack_stages(blocks) if cfg.micro_chunks > 1 else []
        self.ln_f = nn.LayerNorm(M)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens_BL.dim() != 2 or tokens_BL.shape[1] > self.cfg.seq_len:
            raise ValueError(
                f"tokens must be [B, L<={self.cfg.seq_len}], got {tuple(tokens_BL.shape)}"
            )
        x = self.embed(tokens_BL) + self.pos[: tokens_BL.shape[1]]
        aux = x.new_zeros(())
        if self._stages and tokens_BL.shape[0] % self.cfg.micro_chunks == 0:
            x, a = run_stack(self._stages, x, self.cfg.micro_chunks, self.cfg.stack_policy)
            return self.ln_f(x) @ self.embed.weight.t(), aux + a
        for blk in self.blocks:
            ckpt = self.cfg.checkpoint and torch.is_grad_enabled()
            x, a = checkpoint_block(blk, x) if ckpt else blk(x)
            aux = aux + a
        return self.ln_f(x) @ self.embed.weight.t(), aux


MIN_CORPUS_BYTES = 10_000  # below this a run would see the same few windows over and over


CORPUS_SUFFIXES = (".py", ".txt", ".md")
INSTALLED = frozenset({"site-packages", "dist-packages"})  # not the stdlib: varies per machine


def corpus_files(path: str | None) -> tuple[Path, list[Path]]:
    """The corpus root and its files in order. The default (no path) is the stdlib's own sources:
    the walk skips the installed packages under it, which differ from machine to machine."""
    root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise ValueError(f"corpus path {str(root)!r} does not exist")
    if root.is_file():
        return root, [root]
    if not root.is_dir():
        raise ValueError(f"corpus path {str(root)!r} is neither a file nor a folder")
    files = []
    for folder, dirs, names in os.walk(root):
        if path is None:
            dirs[:] = [d for d in dirs if d not in INSTALLED]
        at = Path(folder)
        files += [at / n for n in names if Path(n).suffix in CORPUS_SUFFIXES]
    files = sorted(f for f in files if f.is_file())
    if not files:
        raise ValueError(f"corpus folder {str(root)!r} holds no .py, .txt or .md file")
    return root, files


def corpus_size(path: str | None, max_bytes: int) -> int:
    """The number of tokens `load_corpus(path, max_bytes)` returns, from file sizes (no read)."""
    total = 0
    for f in corpus_files(path)[1]:
        if total >= max_bytes:
            break
        total += min(f.stat().st_size, max_bytes - total)
    return total


def text_problem(data: bytes, *, utf8: bool) -> str | None:
    """Why `data` is not text, or None: a NUL byte (no text file has one; most binaries do), or
    with `utf8` a byte that is not UTF-8 (a multi-byte character cut at the end is not)."""
    if (at := data.find(b"\0")) >= 0:
        return f"it holds a NUL byte at offset {at} (a binary file?)"
    if utf8:
        try:
            codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        except UnicodeDecodeError as e:
            return f"byte {data[e.start]:#04x} at offset {e.start} is not UTF-8"
    return None


def read_corpus(path: str | None, max_bytes: int) -> bytearray:
    """The first `max_bytes` bytes of the corpus (`load_corpus`'s), checked: a file named as
    the corpus must be UTF-8 text, a file of a folder must hold no NUL byte (sources in legacy
    encodings are text too), and the whole must be >= MIN_CORPUS_BYTES; ValueError naming the
    path otherwise."""
    root, files = corpus_files(path)
    buf = bytearray()
    for f in files:
        if len(buf) >= max_bytes:
            break
        part = f.read_bytes()[: max_bytes - len(buf)]
        if why := text_problem(part, utf8=f == root):
            raise ValueError(
                f"corpus file {str(f)!r} is not text: {why}; give a UTF-8 text file or a folder "
                "of .py, .txt or .md files"
            )
        buf += part
    if len(buf) < MIN_CORPUS_BYTES:
        what = "is empty" if not buf else f"has only {len(buf)} bytes"
        raise ValueError(
            f"corpus at {str(root)!r} {what}; a corpus needs >= {MIN_CORPUS_BYTES} bytes"
        )
    return buf


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Byte tokens of a text file, a folder of .py/.txt/.md files, or the Python stdlib sources
    (`read_corpus`: ValueError naming a file that is not text or a corpus too small)."""
    buf = read_corpus(path, max_bytes)
    return torch.frombuffer(buf, dtype=torch.uint8).long()  # bytearray: writable, no copy


def batch(data: torch.Tensor, size: int, seq: int, g: torch.Generator):
    """`size` random windows of the token stream: (inputs [size, seq], next tokens [size, seq])."""
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
    chunk = data[starts[:, None] + torch.arange(seq + 1)]
    return chunk[:, :-1], chunk[:, 1:]


def eval_windows(data: torch.Tensor, n: int, seq: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of n evenly spaced held-out windows [n / world, seq + 1]; n is rounded
    down to a multiple of world so every rank runs the same number of (collective) forwards."""
    n = max(world, n // world * world)
    starts = torch.linspace(0, data.numel() - seq - 1, n).long()[rank::world]
    return data[starts[:, None] + torch.arange(seq + 1)]


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, size: int) -> float:
    """Mean next-token cross-entropy over every rank's windows (collective when distributed)."""
    was = model.training
    model.eval()
    tot = control_zeros(2, dtype=torch.float64)  # on the backend's device
    dev = next(model.parameters()).device
    for w in windows.split(size):
        w = w.to(dev)
        logits, _ = model(w[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].reshape(-1), reduction="sum")
        tot[0] += ce.to(tot.device)
        tot[1] += w[:, 1:].numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tot)
    model.train(was)
    return float(tot[0] / tot[1])
