#!/bin/sh
# The wavefront's heads-first step order (05be256) against the order before it (bf597fb), on the
# testbed at 200 Mbit/s, 2 x 1 and 2 x 2 ranks, the m = 2 rows (m = 1 runs no stack: unchanged),
# interleaved: before, after, before, after. Run as root from the repository root:
#     sh docs/results/wavefront_heads_2026-12-07/ab.sh > docs/results/wavefront_heads_2026-12-07/ab.txt
set -e
PY=${PY:-$PWD/.venv/bin/python}
NEW=$PWD
OLD=$(mktemp -d)
git archive bf597fb | tar -x -C "$OLD"
trap 'cd "$NEW"; $PY -m schemoe.cli testbed down >/dev/null; rm -rf "$OLD"' EXIT
$PY -m schemoe.cli testbed up --nodes 2 --rate 200mbit >/dev/null
for round in 1 2; do
  for rpn in 1 2; do
    for tree in before after; do
      if [ $tree = before ]; then cd "$OLD"; at=bf597fb; else cd "$NEW"; at=$(git rev-parse --short HEAD); fi
      echo "## round $round, 2x$rpn, $tree (at $at: $($PY -c "import schemoe.scheduling.stack as s; print(s.__file__)"))"
      $PY -m schemoe.cli bench step --testbed --ranks-per-node $rpn --policies schemoe \
        --chunks 1,4 --micro-chunks 2 --grad-syncs scheduled --grad-compressors bf16 \
        --grad-algorithm hier --repeats 7 --timeout 900 --model-dim 256 --hidden-dim 512 \
        2>&1 | grep -v '^{' | grep -v '^# \(versions\|hardware\|link\|config\)'
    done
  done
done
