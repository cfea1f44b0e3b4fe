#!/usr/bin/env bash
# ResPipe training on this machine with mpirun: what jobs/respipe.sbatch
# runs under Slurm, without Slurm.
#
# Usage, from anywhere:
#   jobs/local-respipe.sh [-n RANKS] [--testbed FILE] [CONFIG] [--set section.key=value ...] [--inject SPEC ...]
#
# CONFIG defaults to jobs/configs/respipe-digits.toml (3 stages and a backup
# of each: 6 ranks); RANKS must equal the stages plus the backups, e.g.
#   jobs/local-respipe.sh -n 4 --set 'resilience.backups={1=1}' --inject kill:stage=1:step=200
# The HDF5 log goes to runs/local-<time>/respipe.h5. The environment is the
# project's .venv, or the virtual environment named by MPIPIPE_VENV. More
# ranks than cores are fine: each rank gets one thread and waiting ranks
# yield.
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/local-run.sh" respipe "$@"
