#!/bin/bash
# lit3d under torchrun, one command per node (run it on every node with its NODE_RANK):
#   MASTER_ADDR=node0 NODE_RANK=0 NODES=2 bash examples/torchrun.sh --config configs/llama-8b.yaml
#   MASTER_ADDR=node0 NODE_RANK=1 NODES=2 bash examples/torchrun.sh --config configs/llama-8b.yaml
# Extra arguments go to `lit3d fit`. --trainer.num_nodes and --trainer.devices must match torchrun's (lit3d checks).
set -euo pipefail
NODES=${NODES:-1}
GPUS=${GPUS:-8}
torchrun --nnodes "$NODES" --nproc_per_node "$GPUS" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
    "$(dirname "$0")/../cli.py" fit --trainer.num_nodes="$NODES" --trainer.devices="$GPUS" "$@"
