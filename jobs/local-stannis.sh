#!/usr/bin/env bash
# Stannis training on this machine with mpirun: what jobs/stannis.sbatch
# runs under Slurm, without Slurm.
#
# Usage, from anywhere:
#   jobs/local-stannis.sh [-n RANKS] [CONFIG] [--set section.key=value ...] [--inject SPEC ...]
#
# CONFIG defaults to jobs/configs/stannis-digits.toml (a host and 4 emulated
# CSDs: 5 ranks); RANKS must equal 1 + stannis.csds. Make the demo data first
# with `python -m stannis prepare`. The HDF5
# log goes to runs/local-<time>/stannis.h5. The environment is the project's
# .venv, or the virtual environment named by MPIPIPE_VENV. More ranks than
# cores are fine: each rank gets one thread and waiting ranks yield.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MPIPIPE_VENV:-$ROOT/.venv}
if [[ ! -x $VENV/bin/python || ! -x $VENV/bin/mpirun ]]; then
    echo "local-stannis.sh: error: no Python and mpirun in $VENV; run 'make install'" \
         "in $ROOT or set MPIPIPE_VENV to the environment to use" >&2
    exit 2
fi

RANKS=5
if [[ ${1:-} == -n ]]; then
    [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "local-stannis.sh: error: -n needs a number of ranks" >&2; exit 2; }
    RANKS=$2
    shift 2
fi
CONFIG=$ROOT/jobs/configs/stannis-digits.toml
if (($#)) && [[ $1 != -* ]]; then
    CONFIG=$(realpath "$1")
    shift
fi
RUN_DIR=$ROOT/runs/local-$(date +%Y%m%d-%H%M%S)
mkdir -p "$RUN_DIR"

cd "$ROOT"
export PATH=$VENV/bin:$PATH
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
if [[ $(id -u) == 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

echo "stannis: $RANKS ranks, config $CONFIG, log $RUN_DIR/stannis.h5"
exec "$VENV/bin/mpirun" --oversubscribe -n "$RANKS" \
    "$VENV/bin/python" -m stannis train --config "$CONFIG" \
    --log "$RUN_DIR/stannis.h5" "$@"
