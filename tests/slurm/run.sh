#!/usr/bin/env bash
# End-to-end test of the Slurm job scripts on a private one-node cluster.
#
# `make test-slurm` runs this after the venv is installed. It installs
# Debian's slurm-wlm and munge if they are missing, starts a private munged,
# slurmctld and slurmd with tests/slurm/privslurm.py (config from
# tests/slurm/slurm.conf.in, every pid, state and log file in a temporary
# directory; tests/cluster uses it on the testbed), submits jobs/respipe.sbatch
# (with an injected stage kill) and jobs/stannis.sbatch, waits for both with a
# time limit, asserts that both COMPLETED and that their HDF5 logs hold the
# expected steps (and, for ResPipe, a failover event), and stops every daemon
# it started by process id, whatever happens (trap EXIT).
#
# A third job launches the training CLI with a bare `srun` (no PMI: N
# singletons) and must fail with the world-size message instead of training.
# A fourth is stopped with `scancel --batch --signal=TERM` (what the scripts'
# --signal=B:TERM@60 does at the time limit) and must leave a resumable run.
#
# Knobs (environment): MPIPIPE_VENV (default .venv), SLURM_TEST_TIMEOUT
# (seconds to wait for the jobs, default 900), SLURM_TEST_KEEP=1 (keep the
# state directory for debugging). To debug the cluster bring-up alone:
# RESPIPE_SBATCH / STANNIS_SBATCH name other scripts and SLURM_TEST_SMOKE=1
# skips the data, the log checks and the no-PMI job.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
VENV=${MPIPIPE_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
TIMEOUT_S=${SLURM_TEST_TIMEOUT:-900}
RESPIPE_SBATCH=${RESPIPE_SBATCH:-jobs/respipe.sbatch}
STANNIS_SBATCH=${STANNIS_SBATCH:-jobs/stannis.sbatch}
SMOKE=${SLURM_TEST_SMOKE:-0}

# Small runs: the expected step counts are checked in the HDF5 logs.
RESPIPE_STEPS=${RESPIPE_STEPS:-30}
STANNIS_STEPS=${STANNIS_STEPS:-20}
# ResPipe: 3 stages and one backup of stage 1 (4 tasks); stage 1 is killed.
RESPIPE_ARGS=(--ntasks=4 "$RESPIPE_SBATCH" jobs/configs/respipe-digits.toml
              --set "run.steps=$RESPIPE_STEPS" --set "resilience.backups={1=1}"
              --inject "kill:stage=1:step=10" --quiet)
STANNIS_ARGS=("$STANNIS_SBATCH" jobs/configs/stannis-digits.toml
              --set "run.steps=$STANNIS_STEPS" --quiet)

T0=$(date +%s)
say() { printf '[test-slurm %4ds] %s\n' "$(($(date +%s) - T0))" "$*"; }
die() { say "FAIL: $*" >&2; exit 1; }

[[ -x $PY ]] || die "no Python at $PY: run 'make install' first or set MPIPIPE_VENV"

# --- 1. install Slurm and munge (first time only) ---------------------------
install_packages() {
    local missing=()
    for tool in munged mungekey slurmctld slurmd sbatch scontrol; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) && return 0
    say "installing slurm-wlm and munge (missing: ${missing[*]})"
    [[ $(id -u) == 0 ]] || die "installing Slurm needs root; install slurm-wlm and munge, then rerun"
    # Packages must not start the system's own daemons: this test starts its
    # own and stops only those. policy-rc.d (exit 101) tells invoke-rc.d so.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    local rc=0
    { DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
          slurm-wlm munge </dev/null; } >"${TMPDIR:-/tmp}/test-slurm-apt.log" 2>&1 || rc=$?
    ((made_policy)) && rm -f "$policy"
    if ((rc != 0)); then
        tail -n 30 "${TMPDIR:-/tmp}/test-slurm-apt.log" >&2
        die "apt-get install slurm-wlm munge failed (log above)"
    fi
    say "installed: slurm-wlm $(dpkg-query -W -f '${Version}' slurm-wlm)"
}
install_packages

# --- 2. the demo data (made once, shared with make demo) ---------------------
if [[ $SMOKE == 0 ]]; then
    # Checked by the file each tool writes last, so a half-made directory
    # (an interrupted earlier run) is made again.
    if [[ ! -f data/digits/train/manifest.json ]]; then
        say "converting the digits data set into data/digits"
        "$PY" -m native.convert digits data/digits --overwrite
    fi
    if [[ ! -f data/stannis-digits/split.json ]]; then
        say "splitting data/digits into public and per-CSD shards (data/stannis-digits)"
        "$PY" -m stannis prepare --source data/digits --out data/stannis-digits --overwrite
    fi
fi

