#!/bin/bash
# Train with weft as REPLICA_GROUPS fault-tolerant replica groups on one machine ([fault_tolerance], torchft):
# a lighthouse, then one torchrun per group (PROCS processes each, its own GPUs), each restarted
# up to MAX_RESTARTS times after one of its processes dies while the other groups train on.
#
#   scripts/ft_groups.sh llama8b --training.steps 1000      # config, then overrides
#   REPLICA_GROUPS=4 PROCS=2 DUMP=/runs/8b scripts/ft_groups.sh llama8b
#
# Group g writes to $DUMP/group_g (its logs, metrics.jsonl, its own checkpoints) and uses GPUs
# g*PROCS .. g*PROCS+PROCS-1. The lighthouse listens on 127.0.0.1 only. Stops when every group has.

set -euo pipefail
CONFIG_FILE=${1:?usage: ft_groups.sh CONFIG_FILE [train.py overrides...]}
shift
REPLICA_GROUPS=${REPLICA_GROUPS:-2}  # replica groups (fault_tolerance.replica_groups)
PROCS=${PROCS:-1}                  # processes (GPUs) per group: its own FSDP/TP/... mesh
MIN_GROUPS=${MIN_GROUPS:-1}        # groups a step needs to commit (fault_tolerance.min_replica_groups)
MAX_RESTARTS=${MAX_RESTARTS:-3}    # restarts of one group after its process dies (each heals from a peer)
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
DUMP=${DUMP:-./outputs}
TORCHRUN=${TORCHRUN:-torchrun}
LIGHTHOUSE=${LIGHTHOUSE:-torchft_lighthouse}
cd "${WEFT_DIR:-$(dirname "$0")/..}"  # the weft checkout

# One store per torchrun round, so a restarted group never reads its dead round's addresses.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export RUST_LOG=${RUST_LOG:-warn}  # torchft's line per quorum and commit: off

# The lighthouse forms each step's quorum of live groups; a group silent for 5 s is left out.
"$LIGHTHOUSE" --bind "127.0.0.1:$LIGHTHOUSE_PORT" --min_replicas "$MIN_GROUPS" \
    --join_timeout_ms 60000 --heartbeat_timeout_ms 5000 &
LIGHTHOUSE_PID=$!
trap 'kill "$LIGHTHOUSE_PID" 2>/dev/null || true' EXIT

PIDS=()
for ((g = 0; g < REPLICA_GROUPS; g++)); do
    GPUS=$(seq -s, $((g * PROCS)) $((g * PROCS + PROCS - 1)))
    CUDA_VISIBLE_DEVICES=$GPUS "$TORCHRUN" --standalone --nproc_per_node "$PROCS" --max-restarts "$MAX_RESTARTS" \
        train.py --job.config_file "$CONFIG_FILE" --job.dump_folder "$DUMP/group_$g" \
        --fault_tolerance.enable --fault_tolerance.replica_id "$g" --fault_tolerance.replica_groups "$REPLICA_GROUPS" \
        --fault_tolerance.min_replica_groups "$MIN_GROUPS" \
        --fault_tolerance.lighthouse "http://127.0.0.1:$LIGHTHOUSE_PORT" --fault_tolerance.hostname 127.0.0.1 \
        "$@" &
    PIDS+=($!)
done
STATUS=0
for pid in "${PIDS[@]}"; do
    wait "$pid" || STATUS=$?
done
exit "$STATUS"
