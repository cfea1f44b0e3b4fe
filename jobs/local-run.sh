#!/usr/bin/env bash
# One launcher for both systems on this machine with mpirun (what the .sbatch
# scripts run under Slurm, without Slurm). jobs/local-respipe.sh and
# jobs/local-stannis.sh call it; use those.
#
#   jobs/local-run.sh respipe|stannis [-n RANKS] [--testbed FILE] [CONFIG] [--set section.key=value ...] [--inject SPEC ...]
#
# --testbed FILE runs the ranks across the emulated nodes of a testbed file (needs root;
# see docs/testbed.md): they fill the nodes' slots in file order. The testbed is brought
# up for the run and taken down after it, unless exactly that testbed is up already.
# Ctrl-C or SIGTERM to this script stops the run cleanly at a step boundary (not under
# --testbed). The HDF5 log goes to runs/local-<time>/<system>.h5. The environment is the
# project's .venv, or the virtual environment named by MPIPIPE_VENV. More
# ranks than cores are fine: each rank gets one thread and waiting ranks yield.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SYSTEM=${1:-}
case $SYSTEM in
    # ResPipe runs under ULFM so that a dead stage is an error the survivors recover from
    respipe) RANKS=6; MODULE=mpipipe; FT=(--with-ft ulfm) ;;
    stannis) RANKS=5; MODULE=stannis; FT=() ;;
    *) echo "local-run.sh: error: the first argument must be respipe or stannis" >&2; exit 2 ;;
esac
shift
PROG=local-$SYSTEM.sh
VENV=${MPIPIPE_VENV:-$ROOT/.venv}
if [[ ! -x $VENV/bin/python || ! -x $VENV/bin/mpirun ]]; then
    echo "$PROG: error: no Python and mpirun in $VENV; run 'make install'" \
         "in $ROOT or set MPIPIPE_VENV to the environment to use" >&2
    exit 2
fi

TESTBED=
while (($#)); do
    case $1 in
        -n) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "$PROG: error: -n needs a number of ranks" >&2; exit 2; }
            RANKS=$2; shift 2 ;;
        --testbed) [[ -f ${2:-} ]] || { echo "$PROG: error: --testbed needs a testbed file" \
                                             "(e.g. jobs/testbed/respipe-phones.toml)" >&2; exit 2; }
            TESTBED=$(realpath "$2"); shift 2 ;;
        *) break ;;
    esac
done
CONFIG=$ROOT/jobs/configs/$SYSTEM-digits.toml
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

# Where the ranks go: this machine (more ranks than cores are fine), or a testbed's nodes
# (the testbed module gives the mpirun options, and runs mpirun with the testbed up).
PLACE=(--oversubscribe)
WRAP=()
if [[ -n $TESTBED ]]; then
    TB_ARGS=$("$VENV/bin/python" -m mpipipe testbed mpirun-args "$TESTBED") || exit 2
    mapfile -t PLACE <<<"$TB_ARGS"
    WRAP=("$VENV/bin/python" -m mpipipe testbed run "$TESTBED" --)
fi

echo "$SYSTEM: $RANKS ranks, config $CONFIG, log $RUN_DIR/$SYSTEM.h5${TESTBED:+, testbed $TESTBED}"
CMD=("$VENV/bin/mpirun" "${FT[@]}" "${PLACE[@]}" -n "$RANKS"
     "$VENV/bin/python" -m "$MODULE" train --config "$CONFIG" --log "$RUN_DIR/$SYSTEM.h5" "$@")
if [[ -n $TESTBED ]]; then
    exec "${WRAP[@]}" "${CMD[@]}"
fi
# Ctrl-C or SIGTERM stops the run at the next step boundary, with a checkpoint
# (run.checkpoint_dir) and the command that resumes it: this shell turns either into
# SIGUSR1, which mpirun forwards to every rank and lives through. mpirun runs in a
# session of its own so that the terminal's Ctrl-C reaches this shell only (Open MPI 5
# kills the ranks within half a second of a SIGINT or SIGTERM of its own).
setsid "${CMD[@]}" &
MPIRUN=$!
trap 'kill -USR1 "$MPIRUN" 2>/dev/null || true' TERM INT
while kill -0 "$MPIRUN" 2>/dev/null; do wait "$MPIRUN" || true; done
rc=0
wait "$MPIRUN" || rc=$?
exit "$rc"
