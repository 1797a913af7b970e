#!/usr/bin/env bash
# Issue 31's must-shows on the 2-node testbed (as root, from the repository root; bounded; tears
# the testbed down): the layer's network share at RATE (bench layer, the balanced plan's f and
# the skewed start's f), the planning record (profile, stored in OUT/profile.json), then
# bench replan in capacity mode: Zipf 1.2 with a rotating hot set for 30 steps, then 120 balanced.
#   bash docs/results/replan_2026-12-06/replan_testbed.sh 1500mbit run1
#   bash docs/results/replan_2026-12-06/replan_testbed.sh 1500mbit run2 --replan-every 2
# (flags after the run name go to bench replan, after the defaults here, so they override them)
set -u
cd "$(dirname "$0")/../../.."
S=.venv/bin/schemoe
RATE=${1:-1500mbit}
OUT=docs/results/replan_2026-12-06/${2:-run1}
shift 2 || true
mkdir -p "$OUT"
SHAPE="--tokens 1024 --model-dim 512 --hidden-dim 512 --experts 8 --top-k 2"
trap '$S testbed down >/dev/null 2>&1' EXIT
$S testbed down >/dev/null 2>&1
{
echo "# $(date -u +%FT%TZ) at $(git describe --always --dirty)"
echo "\$ schemoe testbed up --nodes 2 --rate $RATE"
$S testbed up --nodes 2 --rate "$RATE"
for f in 1.25 4; do
  echo "\$ schemoe bench layer --testbed --ranks-per-node 2 $SHAPE --capacity-factor $f --repeats 5"
  timeout 600 $S bench layer --testbed --ranks-per-node 2 $SHAPE --capacity-factor $f --repeats 5
done
echo "\$ schemoe testbed run --ranks-per-node 2 -- -m schemoe.cli profile --path $OUT/profile.json --tokens 1024 --model-dim 512 --hidden-dim 512 --experts 8"
timeout 600 $S testbed run --ranks-per-node 2 -- -m schemoe.cli profile --path "$OUT/profile.json" \
  --tokens 1024 --model-dim 512 --hidden-dim 512 --experts 8
ARGS="--testbed --ranks-per-node 2 $SHAPE --layers 2 --capacity-factor 1.25 \
--capacity-factors 1,1.25,1.5,2,2.5,3,4 --phases zipf:1.2:rotate,balanced --phase-steps 30,120 \
--rotate-every 10 --replan-every 5 --profile $OUT/profile.json --timeout 1500 $*"
echo "\$ schemoe bench replan $ARGS"
timeout 1800 $S bench replan $ARGS
echo "rc=$?"
$S testbed down
} > "$OUT/bench_replan_testbed_$RATE.txt" 2>&1
