#!/usr/bin/env bash
# Multi-node launch of megatron-mech training with torchrun, one invocation per node.
#
#   TARGET=entry  (default) our megatron-core entry point, launch_scripts/pretrain_gpt_mech.py
#   TARGET=fork   a Megatron-LM fork patched with `megatron-mech patch apply $MEGATRON_LM_DIR`:
#                 $MEGATRON_LM_DIR/pretrain_gpt.py
#
# Environment (the usual torchrun multi-node variables; set them per node, e.g. from Slurm, see
# slurm_megatron_mech.sbatch):
#   NNODES          number of nodes                                (default 1)
#   NODE_RANK       this node's rank, 0 .. NNODES-1                (default 0)
#   MASTER_ADDR     address of node 0, reachable from every node   (default 127.0.0.1)
#   MASTER_PORT     a free TCP port on node 0                      (default 29500)
#   GPUS_PER_NODE   processes per node (one per GPU; on CPU-only machines, processes per node)  (default 8)
#   MEGATRON_LM_DIR the patched fork (TARGET=fork)
#   TORCHRUN        the launcher command                           (default: python3 -m torch.distributed.run)
#   PYTHON          the python that checks the flags' packages first (default: python3)
#
# Every other argument is passed to the training script (model, data, --mech-* flags), e.g.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 TARGET=fork MEGATRON_LM_DIR=~/Megatron-LM \
#     bash launch_scripts/torchrun_multinode.sh --tensor-model-parallel-size 2 ... --mech-interval 10 --mech-mols
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TARGET=${TARGET:-entry}
TORCHRUN=${TORCHRUN:-python3 -m torch.distributed.run}

case "$TARGET" in
  entry) script="$here/pretrain_gpt_mech.py" ;;
  fork)
    : "${MEGATRON_LM_DIR:?TARGET=fork needs MEGATRON_LM_DIR (a fork patched with megatron-mech patch apply)}"
    script="$MEGATRON_LM_DIR/pretrain_gpt.py"
    grep -q "mech_callsites" "$script" || {
      echo "error: $script is not patched; run: megatron-mech patch apply $MEGATRON_LM_DIR" >&2; exit 2; } ;;
  *) echo "error: TARGET must be entry or fork, got '$TARGET'" >&2; exit 2 ;;
esac
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NNODES" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]]; then
  echo "error: NODE_RANK=$NODE_RANK must be an integer in 0..NNODES-1 (NNODES=$NNODES)" >&2; exit 2
fi

# The Python packages the flags ask for (tensorboard for --tensorboard-dir, wandb for --mech-wandb-project), checked
# before torchrun starts: a missing one would end every worker, its reason under torchrun's ChildFailedError report.
# Exit 2 is a missing package; any other failure of the check (e.g. a PYTHON without megatron_mech, when TORCHRUN
# names another environment) leaves the verdict to the workers' own start-up checks.
check_path=${PYTHONPATH:-}
if [[ -f "$here/../megatron_mech/__init__.py" ]]; then  # a checkout (installed, the package is importable already)
  check_path="$here/..${check_path:+:$check_path}"
fi
check_status=0
# shellcheck disable=SC2086  # PYTHON may be a command with arguments
reason=$(PYTHONPATH="$check_path" ${PYTHON:-python3} -m megatron_mech.trainers.megatron_core.sink_packages "$@" 2>&1) || check_status=$?
if [[ "$check_status" -eq 2 ]]; then
  echo "$reason" >&2; exit 2
fi

# Megatron's tensor-parallel communication overlap expects one CUDA connection per device.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# shellcheck disable=SC2086  # TORCHRUN is a command with arguments
exec $TORCHRUN --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" "$script" "$@"
