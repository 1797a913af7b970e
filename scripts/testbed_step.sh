#!/usr/bin/env bash
# bench step on the 2-node testbed, its profile and the step model's validation (as root, from
# the repository root): scripts/testbed_step.sh RATE BUCKET_MB. Bounded; tears the testbed down.
set -u
cd "$(dirname "$0")/.."
S=.venv/bin/schemoe
R=docs/results
RATE=${1:-200mbit}
trap '$S testbed down >/dev/null 2>&1' EXIT
$S testbed down >/dev/null 2>&1
$S testbed up --nodes 2 --rate $RATE
$S bench step --testbed --ranks-per-node 2 --policies schemoe --chunks 4 \
    --grad-syncs ddp,scheduled --grad-compressors none,bf16 --grad-algorithm hier --peer deepspeed \
    --bucket-mb ${2:-1} --repeats 7 --trace runs/step_trace_$RATE > $R/step_2node_$RATE.txt 2>&1
$S testbed run --ranks-per-node 2 -- -m schemoe.cli profile --link-rate $RATE \
    --path $R/step_2node_$RATE.profile.json --model-dim 128 --hidden-dim 256 --tokens 512 --experts 8 \
    > $R/step_2node_$RATE.profile.txt 2>&1
$S validate $R/step_2node_$RATE.txt=$R/step_2node_$RATE.profile.json > $R/step_2node_$RATE.validate.txt 2>&1
$S testbed down
