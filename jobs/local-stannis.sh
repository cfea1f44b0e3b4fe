#!/usr/bin/env bash
# Stannis training on this machine with mpirun: what jobs/stannis.sbatch
# runs under Slurm, without Slurm.
#
# Usage, from anywhere:
#   jobs/local-stannis.sh [-n RANKS] [--testbed FILE] [CONFIG] [--set section.key=value ...] [--inject SPEC ...]
#
# CONFIG defaults to jobs/configs/stannis-digits.toml (a host and 4 emulated
# CSDs: 5 ranks); RANKS must equal 1 + stannis.csds. Make the demo data first
# with `python -m stannis prepare`. The HDF5
# log goes to runs/local-<time>/stannis.h5. The environment is the project's
# .venv, or the virtual environment named by MPIPIPE_VENV. More ranks than
# cores are fine: each rank gets one thread and waiting ranks yield.
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/local-run.sh" stannis "$@"
