#!/bin/bash
# A full disk at save time on DCP checkpoints, then the resume: issue 35's must-show (exit within
# 10 s, the message, and the resumed run's next-step loss equal to the uninterrupted run's).
# As root (mounts a small tmpfs; unmounted at the end). From the repository root:
#   bash docs/results/faults_2026-12-06/full_disk_resume.sh > docs/results/faults_2026-12-06/full_disk_resume.txt 2>&1
set -u
PY=$(pwd)/.venv/bin/python
W=$(mktemp -d)
FULL=$W/full
mkdir -p "$FULL"
trap 'umount -l "$FULL" 2>/dev/null; rm -rf "$W"' EXIT
TINY="--device cpu --model-dim 32 --hidden-dim 48 --layers 2 --heads 2 --seq-len 32 --batch 4 \
--experts 4 --corpus-bytes 200000 --eval-seqs 8 --eval-every 0 --log-every 1000 --nproc 2 --steps 6"
echo "# $(date -u +%FT%TZ) at $(git describe --always --dirty); TINY = $TINY"
run() { echo "\$ schemoe train TINY $*"; $PY -m schemoe train $TINY "$@"; echo "rc=$?"; }

# 1. the uninterrupted run (its per-step losses in a JSONL log)
run --log-file "$W/straight.jsonl" > "$W/straight.out" 2>&1; tail -1 "$W/straight.out"
# 2. the same run saving every step onto a tmpfs that holds a few checkpoints only
# the tmpfs holds two and a half checkpoints of this run (measured on a one-step save)
$PY -m schemoe train $TINY --steps 1 --save "$W/probe" > /dev/null 2>&1
ck=$(du -sk "$W/probe/step-00000001" | cut -f1)
size=$(( ck * 5 / 2 ))k
mount -t tmpfs -o size=$size tmpfs "$FULL"
echo "# tmpfs $size (one checkpoint: ${ck} kB)"
t0=$(date +%s%N)
# when the failing save starts: its step-00000003.tmp folder appears (polled every 5 ms, 60 s at most)
( for _ in $(seq 1 12000); do [ -d "$FULL/ck/step-00000003.tmp" ] && { date +%s%N > "$W/fault"; break; }; sleep 0.005; done ) &
run --save "$FULL/ck" --save-every 1 --log-file "$W/full.jsonl"
t1=$(date +%s%N)
wait
echo "# start to exit: $(( (t1 - t0) / 1000000 )) ms; the failing save's start to exit: $(( (t1 - $(cat "$W/fault" 2>/dev/null || echo "$t1")) / 1000000 )) ms"
echo "# left on the tmpfs: $(ls "$FULL/ck" | tr '\n' ' '); latest -> $(cat "$FULL/ck/latest" 2>/dev/null || readlink "$FULL/ck/latest")"
# 3. resume from what `latest` names (copied off the full disk) and compare the next steps
cp -r "$FULL/ck" "$W/ck"
run --resume "$W/ck" --log-file "$W/resumed.jsonl" | tail -2
$PY - "$W" <<'PYEOF'
import json, sys
w = sys.argv[1]
def losses(name):
    rows = [json.loads(l) for l in open(f"{w}/{name}.jsonl") if l.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}
straight, resumed = losses("straight"), losses("resumed")
first = min(resumed)
print(f"resumed from step {first - 1}; steps {sorted(resumed)}")
for s in sorted(resumed):
    print(f"step {s}: uninterrupted {straight[s]!r}, resumed {resumed[s]!r}, equal {straight[s] == resumed[s]}")
print(json.dumps({"next_step": first, "next_step_loss_equal": straight[first] == resumed[first],
                  "all_equal": all(straight[s] == resumed[s] for s in resumed)}))
PYEOF
