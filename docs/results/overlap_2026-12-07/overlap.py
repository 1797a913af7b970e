"""Compute under a transfer: a fixed amount of GEMM work on the calling thread, alone and while
an exchange with the other rank (every receive posted before the send, as the library's
all-to-all on gloo) is in flight; medians of 25 rounds, 2 ranks.

    torchrun --nproc-per-node 2 overlap.py                       # loopback
    schemoe testbed run --ranks-per-node 1 -- overlap.py         # the testbed (2 x 1)
"""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
peer = 1 - rank
a, b = torch.randn(128, 256), torch.randn(256, 256)


def gemms(n: int) -> None:
    for _ in range(n):
        a @ b


def median(f, rounds: int = 25) -> tuple[float, ...]:
    out = []
    for _ in range(rounds):
        dist.barrier()
        out.append(f())
    out.sort()
    return out[rounds // 2]


def rounds(n_bytes: int, n_gemms: int) -> tuple[float, float, float]:
    x, y = torch.randn(n_bytes // 4), torch.empty(n_bytes // 4)

    def alone_compute():
        t = time.perf_counter()
        gemms(n_gemms)
        return time.perf_counter() - t

    def alone_transfer():
        t = time.perf_counter()
        for h in (dist.irecv(y, peer), dist.isend(x, peer)):
            h.wait()
        return time.perf_counter() - t

    def both():
        t = time.perf_counter()
        hs = (dist.irecv(y, peer), dist.isend(x, peer))
        gemms(n_gemms)
        c = time.perf_counter() - t
        for h in hs:
            h.wait()
        return c, time.perf_counter() - t

    c0, x0 = median(alone_compute), median(alone_transfer)
    c1, t1 = median(both)
    return c0, x0, c1, t1


tag = os.environ.get("TAG", "")
for kb in (320, 1024):
    for n in (10, 40):
        c0, x0, c1, t1 = rounds(kb << 10, n)
        if rank == 0:
            print(
                f"{tag} {kb} KB each way, {n} GEMMs: compute alone {c0 * 1e3:.1f} ms, transfer "
                f"alone {x0 * 1e3:.1f} ms; together: compute {c1 * 1e3:.1f} ms "
                f"(x{c1 / c0:.2f}), both done {t1 * 1e3:.1f} ms",
                flush=True,
            )
dist.destroy_process_group()
