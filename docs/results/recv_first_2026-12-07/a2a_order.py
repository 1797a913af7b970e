"""gloo's all_to_all_single against schemoe's receives-first exchange (`_common.start_exchange`),
on the testbed, ranks arriving apart. Each round every rank sleeps a random 0-30 ms (seeded, the
same draw on every rank) after a barrier, then runs the exchange; the figure is the time from the
last rank's arrival to the last rank's finish (max over ranks), median of 15 rounds, two seeds,
the two methods interleaved. Both results are checked equal. As root, from the repository root:

    schemoe testbed up --nodes 2 --rate 200mbit
    schemoe testbed run --ranks-per-node 1 -- docs/results/recv_first_2026-12-07/a2a_order.py
    schemoe testbed run --ranks-per-node 2 -- docs/results/recv_first_2026-12-07/a2a_order.py
    schemoe testbed down
"""

import os
import random
import time

import torch
import torch.distributed as dist

from schemoe.collectives._common import start_exchange

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rpn = int(os.environ["LOCAL_WORLD_SIZE"])
rate = 25e6  # bytes/s: 200 Mbit/s


def gloo_alltoall(out, x, splits):
    dist.all_to_all_single(out, x, splits, splits)


def receives_first(out, x, splits):
    for work in start_exchange(x, splits, splits, None, out):
        work.wait()


def after_last_arrival(fn, seed, rounds=15):
    rng, times = random.Random(seed), []
    for _ in range(rounds):
        skews = [rng.uniform(0, 0.03) for _ in range(world)]
        dist.barrier()
        t0 = time.perf_counter()
        time.sleep(skews[rank])
        fn()
        t = torch.tensor([time.perf_counter() - t0 - max(skews)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return sorted(times)[rounds // 2]


for kb in (655, 1310):
    n = kb * 1024 // 4 // world * world
    x = torch.randn(n)
    splits = [n // world] * world
    a, b = torch.empty_like(x), torch.empty_like(x)
    res = {"gloo alltoall": [], "receives first": []}
    for seed in range(2):
        res["gloo alltoall"].append(after_last_arrival(lambda: gloo_alltoall(a, x, splits), seed))
        res["receives first"].append(after_last_arrival(lambda: receives_first(b, x, splits), seed))
    assert torch.equal(a, b)
    off_node = n * 4 * (world - rpn) / world * rpn  # bytes a node sends to the other
    if rank == 0:
        cells = ", ".join(f"{k} {[round(v * 1e3, 1) for v in vs]} ms" for k, vs in res.items())
        print(
            f"{world // rpn} x {rpn} ranks, {kb} KB per rank, arrivals 0-30 ms apart: after the "
            f"last arrival {cells}; the node's bytes at 200 Mbit/s {off_node / rate * 1e3:.1f} ms",
            flush=True,
        )
dist.destroy_process_group()
