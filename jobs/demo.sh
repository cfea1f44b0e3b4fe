#!/usr/bin/env bash
# The full demo (`make demo`): ResPipe surviving a killed stage, the plain
# pipeline for comparison, and Stannis on a host and 4 emulated CSDs, on the
# digits data that ships with scikit-learn. Logs, plots and a summary land in
# runs/demo/. About 3-5 minutes on a 2-core machine. The demo owns its four logs
# in runs/demo/ and replaces them on every run (--overwrite); no other file there.
#
# Knobs (environment): MPIPIPE_VENV (default .venv), DEMO_DIR (default
# runs/demo), RESPIPE_STEPS (default 300), STANNIS_STEPS (default 150).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${MPIPIPE_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
MPIRUN="$VENV/bin/mpirun --oversubscribe"
OUT=${DEMO_DIR:-runs/demo}
RESPIPE_STEPS=${RESPIPE_STEPS:-300}
STANNIS_STEPS=${STANNIS_STEPS:-150}
KILL_STEP=$((RESPIPE_STEPS / 2))

[[ -x $PY ]] || { echo "demo: error: no Python in $VENV; run 'make demo' from $ROOT" >&2; exit 2; }
export OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
mkdir -p "$OUT"
T0=$(date +%s)
step() { printf '\n=== [%3ds] %s\n' "$(($(date +%s) - T0))" "$*"; }

step "data: scikit-learn digits -> shards (data/digits), and the Stannis public/private split"
[[ -f data/digits/train/manifest.json ]] || "$PY" -m native.convert digits data/digits --overwrite
[[ -d data/stannis-digits ]] || "$PY" -m stannis prepare --source data/digits --out data/stannis-digits

step "ResPipe: 3 stages + 1 backup of stage 1, stage 1 killed (SIGKILL) at step $KILL_STEP"
$MPIRUN --with-ft ulfm -n 4 "$PY" -m mpipipe train --config jobs/configs/respipe-digits.toml \
    --set "run.steps=$RESPIPE_STEPS" --set "resilience.backups={1=1}" --inject "kill:stage=1:step=$KILL_STEP" --log "$OUT/respipe-kill.h5" --overwrite

step "plain pipeline: 3 stages, no backup, no fault (the baseline)"
$MPIRUN -n 3 "$PY" -m mpipipe train --config jobs/configs/pipeline-digits.toml \
    --set "run.steps=$RESPIPE_STEPS" --log "$OUT/pipeline.h5" --overwrite

step "plain pipeline, same kill, no backup: the job must stop with a clear error"
if $MPIRUN --with-ft ulfm -n 3 "$PY" -m mpipipe train --config jobs/configs/pipeline-digits.toml \
    --set "run.steps=$RESPIPE_STEPS" --set resilience.deadline_s=5.0 \
    --inject "kill:stage=1:step=$KILL_STEP" --log "$OUT/pipeline-kill.h5" --overwrite --quiet; then
    echo "demo: unexpected: the plain pipeline survived a dead stage" >&2
else
    echo "(stopped as expected; its log is still readable: $OUT/pipeline-kill.h5)"
fi

step "Stannis: host + 4 emulated CSDs (1/8 speed), HyperTune batch sizes"
$MPIRUN -n 5 "$PY" -m stannis train --config jobs/configs/stannis-digits.toml \
    --set "run.steps=$STANNIS_STEPS" --log "$OUT/stannis.h5" --overwrite

step "reports and plots"
"$PY" -m mpipipe report "$OUT/respipe-kill.h5" "$OUT/pipeline.h5" --out "$OUT/plots" | tee "$OUT/respipe-report.txt"
"$PY" -m mpipipe report "$OUT/stannis.h5" --out "$OUT/plots" | tee "$OUT/stannis-report.txt"

step "done in $(($(date +%s) - T0)) s"
echo "logs:    $OUT/respipe-kill.h5 $OUT/pipeline.h5 $OUT/pipeline-kill.h5 $OUT/stannis.h5"
echo "reports: $OUT/respipe-report.txt $OUT/stannis-report.txt"
echo "plots:   $OUT/plots/"
