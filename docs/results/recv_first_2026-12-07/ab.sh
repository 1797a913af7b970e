#!/bin/sh
# The all-to-alls with every receive posted before any send (AFTER) against gloo's alltoall
# (BEFORE, 3f4342c), whole steps on the testbed at 200 and 600 Mbit/s, 2 x 1 and 2 x 2 ranks,
# schemoe r = 1, 4 and m = 1, 2 (scheduled bf16 sync), interleaved: before, after, before, after.
# As root, from the repository root:
#     sh docs/results/recv_first_2026-12-07/ab.sh > docs/results/recv_first_2026-12-07/ab.txt
# (ab.txt's "## ..." lines name the file schemoe.collectives was imported from; this runner
# prints schemoe.step.runtime's, the tree is the same.)
BEFORE=3f4342c RATES="200mbit 600mbit" MICRO=1,2 exec sh docs/results/early_weights_2026-12-07/ab.sh
