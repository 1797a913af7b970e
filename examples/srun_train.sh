#!/usr/bin/env bash
# `schemoe train` on a Slurm allocation: one torchrun per node, one rank per GPU.
#
#   salloc --nodes 2 --gpus-per-node 8 --ntasks-per-node 1
#   srun examples/srun_train.sh --ep-size 8 --steps 200      # any `schemoe train` arguments
#
# srun starts this script once per node; it hands torchrun the launcher facts Slurm knows
# (nodes, this node's index, GPUs on the node, the first node as rendezvous host), and torchrun
# sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE for each rank; schemoe reads only those.
# Without Slurm: one node, one rank per visible GPU (at least one).
set -euo pipefail
nnodes=${SLURM_NNODES:-1}
node_rank=${SLURM_NODEID:-0}
per_node=${SLURM_GPUS_ON_NODE:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')}
head=127.0.0.1
if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null; then
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
exec python3 -m torch.distributed.run --nnodes "$nnodes" --node-rank "$node_rank" \
    --nproc-per-node "$per_node" --rdzv-backend c10d --rdzv-endpoint "$head:${MASTER_PORT:-29500}" \
    -m schemoe train "$@"