# --- 3. a private cluster in a temporary directory ---------------------------
# tests/slurm/privslurm.py starts munged, slurmctld and slurmd (every pid, state and
# log file in $STATE) and stops them by pid; tests/cluster uses it on the testbed too.
T_CLUSTER=$(date +%s)
STATE=$(mktemp -d "${TMPDIR:-/tmp}/mpipipe-slurm.XXXXXX")
JOBS=()
privslurm() { "$PY" tests/slurm/privslurm.py "$@"; }

stop_daemons() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    # Jobs still running (timeout, error) are cancelled while slurmd is alive to
    # signal their processes; then slurmd, slurmctld and munged, in that order.
    privslurm stop "$STATE" | while read -r line; do say "$line"; done
    if [[ ${SLURM_TEST_KEEP:-0} == 1 || $rc != 0 ]]; then
        say "daemon logs and state kept in $STATE"
    else
        rm -rf "$STATE"
    fi
    exit "$rc"
}
trap stop_daemons EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

show_logs() {
    local f
    for f in "$STATE"/log/*; do
        echo "----- $f (last 40 lines)"
        tail -n 40 "$f"
    done >&2
}

# Job ids name the run directories (runs/<id>/), and a fresh cluster counts
# from 1 again: --runs starts past every id already used under runs/.
privslurm start "$STATE" --runs runs >/dev/null || die "the private cluster did not come up (above)"
export SLURM_CONF=$STATE/slurm.conf
T_UP=$(date +%s)
say "cluster up: node $(sinfo -h -N -o '%N with %c CPUs') idle (state in $STATE)"

# --- 4. submit the jobs -------------------------------------------------------
mkdir -p runs
submit() {  # submit SBATCH-ARGS... -> job id (in a subshell: the caller records it)
    local id
    id=$(sbatch --parsable "$@") || die "sbatch $* failed"
    echo "${id%%;*}"
}
# One after the other: two cores cannot run both without making ResPipe's
# deadlines fire for the wrong reason.
declare -A EXPECT=()
RESPIPE_JOB=$(submit "${RESPIPE_ARGS[@]}")
JOBS=("$RESPIPE_JOB")
EXPECT[$RESPIPE_JOB]=COMPLETED
STANNIS_JOB=$(submit --dependency="afterany:$RESPIPE_JOB" "${STANNIS_ARGS[@]}")
JOBS+=("$STANNIS_JOB")
EXPECT[$STANNIS_JOB]=COMPLETED
say "submitted respipe job $RESPIPE_JOB and stannis job $STANNIS_JOB"
if [[ $SMOKE == 0 ]]; then
    # With no PMI, srun starts 3 copies that each think they are rank 0 of 1:
    # the CLI must refuse to train them (exit 2, world-size message).
    NO_PMI_JOB=$(submit --job-name=no-pmi --nodes=1 --ntasks=3 --overcommit --time=5 \
        --output="$STATE/%x-%j.out" --dependency="afterany:$STANNIS_JOB" \
        --wrap="export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1;
                exec srun '$PY' -m mpipipe train --config jobs/configs/respipe-digits.toml \
                    --log '$STATE/no-pmi.h5' --quiet")
    JOBS+=("$NO_PMI_JOB")
    EXPECT[$NO_PMI_JOB]=FAILED
    say "submitted no-PMI job $NO_PMI_JOB (bare srun; must fail)"
fi

# --- 5. wait for both, with a time limit ------------------------------------
job_field() {  # job_field ID FIELD -> value from `scontrol show job`
    scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1
}
is_final() {
    case $1 in
        COMPLETED | FAILED | CANCELLED* | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | \
        PREEMPTED | BOOT_FAIL | DEADLINE) return 0 ;;
        *) return 1 ;;
    esac
}

declare -A FINAL=()
last=""
deadline=$(($(date +%s) + TIMEOUT_S))
while :; do
    line=""
    for id in "${JOBS[@]}"; do
        state=$(job_field "$id" JobState)
        is_final "$state" && FINAL[$id]=$state
        line+="$id:${state:-?} "
    done
    [[ $line != "$last" ]] && say "jobs ${line% }"
    last=$line
    ((${#FINAL[@]} == ${#JOBS[@]})) && break
    if (($(date +%s) > deadline)); then
        squeue >&2 || true
        show_logs
        for id in "${JOBS[@]}"; do
            out=$(job_field "$id" StdOut)
            [[ -f $out ]] && { echo "----- $out"; tail -n 60 "$out"; } >&2
        done
        die "jobs not finished after $TIMEOUT_S s"
    fi
    sleep 2
done
say "all jobs finished"

# --- 6. assert: jobs ended as expected, logs hold the expected steps ---------
failed=0
for id in "${JOBS[@]}"; do
    out=$(job_field "$id" StdOut)
    if [[ ${FINAL[$id]} != "${EXPECT[$id]}" ]]; then
        failed=1
        say "job $id ended ${FINAL[$id]} (exit $(job_field "$id" ExitCode)), expected ${EXPECT[$id]}; its output $out:"
        if [[ -f $out ]]; then cat "$out" >&2; else echo "(no output file)" >&2; fi
    fi
done
((failed == 0)) || { show_logs; die "not every job ended as expected"; }
if [[ -n ${NO_PMI_JOB:-} ]]; then
    out=$(job_field "$NO_PMI_JOB" StdOut)
    if ! grep -q "did not join one MPI job" "$out" || [[ -e $STATE/no-pmi.h5 ]]; then
        cat "$out" >&2
        die "a bare srun launch (no PMI) was not refused with the world-size message"
    fi
    say "no-PMI job $NO_PMI_JOB refused as expected: $(grep -m1 'did not join' "$out")"
fi

if [[ $SMOKE == 0 ]]; then
    if ! PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$PY" tests/slurm/check_logs.py \
            --respipe "runs/$RESPIPE_JOB/respipe.h5" --respipe-steps "$RESPIPE_STEPS" \
            --stannis "runs/$STANNIS_JOB/stannis.h5" --stannis-steps "$STANNIS_STEPS"; then
        for id in "${JOBS[@]}"; do
            out=$(job_field "$id" StdOut)
            echo "----- $out" >&2
            cat "$out" >&2 || true
        done
        die "the HDF5 logs do not hold what the jobs should have written"
    fi
fi
# --- 7. a stop request through Slurm leaves a resumable run ----------------------
# `scancel --batch --signal=TERM` signals the batch shell only, as the time limit does
# with the scripts' --signal=B:TERM@60; the shell asks every rank to stop (SIGUSR1 via
# mpirun): the job ends with exit 143, its log says "interrupted at step S" and every
# stage's checkpoint holds step S.
if [[ $SMOKE == 0 ]]; then
    STOP_CKPT=$STATE/stop-ckpt
    STOP_JOB=$(submit --ntasks=3 "$RESPIPE_SBATCH" jobs/configs/respipe-digits.toml \
        --set "run.steps=100000" --set "resilience.backups={}" --set "run.eval_every=0" \
        --set "run.checkpoint_every=5" --set "run.checkpoint_dir=\"$STOP_CKPT\"" --quiet)
    JOBS+=("$STOP_JOB")
    say "submitted respipe job $STOP_JOB, to be stopped by scancel --batch --signal=TERM"
    deadline=$(($(date +%s) + TIMEOUT_S))
    until [[ -f $STOP_CKPT/stage-0.pt ]]; do
        is_final "$(job_field "$STOP_JOB" JobState)" && die "job $STOP_JOB ended before its first checkpoint"
        (($(date +%s) > deadline)) && die "job $STOP_JOB wrote no checkpoint in $TIMEOUT_S s"
        sleep 1
    done
    scancel --batch --signal=TERM "$STOP_JOB"
    until is_final "$(job_field "$STOP_JOB" JobState)"; do
        (($(date +%s) > deadline)) && die "job $STOP_JOB did not stop after scancel --batch --signal=TERM"
        sleep 1
    done
    out=$(job_field "$STOP_JOB" StdOut)
    if [[ $(job_field "$STOP_JOB" ExitCode) != 143:0 ]] || ! grep -q "resume with: .*--resume $STOP_CKPT" "$out" ||
        ! PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$PY" - "runs/$STOP_JOB/respipe.h5" "$STOP_CKPT" <<'PYEOF'
import sys
import torch
from mpipipe.core.logs.runlog import open_log
status = open_log(sys.argv[1]).attrs["status"]
assert status.startswith("interrupted at step "), status
step = int(status.rsplit(" ", 1)[1])
for k in range(3):
    assert torch.load(f"{sys.argv[2]}/stage-{k}.pt", weights_only=False)["step"] == step
print(f"log {sys.argv[1]}: {status}; checkpoints at step {step}")
PYEOF
    then
        cat "$out" >&2
        die "job $STOP_JOB did not stop cleanly (exit $(job_field "$STOP_JOB" ExitCode))"
    fi
    say "job $STOP_JOB stopped cleanly: $(grep -m1 'interrupted by' "$out" | cut -c1-120)"
fi
say "PASS: respipe job $RESPIPE_JOB and stannis job $STANNIS_JOB completed; logs in runs/$RESPIPE_JOB and runs/$STANNIS_JOB"
say "time from cold start: $(($(date +%s) - T_CLUSTER)) s (cluster up in $((T_UP - T_CLUSTER)) s)"
