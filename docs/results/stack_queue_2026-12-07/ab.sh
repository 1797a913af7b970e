#!/bin/sh
# How a micro-chunk stack posts the scheduled sync's buckets, whole steps on the testbed at 600
# and 200 Mbit/s, 2 x 1 and 2 x 2 ranks, schemoe r = 1, 4 at m = 2 (scheduled bf16 sync; the
# change touches nothing else), interleaved: before, after, before, after. BEFORE is 3ea5ae9,
# where the stack took no queue (an empty Background tested false) and a bucket was posted only
# when the sync handed over the next one; AFTER, the commit checked out. As root, from the
# repository root:
#     sh docs/results/stack_queue_2026-12-07/ab.sh > docs/results/stack_queue_2026-12-07/ab.txt
# ab_held_back.txt: the same against abf887e, where the stack held buckets back while its
# all-to-alls were in flight (as a region does).
BEFORE=3ea5ae9 RATES="600mbit 200mbit" MICRO=2 exec sh docs/results/early_weights_2026-12-07/ab.sh
