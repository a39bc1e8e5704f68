#!/usr/bin/env bash
# One machine's share of a multi-node titanlite job: start this machine's torchrun agent.
#
# Run the same line on every machine, changing only NODE_RANK (0 on the machine named by
# MASTER_ADDR); the arguments go to `titanlite train` unchanged:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       configs/multinode/node.sh --config configs/small.toml --parallel.dp_replicate 2
#
# The agents meet at MASTER_ADDR:MASTER_PORT (c10d rendezvous), agree on who is who, and each
# starts NPROC_PER_NODE training processes. See configs/multinode/README.md.
#
# Optional: RDZV_ID (names the job at the rendezvous; default "titanlite", SLURM passes its job
# id), RDZV_JOIN_TIMEOUT (seconds to wait for all machines; default 600), LOCAL_ADDR (the
# address the other machines reach this one at, when its hostname does not resolve for them),
# MAX_RESTARTS (torchrun restarts of the whole job after a failure; default 0), TORCHRUN.
set -euo pipefail

die() {
    echo "node.sh: $*" >&2
    exit 2
}

require() {  # require NAME HINT: fail with one line naming the variable when it is unset or empty
    [[ -n "${!1:-}" ]] || die "$1 is not set: $2"
}

require NNODES "export NNODES=<number of machines>, e.g. NNODES=2"
require NODE_RANK "export NODE_RANK=<this machine's index>: 0 on the MASTER_ADDR machine, then 1, 2, ..."
require MASTER_ADDR "export MASTER_ADDR=<hostname or IP of machine 0>, reachable from every machine"
require MASTER_PORT "export MASTER_PORT=<a free TCP port on machine 0>, e.g. MASTER_PORT=29500"
require NPROC_PER_NODE "export NPROC_PER_NODE=<processes on this machine>: its number of GPUs (or 1 on a CPU)"

in_range() {  # in_range VALUE LOW HIGH: a plain decimal integer within [LOW, HIGH]
    [[ "$1" =~ ^[0-9]+$ ]] && ((10#$1 >= $2 && 10#$1 <= $3))
}
if ! in_range "$NNODES" 1 100000; then
    die "NNODES=$NNODES is not a positive integer: set it to the number of machines"
fi
if ! in_range "$NODE_RANK" 0 $((10#$NNODES - 1)); then
    die "NODE_RANK=$NODE_RANK is not in 0..$((10#$NNODES - 1)): number the $NNODES machines from 0"
fi
if ! in_range "$MASTER_PORT" 1 65535; then
    die "MASTER_PORT=$MASTER_PORT is not a TCP port: use a free port, e.g. 29500"
fi
if ! in_range "$NPROC_PER_NODE" 1 100000 && ! [[ "$NPROC_PER_NODE" =~ ^(gpu|cpu|auto)$ ]]; then
    die "NPROC_PER_NODE=$NPROC_PER_NODE is not a positive integer (or gpu|cpu|auto, as torchrun accepts)"
fi

TORCHRUN=${TORCHRUN:-torchrun}
command -v "$TORCHRUN" >/dev/null ||
    die "'$TORCHRUN' not found: activate titanlite's environment (source .venv/bin/activate) or set TORCHRUN=/path/to/torchrun"

# Under c10d rendezvous torchrun ignores --node-rank (it numbers the machines itself, by
# sorted hostname), so NODE_RANK's one job is to say which agent hosts the rendezvous store.
# Saying it explicitly beats torchrun's guess from the hostname, which fails when
# MASTER_ADDR is an IP of a second network card, and is ambiguous with two agents on one machine.
if ((10#$NODE_RANK == 0)); then is_host=1; else is_host=0; fi
rdzv_conf="is_host=$is_host,join_timeout=${RDZV_JOIN_TIMEOUT:-600}"

args=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv-id "${RDZV_ID:-titanlite}" --rdzv-conf "$rdzv_conf"
    --max-restarts "${MAX_RESTARTS:-0}")
if [[ -n "${LOCAL_ADDR:-}" ]]; then
    args+=(--local-addr "$LOCAL_ADDR")
fi

# Workers keep a rendezvous store of their own: with torchrun's shared one a restarted
# attempt can read the failed attempt's addresses and never connect (torch 2.13, pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

echo "node.sh: machine $NODE_RANK of $NNODES, $NPROC_PER_NODE processes, rendezvous at $MASTER_ADDR:$MASTER_PORT (job ${RDZV_ID:-titanlite})" >&2
exec "$TORCHRUN" "${args[@]}" -m titanlite train "$@"
