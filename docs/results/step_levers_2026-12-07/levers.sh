#!/bin/bash
# Three levers on the #32 step at M=256 H=512, each an interleaved A/B on the testbed (as root,
# no other load), two rounds, an 8-row grid (sequential/schemoe, r = 1, m = 1, 2, ddp/scheduled,
# bf16; 4 rows for m = 2, 4), --measured-bound. Raw outputs in raw/, summary: summary.py.
#   pin:  each rank's threads pinned to one core (rank r -> core r % 2: "rank"; the ranks of node
#         n -> core n: "node2") against the OS scheduler ("none"). Needs pin.patch applied
#         (`git apply pin.patch`; it reads the mode from /tmp/pin_mode), reverted afterwards.
#   m4:   micro-chunks m = 4 beside m = 2.
#   pinmain: only each rank's main (compute) thread pinned, rank r -> core r % 2, just before the
#         timed calls (gloo's threads left to the OS): "main" against "none". Needs
#         pin_main.patch applied (the same /tmp/pin_mode), reverted afterwards.
#   m4:   micro-chunks m = 4 beside m = 2.
#   ss:   net.ipv4.tcp_slow_start_after_idle = 0 in every testbed namespace against 1 (default).
#   buf:  TCP socket buffers 4 MiB from the start (tcp_rmem / tcp_wmem defaults) against
#         131072 / 16384 bytes, in every testbed namespace.
# Run from the repository root: sh docs/results/step_levers_2026-12-07/levers.sh pin|pinmain|m4|ss|buf|trace
set -e
OUT=docs/results/step_levers_2026-12-07/raw
S="python -m schemoe.cli"
GRID="--grad-compressors bf16 --grad-algorithm hier --repeats 5 --timeout 600 --measured-bound --model-dim 256 --hidden-dim 512"
up() { $S testbed up --nodes 2 --rate $1 > /dev/null; }
down() { $S testbed down > /dev/null; }
step() { $S bench step --testbed --ranks-per-node $1 --policies sequential,schemoe --chunks 1 $2 $GRID; }
case "$1" in
pin)  # needs pin.patch applied
  for spec in "200mbit 1 r200x1 none rank" "200mbit 2 r200x2 none rank node2" "600mbit 1 r600x1 none rank"; do
    set -- $spec; rate=$1 rpn=$2 tag=$3; shift 3; up $rate
    for round in 1 2; do for mode in "$@"; do
      if [ $mode = none ]; then rm -f /tmp/pin_mode; else echo $mode > /tmp/pin_mode; fi
      step $rpn "--micro-chunks 1,2 --grad-syncs ddp,scheduled" > $OUT/${tag}_${mode}_$round.txt
    done; done
    rm -f /tmp/pin_mode; down
  done ;;
pinmain)  # needs pin_main.patch applied
  for rate in 200 600; do
    up ${rate}mbit
    for round in 1 2; do for mode in none main; do
      if [ $mode = none ]; then rm -f /tmp/pin_mode; else echo $mode > /tmp/pin_mode; fi
      step 1 "--micro-chunks 1,2 --grad-syncs ddp,scheduled" > $OUT/pm${rate}x1_${mode}_$round.txt
    done; done
    rm -f /tmp/pin_mode; down
  done ;;
buf)
  up 200mbit
  for round in 1 2; do for v in def big; do
    for ns in $(ip netns list | awk '{print $1}'); do
      if [ $v = def ]; then ip netns exec $ns sysctl -qw net.ipv4.tcp_rmem="4096 131072 6291456" net.ipv4.tcp_wmem="4096 16384 4194304"
      else ip netns exec $ns sysctl -qw net.ipv4.tcp_rmem="4096 4194304 6291456" net.ipv4.tcp_wmem="4096 4194304 4194304"; fi
    done
    step 1 "--micro-chunks 1,2 --grad-syncs ddp,scheduled" > $OUT/b200x1_${v}_$round.txt
  done; done
  down ;;
m4)
  up 200mbit
  for round in 1 2; do for rpn in 1 2; do
    step $rpn "--micro-chunks 2,4 --grad-syncs scheduled" > $OUT/m4_200mbit_${rpn}_$round.txt
  done; done
  down ;;
ss)
  up 200mbit
  for round in 1 2; do for v in 1 0; do
    for ns in $(ip netns list | awk '{print $1}'); do ip netns exec $ns sysctl -qw net.ipv4.tcp_slow_start_after_idle=$v; done
    step 1 "--micro-chunks 1,2 --grad-syncs ddp,scheduled" > $OUT/s200x1_ss${v}_$round.txt
  done; done
  down ;;
trace)  # one traced step of the best row family at 200 Mbit/s, 2 nodes x 1 rank
  T=docs/results/step_levers_2026-12-07/trace_200mbit_2x1
  up 200mbit
  $S bench step --testbed --ranks-per-node 1 --policies schemoe --chunks 1 --micro-chunks 2 --grad-syncs scheduled --grad-compressors bf16 --grad-algorithm hier --repeats 5 --model-dim 256 --hidden-dim 512 --trace $T > $T/bench_step.txt
  down ;;
esac
