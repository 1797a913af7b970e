"""A rank's host set-up: its CPU threads, and glibc's malloc told to keep freed memory.

Why the allocator: an MoE step allocates and frees the same large CPU tensors every call (the
dispatch buffer and the experts' activations, k T rows of M or H each: 25 MB each at T=2048,
k=6, M=512, fp32). glibc's malloc hands such blocks to the kernel when they are freed (blocks
over its mmap threshold are unmapped; free memory at the top of the heap past its trim
threshold is returned) and takes them back on the next call, one page fault per 4 KiB page
touched again. The faults grow with the rows per step, so a fine-grained layer (E64 k6) pays
about three times what E8 k2 of the same FLOPs pays: one process, dropless, T 2048, M 512
(docs/results/layer2026_2026-12-07/layer_page_faults.txt), E64 k6 / E8 k2 per step 1.63x with
glibc's defaults, 1.13x with freed memory kept; 0.95 M minor faults -> 0.39 M; peak RSS 1523 ->
1582 MiB. `python -m schemoe.dist.host` counts the faults of a 32 MiB allocate-fill-free loop
either way on any box.

`keep_freed_memory()` sets two of glibc's malloc parameters for this process (mallopt, through
ctypes): no mmap for large blocks (M_MMAP_MAX = 0; they come from the heap, whose freed space
is reused) and a trim threshold of 2 GiB (M_TRIM_THRESHOLD: free memory at the heap's top stays
up to that). The cost: the process keeps its peak heap instead of returning it between steps
(a training loop's peak is its steady state anyway), and a heap without mmap fragments: a
request can grow it before a freed block fits (the layer run above: +3.9% peak RSS). It is
what torch's CPU tuning guide gets by preloading jemalloc or tcmalloc, without a preload. Not
glibc (macOS, musl): nothing is set.

Who calls it: every rank the package starts (`schemoe.dist.launch.spawn`, `schemoe train`
under torchrun, the `schemoe bench` and `schemoe profile` ranks) through `configure_rank`.
Importing schemoe sets nothing; in a user's own loop, calling it is the user's choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import resource

import torch

__all__ = ["TRIM_THRESHOLD", "configure_rank", "freed_memory_kept", "keep_freed_memory"]

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, 2 GiB
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory this process frees (see the module docstring).

    Returns whether it is in effect: True on glibc (set once per process; later calls do
    nothing), False elsewhere. Process-wide and not undone."""
    global _kept
    if _kept is None:
        _kept = _set_mallopt()
    return _kept


def _set_mallopt() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # Both or neither: mallopt returns 1 on success.
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
    return ok and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def freed_memory_kept() -> bool:
    """Whether `keep_freed_memory` is in effect in this process."""
    return bool(_kept)


def configure_rank(threads: int, keep_memory: bool = True) -> None:
    """A rank process's host set-up: `threads` intra-op CPU threads; freed memory kept unless
    `keep_memory` is False (glibc's defaults, e.g. to measure what keeping it gains)."""
    torch.set_num_threads(threads)
    if keep_memory:
        keep_freed_memory()


def _faults_of_a_step_loop(keep: bool, steps: int = 10, mb: int = 32, warmup: int = 10) -> int:
    """Minor page faults of `steps` allocate-fill-free cycles of an `mb` MiB tensor, after
    `warmup` cycles (kept memory: until the heap has grown a free block that fits the request,
    which took up to 8 cycles in a spawned rank)."""
    if keep:
        keep_freed_memory()
    n = mb * 2**20 // 4
    for _ in range(warmup):
        torch.empty(n).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        torch.empty(n).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


if __name__ == "__main__":
    import subprocess
    import sys

    # Each setting in a fresh process: keep_freed_memory cannot be undone.
    code = "import sys; from schemoe.dist.host import _faults_of_a_step_loop as f; "
    code += "print(f(sys.argv[1] == '1'))"
    for keep in (0, 1):
        out = subprocess.run([sys.executable, "-c", code, str(keep)], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
        print(f"keep_freed_memory={bool(keep)}: {out} minor page faults in 10 cycles of 32 MiB")
