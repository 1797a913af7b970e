#!/bin/sh
# The stack's dense weights handed to the scheduled sync one at a time as each becomes final
# (AFTER) against a stage at a time when its last AT backward returns (BEFORE, 0a6ab62), on the
# testbed at 600 and 200 Mbit/s, 2 x 1 and 2 x 2 ranks, the m = 2 scheduled rows (the change
# touches nothing else), interleaved: before, after, before, after. As root, from the repository
# root:  sh docs/results/early_weights_2026-12-07/ab.sh > docs/results/early_weights_2026-12-07/ab.txt
# (ab600.txt: RATES=600mbit ROUNDS="1 2 3 4" CHUNKS=1 sh ...; MICRO sets --micro-chunks, and
# docs/results/recv_first_2026-12-07/ab.sh runs this one with its own BEFORE and rows)
set -e
PY=${PY:-$PWD/.venv/bin/python}
BEFORE=${BEFORE:-0a6ab62}
NEW=$PWD
OLD=$(mktemp -d)
git archive "$BEFORE" | tar -x -C "$OLD"
trap 'cd "$NEW"; $PY -m schemoe.cli testbed down >/dev/null 2>&1; rm -rf "$OLD"' EXIT
for rate in ${RATES:-600mbit 200mbit}; do
  cd "$NEW"; $PY -m schemoe.cli testbed up --nodes 2 --rate $rate >/dev/null
  for round in ${ROUNDS:-1 2}; do
    for rpn in 1 2; do
      for tree in before after; do
        if [ $tree = before ]; then cd "$OLD"; at=$BEFORE; else cd "$NEW"; at=$(git rev-parse --short HEAD); fi
        echo "## $rate, round $round, 2x$rpn, $tree (at $at: $($PY -c "import schemoe.step.runtime as s; print(s.__file__)"))"
        $PY -m schemoe.cli bench step --testbed --ranks-per-node $rpn --policies schemoe \
          --chunks ${CHUNKS:-1,4} --micro-chunks ${MICRO:-2} --grad-syncs scheduled --grad-compressors bf16 \
          --grad-algorithm hier --repeats 7 --timeout 900 --model-dim 256 --hidden-dim 512 \
          2>&1 | grep -v '^{' | grep -v '^# \(versions\|hardware\|link\|config\)'
      done
    done
  done
  cd "$NEW"; $PY -m schemoe.cli testbed down >/dev/null
done
