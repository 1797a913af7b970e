#!/bin/bash
# The exit abort, A/B in one run: N rounds, each one small `bench layer` run (auto with an empty
# profile store, the shape of the auto figures' command) from checkout BEFORE, then one from
# AFTER, on one 2-node 400 Mbit/s testbed; counts the runs whose ranks did not all exit 0.
# Bounded (N rounds, 300 s per run); brings the testbed down at the end. As root:
#   bash docs/results/exit_abort_testbed.sh BEFORE_DIR AFTER_DIR N > docs/results/exit_abort_testbed.txt
set -u
BEFORE=$1; AFTER=$2; N=${3:-25}
PY=$(pwd)/.venv/bin/python
$PY -m schemoe.cli testbed up --nodes 2 --rate 400mbit > /dev/null
trap '$PY -m schemoe.cli testbed down > /dev/null' EXIT
echo "# $(date -u +%FT%TZ): $N rounds; before = $(git -C "$BEFORE" describe --always --dirty), after = $(git -C "$AFTER" describe --always --dirty)"
declare -A fails=([before]=0 [after]=0)
for i in $(seq 1 "$N"); do
  for side in before after; do
    dir=$BEFORE; [ $side = after ] && dir=$AFTER
    h=$(mktemp -d)
    (cd "$dir" && HOME=$h PYTHONPATH=$dir timeout 300 $PY -m schemoe.cli bench layer --testbed \
      --ranks-per-node 2 --policies auto,schemoe,tutel --chunks 1,2,4,8 --warmup 1 --repeats 2 \
      --tokens 256 --model-dim 64 --hidden-dim 128 > "$h/out.txt" 2> "$h/err.txt")
    rc=$?
    if [ $rc -ne 0 ]; then
      fails[$side]=$((fails[$side] + 1))
      echo "round $i $side: exit $rc: $(tr '\n' ' ' < "$h/err.txt" | cut -c1-160)"
    fi
    rm -rf "$h"
  done
done
echo "before: ${fails[before]} of $N runs failed; after: ${fails[after]} of $N runs failed"
