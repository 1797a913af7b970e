#!/usr/bin/env bash
# The GPU checks of schemoe in one go, for the first machine with a CUDA GPU (one is enough).
#
#   scripts/device_check.sh OUT_DIR        # from the repository root, venv in .venv (or $PATH)
#
# Runs, each with its own time limit (7.5 minutes at most in all, on one GPU), writing the output of
# each step to OUT_DIR/<step>.txt and a summary (one line per step, its exit code) to
# OUT_DIR/summary.txt:
#   1. env         torch / CUDA / GPU facts
#   2. pytest      `pytest -m cuda` (tests/test_cuda.py: policies x algorithms x compressors on
#                  one GPU against the reference, gloo ranks with CUDA tensors, no host sync under
#                  sync_debug_mode "error", overlap in a CUDA trace when >= 2 GPUs)
#   3. bench       `schemoe bench layer --device cuda` at a small shape (CUDA-event timing)
#   4. train       `schemoe train --device cuda --steps 20` (NCCL, one rank per GPU, up to 4),
#                  then the same with --dtype bf16
# Exit code: 0 when every step passed, else the number of failed steps.
set -uo pipefail

out=${1:?usage: scripts/device_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
summary="$out/summary.txt"
: >"$summary"
failed=0

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name: $*" | tee "$out/$name.txt"
    timeout "$limit" "$@" >>"$out/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc ${SECONDS}s-total $((SECONDS - t0))s" | tee -a "$summary"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step env 60 "$py" -c "import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.is_available(), torch.cuda.device_count(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
step pytest 210 "$py" -m pytest -m cuda -q -rs tests/test_cuda.py
gpus=$("$py" -c "import torch; print(min(4, max(1, torch.cuda.device_count())))")
step bench 60 "$py" -m schemoe bench layer --device cuda --nproc "$gpus" \
    --policies sequential,schemoe --chunks 1,4 --tokens 4096 --model-dim 1024 --hidden-dim 4096 \
    --repeats 5
step train 60 "$py" -m schemoe train --device cuda --nproc "$gpus" --steps 20 --eval-seqs 16
step train_bf16 60 "$py" -m schemoe train --device cuda --nproc "$gpus" --steps 20 \
    --eval-seqs 16 --dtype bf16
echo "failed steps: $failed" | tee -a "$summary"
exit "$failed"
