#!/usr/bin/env bash
# train.py across the nodes of a SLURM allocation: one torchrun agent per node, a c10d rendezvous on the first
# node, and HSDP with one replica per node (shards within it). docs/parallelism.md, "More than one machine".
#
#   sbatch --nodes 4 scripts/launch_slurm.sh --config configs/7b_fp8.toml [more train.py options]
#
# Environment: GPUS_PER_NODE (8), RDZV_PORT (29500), REPLICATE (the node count; 1 = FSDP over every GPU),
# PYTHON (python); NCCL's own variables pass through (docs/parallelism.md lists those that matter).
#SBATCH --job-name=train
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

gpus_per_node=${GPUS_PER_NODE:-8}
replicate=${REPLICATE:-$SLURM_NNODES}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

cd "${SLURM_SUBMIT_DIR:-.}"
# --kill-on-bad-exit: a node whose agent fails takes the others down instead of leaving them waiting.
srun --kill-on-bad-exit=1 "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" --nproc_per_node "$gpus_per_node" \
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:${RDZV_PORT:-29500}" \
    train.py --parallelism.data_parallel_replicate_degree "$replicate" "$@"
