#!/bin/sh
# The all-to-alls with every receive posted before any send (AFTER) against gloo's alltoall
# (BEFORE, 3f4342c), whole steps on the testbed at 200 and 600 Mbit/s, 2 x 1 and 2 x 2 ranks,
# schemoe r = 1, 4 and m = 1, 2 (scheduled bf16 sync), interleaved: before, after, before, after.
# As root, from the repository root:
#     sh docs/results/recv_first_2026-12-07/ab.sh > docs/results/recv_first_2026-12-07/ab.txt
set -e
PY=${PY:-$PWD/.venv/bin/python}
BEFORE=${BEFORE:-3f4342c}
NEW=$PWD
OLD=$(mktemp -d)
git archive "$BEFORE" | tar -x -C "$OLD"
trap 'cd "$NEW"; $PY -m schemoe.cli testbed down >/dev/null 2>&1; rm -rf "$OLD"' EXIT
for rate in ${RATES:-200mbit 600mbit}; do
  cd "$NEW"; $PY -m schemoe.cli testbed up --nodes 2 --rate $rate >/dev/null
  for round in ${ROUNDS:-1 2}; do
    for rpn in 1 2; do
      for tree in before after; do
        if [ $tree = before ]; then cd "$OLD"; at=$BEFORE; else cd "$NEW"; at=$(git rev-parse --short HEAD); fi
        echo "## $rate, round $round, 2x$rpn, $tree (at $at: $($PY -c "import schemoe.collectives as s; print(s.__file__)"))"
        $PY -m schemoe.cli bench step --testbed --ranks-per-node $rpn --policies schemoe \
          --chunks 1,4 --micro-chunks 1,2 --grad-syncs scheduled --grad-compressors bf16 \
          --grad-algorithm hier --repeats 7 --timeout 900 --model-dim 256 --hidden-dim 512 \
          2>&1 | grep -v '^{' | grep -v '^# \(versions\|hardware\|link\|config\)'
      done
    done
  done
  cd "$NEW"; $PY -m schemoe.cli testbed down >/dev/null
done
