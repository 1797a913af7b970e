"""`schemoe train --micro-chunks m`: the blocks run as a wavefront stack (schemoe/stack.py) and,
dropless, the losses follow m = 1's."""

from __future__ import annotations

import math

from schemoe import train as T
from train_cases import tiny

# Dropless (default aux loss weight): the same arithmetic up to the order of floating-point sums.
DROPLESS = ["--capacity-factor", "0", "--steps", "4"]


def _run(rank, world, extra):
    return T.train(rank, world, tiny(*extra))


def test_training_with_micro_chunks_follows_the_losses_of_one_micro_chunk(ranks):
    # The scheduled gradient sync: its Background queue is handed to the stack's executor.
    one = ranks(2).run(_run, [*DROPLESS, "--grad-sync", "scheduled"])[0]
    four = ranks(2).run(_run, [*DROPLESS, "--grad-sync", "scheduled", "--micro-chunks", "4"])[0]
    assert four["micro_chunks"] == 4 and one["micro_chunks"] == 1
    # Rounding differences (a few fp32 ulps per sum) grow through 4 Adam steps to ~1e-6
    # relative here; 5 significant digits is 1e-5 relative.
    for a, b in zip(four["losses"], one["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (four["losses"], one["losses"])
    assert math.isclose(four["eval_loss"], one["eval_loss"], rel_tol=1e-5)
