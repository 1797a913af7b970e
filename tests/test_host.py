"""A rank's host set-up (schemoe/dist/host.py): freed memory kept, so the large tensors a step
reallocates are not page-faulted back from the kernel every call."""

from __future__ import annotations

import platform

import pytest

from schemoe.bench import output
from schemoe.dist import host
from schemoe.dist.launch import spawn

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _faults_in_a_rank(rank: int, world: int) -> tuple[bool, int]:
    return host.freed_memory_kept(), host._faults_of_a_step_loop(False)


@glibc
def test_spawned_ranks_keep_freed_memory_and_stop_faulting_a_reallocated_large_tensor():
    [(kept, kept_faults)] = spawn(_faults_in_a_rank, 1)
    [(released, faults)] = spawn(_faults_in_a_rank, 1, keep_freed_memory=False)
    assert (kept, released) == (True, False)
    # glibc's defaults unmap the 32 MiB block at every free: each cycle faults all its pages.
    assert faults >= 10 * (32 * 2**20 // 4096) * 0.9, faults
    assert kept_faults * 5 < faults, (kept_faults, faults)


def test_the_bench_header_says_whether_freed_memory_is_kept(monkeypatch):
    for kept, words in ((True, "freed memory kept"), (False, "malloc defaults")):
        monkeypatch.setattr(host, "_kept", kept)
        (line,) = [h for h in output.header("t", {}, "one", "none") if "# hardware" in h]
        assert words in line, line
