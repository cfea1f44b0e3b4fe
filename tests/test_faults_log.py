"""Issue 14, parts 2-4: nothing is overwritten silently, every fault fires or is refused,
and any rank may be a backup.

Start-up refusals run under real mpirun and stop before torch is imported; the runs
that train are 20 steps of LeNet on the digits in 3 stages, shared within the module
(cached by name) to keep the suite short on two cores. Nothing here asserts timings.
"""

from __future__ import annotations

import json
import math
import subprocess
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from mpipipe.core.logs.runlog import RunLog, open_log
from mpipipe.tools.launch import ROOT, run_mpi

# make test-long (.ci/run runs it): faults aimed at backups and writers, and the log kept whole under them.
pytestmark = pytest.mark.long

RESPIPE = ROOT / "jobs" / "configs" / "respipe-digits.toml"
PIPELINE = ROOT / "jobs" / "configs" / "pipeline-digits.toml"
STANNIS = ROOT / "jobs" / "configs" / "stannis-digits.toml"
STEPS, BATCH = 20, 32
ONE_BACKUP = "resilience.backups={1 = 1}"


def _train(n: int, *args: str, module: str = "mpipipe", ulfm: bool = False,
           timeout: float = 120) -> subprocess.CompletedProcess:
    return run_mpi(n, ["-m", module, "train", "--quiet", *args], ulfm=ulfm, timeout=timeout)


def _errors(result: subprocess.CompletedProcess, prog: str = "mpipipe train") -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: error:")]


@pytest.fixture
def old_log(tmp_path: Path) -> tuple[Path, bytes, int]:
    """A completed run log of 3 steps: (path, its bytes, its mtime in ns)."""
    path = tmp_path / "old.h5"
    log = RunLog(path, system="mpipipe", config={"run": {"steps": 3}}, comm_size=3)
    for s in (1, 2, 3):
        log.step(s, loss=1.0 / s, samples=BATCH, samples_per_s=100.0)
    log.close("completed")
    return path, path.read_bytes(), path.stat().st_mtime_ns


def _untouched(old: tuple[Path, bytes, int]) -> None:
    path, data, mtime = old
    assert path.read_bytes() == data and path.stat().st_mtime_ns == mtime


def _respipe_args(digits: Path, *sets: str) -> list[str]:
    args = ["--config", str(RESPIPE), "--set", f'data.path="{digits}"',
            "--set", f"run.steps={STEPS}", "--set", ONE_BACKUP]
    for s in sets:
        args += ["--set", s]
    return args


# -- start-up: refused before anything is written ---------------------------------------------

BAD_FAULTS = [
    # (extra arguments, words of the one error line); 4 ranks: stages 0..2, rank 3 backs up 1
    (["--inject", "kill:stage=1:step=20"], "step 20, beyond the run (run.steps = 20"),
    (["--inject", "stall:rank=4:step=3"], "no rank 4 (the MPI world has ranks 0..3)"),
    (["--inject", "kill:stage=3:step=3"], "stage 3 does not exist"),
    (["--inject", "kill:stage=1:step=3:micro=4"], "micro-batch 4 does not exist"),
    (["--inject", "kill:rank=3:step=3:micro=1"], "in cold mode it runs no micro-batch"),
    (["--inject", "slow:rank=3:step=3:factor=2"], "rank 3 is a backup of stage 1"),
    (["--inject", "kill:stage=1:step=3", "--inject", "kill:rank=1:step=5"], "killed before"),
    (["--set", "resilience.inject=['delay:stage=0:p=0:seconds=1']"], "p=0"),
    # epochs: 2 x 44 batches (1438 records, drop_last) = 88 steps, 0..87
    (["--set", "run.steps=0", "--set", "run.epochs=2", "--inject", "kill:stage=1:step=88"],
     "run.steps = 88"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, words", BAD_FAULTS, ids=[b[1] for b in BAD_FAULTS])
def test_a_fault_that_can_never_fire_stops_the_run_before_its_log(digits, old_log, extra,
                                                                  words):
    # --overwrite is given: the old log would be replaced, were the checks not first.
    result = _train(4, *_respipe_args(digits), *extra, "--log", str(old_log[0]), "--overwrite",
                    timeout=100)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = _errors(result)
    assert len(errors) == 1 and words in errors[0], result.stderr[-2000:]
    assert "it would never fire" in errors[0] and "Traceback" not in result.stderr
    _untouched(old_log)


@pytest.mark.timeout(120)
def test_an_existing_log_is_refused_and_left_as_it_was(digits, old_log):
    result = _train(4, *_respipe_args(digits), "--log", str(old_log[0]), timeout=100)
    assert result.returncode == 2, result.stderr[-2000:]
    assert _errors(result) == [f"mpipipe train: error: the run log {old_log[0]} exists; pass "
                               "--overwrite to replace it, or pick another --log"], result.stderr
    _untouched(old_log)


@pytest.mark.timeout(120)
def test_a_bad_config_or_fault_creates_no_log(digits, tmp_path):
    new = tmp_path / "new.h5"
    for extra in (["--set", "pipeline.chunks=zero"], ["--inject", "kill:stage=1:step=99"]):
        result = _train(4, *_respipe_args(digits), *extra, "--log", str(new), timeout=100)
        assert result.returncode == 2 and len(_errors(result)) == 1, result.stderr[-2000:]
        assert not new.exists()


@pytest.mark.timeout(120)
def test_stannis_refuses_a_fault_beyond_its_run_and_keeps_the_old_log(tmp_path, old_log):
    result = _train(5, "--config", str(STANNIS), "--set", "run.steps=10", "--inject",
                    "kill:rank=2:step=10", "--log", str(old_log[0]), "--overwrite",
                    module="stannis", timeout=100)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = _errors(result, "stannis train")
    assert len(errors) == 1 and "step 10, beyond the run (run.steps = 10" in errors[0], \
        result.stderr
    _untouched(old_log)


# -- the log: overwrite, resume, and what close() checks ---------------------------------------

@pytest.mark.timeout(400)
def test_overwrite_replaces_and_resume_continues_the_runs_own_log(digits, tmp_path, old_log):
    common = ["--config", str(PIPELINE), "--set", f'data.path="{digits}"',
              "--set", "pipeline.stages=2", "--set", "run.eval_every=0",
              "--set", "run.checkpoint_every=4", "--set", "pipeline.balance_by=params"]
    log = old_log[0]
    first = _train(2, *common, "--set", "run.steps=8", "--log", str(log), "--overwrite",
                   timeout=150)
    assert first.returncode == 0, first.stderr[-2000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed" and list(run.steps["step"]) == list(range(1, 9))
    start = run.attrs["start_unix"]
    # --resume <log>-ckpt continues <log>: no --log needed, and no --overwrite
    second = _train(2, *common, "--set", "run.steps=12", "--resume", str(tmp_path / "old-ckpt"),
                    timeout=150)
    assert second.returncode == 0, second.stderr[-2000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert list(run.steps["step"]) == list(range(1, 13))  # every step once
    assert run.attrs["start_unix"] == start  # one time axis
    assert [e["step"] for e in run.events_of("resume")] == [8]
    assert json.loads(run.attrs["summary"])["steps"] == 12
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == ["old.h5"]


def test_resumed_log_drops_the_rows_after_the_checkpoint_and_keeps_one_time_axis(tmp_path):
    path = tmp_path / "run.h5"
    log = RunLog(path, system="mpipipe", config={}, comm_size=2)
    for s in range(1, 8):
        log.step(s, loss=0.1, samples=4, samples_per_s=1.0,
                 ranks={0: {"compute_s": 0.1, "wait_s": 0.0, "bytes_sent": 1, "bytes_recv": 1}})
    log.eval(5, accuracy=0.5)
    log.eval(7, accuracy=0.6)
    log.event("fault_injected", step=6, rank=1)
    log.writer.file.close()  # killed: status stays running
    t0 = open_log(path).attrs["start_unix"]
    with pytest.raises(OSError):
        RunLog(path, system="mpipipe", config={}, comm_size=2, mode="x")
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    failed = RunLog(path, system="mpipipe", config={"new": 1}, comm_size=2, mode="a")
    failed.close("failed: the checkpoint does not fit")  # before any record: untouched
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    again = RunLog(path, system="mpipipe", config={"new": 1}, comm_size=2, mode="a")
    assert again.start == t0 and again.active
    again.cut_after(5)
    again.expect_steps(6, 8)
    for s in (6, 7, 8):
        again.step(s, loss=0.2, samples=4, samples_per_s=1.0)
    assert again.close("completed") == "completed"
    run = open_log(path)
    assert list(run.steps["step"]) == list(range(1, 9))
    assert list(run.ranks[0]["step"]) == [1, 2, 3, 4, 5]
    assert list(run.eval["step"]) == [5]
    assert [e["kind"] for e in run.events] == ["fault_injected", "rows_dropped"]
    assert run.events_of("rows_dropped")[0]["detail"]["rows"] == 2
    assert run.config == {"new": 1}
    with pytest.raises(Exception, match="not a stannis run log"):
        RunLog(path, system="stannis", config={}, comm_size=2, mode="a")


def test_a_log_lacking_rows_is_not_marked_completed(tmp_path, capsys):
    log = RunLog(tmp_path / "gap.h5", system="mpipipe", config={}, comm_size=2)
    log.expect_steps(1, 6)
    for s in (1, 2, 4):
        log.step(s, loss=0.1, samples=4, samples_per_s=1.0)
    status = log.close("completed")
    assert status == "incomplete: no row for 3 of the 6 steps run (steps 3, 5-6)"
    assert open_log(tmp_path / "gap.h5").attrs["status"] == status
    assert status in capsys.readouterr().err
    failed = RunLog(tmp_path / "failed.h5", system="mpipipe", config={}, comm_size=2)
    failed.expect_steps(1, 6)
    assert failed.close("failed: x") == "failed: x"  # a failure says why itself


# -- runs that train: faults aimed at backups, and a backup on rank 0 --------------------------

@pytest.fixture(scope="module")
def runs(digits, tmp_path_factory):
    """run(name, ranks, *settings) -> (CompletedProcess, log path); ULFM, 20 steps, R=1."""
    base = tmp_path_factory.mktemp("faults-log")

    @cache
    def run(name: str, ranks: int, *settings: str, timeout: float = 240):
        log = base / f"{name}.h5"
        args = _respipe_args(digits, "run.eval_every=0", f"data.batch_size={BATCH}",
                             "resilience.replicate_every=1", "resilience.deadline_s=1.5")
        for s in settings:
            args += ["--inject", s[len("inject:"):]] if s.startswith("inject:") else ["--set", s]
        return _train(ranks, *args, "--log", str(log), ulfm=True, timeout=timeout), log

    return run


def _complete(result: subprocess.CompletedProcess, log: Path):
    assert result.returncode == 0, result.stderr[-3000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert list(run.steps["step"]) == list(range(1, STEPS + 1))
    assert run.steps["samples"].sum() == STEPS * BATCH
    assert np.isfinite(run.steps["loss"]).all(), run.steps["loss"]
    summary = json.loads(run.attrs["summary"])
    assert all(math.isfinite(summary[k]) for k in ("samples_per_s", "final_loss",
                                                   "test_accuracy")), summary
    return run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode, fault", [
    ("cold", "kill:rank=3:step=7"),
    ("hot", "kill:rank=3:step=7:micro=1"),
])
def test_a_kill_aimed_at_a_backup_fires_and_the_run_goes_on(runs, mode, fault):
    result, log = runs(f"backup-kill-{mode}", 4, f'resilience.mode="{mode}"', f"inject:{fault}")
    run = _complete(result, log)
    fired = run.events_of("fault_injected")
    assert [(e["rank"], e["step"]) for e in fired] == [(3, 7)], run.events
    lost = [e for e in run.events if e["kind"] in ("failure_detected", "late")]
    assert [(e["rank"], e["detail"]["backup_of"]) for e in lost] == [(3, 1)], run.events
    assert not run.events_of("takeover")


@pytest.mark.timeout(600)
def test_no_backup_left_suggests_one_more_than_the_stage_had(runs):
    result, log = runs("backup-then-stage", 4, "inject:kill:rank=3:step=3",
                       "inject:kill:stage=1:step=9")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "stage 1 (world rank 1) failed and has no backup left" in result.stderr
    assert "Give it 2 (it had 1) with resilience.backups = {1 = 2}" in result.stderr
    run = open_log(log)
    assert run.attrs["status"].startswith("failed: stage 1")
    assert [e["rank"] for e in run.events_of("fault_injected")] == [3, 1]


BACKUP_ON_0 = ("resilience.backups={0 = 1}", "plan.backup 0=0", "plan.stage 0=1",
               "plan.stage 1=2", "plan.stage 2=3")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", [None, "kill:stage=0:step=7"])
def test_a_backup_on_rank_0_leaves_a_complete_log(runs, fault):
    # The writer is the lowest stage rank (1). Killed, the log moves to the lowest
    # surviving stage (rank 2) and rank 0 serves stage 0.
    name = f"backup-on-0-{fault or 'clean'}".replace(":", "-")
    result, log = runs(name, 4, *BACKUP_ON_0, *([f"inject:{fault}"] if fault else []))
    run = _complete(result, log)
    # the stages' figures; rank 0 has its own once it serves stage 0
    assert sorted(run.ranks) == ([0, 1, 2, 3] if fault else [1, 2, 3])
    if fault:
        takeover = run.events_of("takeover")[0]
        assert (takeover["rank"], takeover["detail"]["stage"]) == (0, 0)
        assert [(e["rank"], e["detail"]["previous"]) for e in run.events_of("log_writer_moved")] \
            == [(2, 1)]


@pytest.mark.timeout(600)
def test_a_stall_aimed_at_a_backup_fires_and_the_run_goes_on(runs):
    # The stage's replica waits for the sleeping backup past the deadline: a round
    # leaves the backup out, and the run goes on without it (it may rejoin later).
    result, log = runs("backup-stall-cold", 4, "inject:stall:rank=3:step=7:seconds=4")
    run = _complete(result, log)
    assert [(e["rank"], e["step"]) for e in run.events_of("fault_injected")] == [(3, 7)]
    lost = [e for e in run.events if e["kind"] in ("failure_detected", "late")]
    assert [(e["rank"], e["detail"]["backup_of"]) for e in lost][:1] == [(3, 1)], run.events
    assert not run.events_of("takeover")


# -- failures as a process ---------------------------------------------------------------------

POISSON = "poisson:rate=1/s:seed=5"  # kills rank 0 at 1.05 s, rank 3 at 1.71 s, rank 1 at 6.48 s


@pytest.mark.timeout(600)
def test_a_poisson_process_kills_the_ranks_it_drew_and_logs_each_event(digits, tmp_path):
    """2 stages, each with a backup (ranks 2, 3), 300 steps of a few seconds at R = 1, under a
    process that takes a rank about every second. How many events fall inside the run
    depends on the machine's speed, so the test holds the run to the sequence: the log's
    events are its first ones, each on its victim at or after its time, and the run
    completed unless they took every holder of a stage (then it ended in the documented
    'no backup left')."""
    from mpipipe.core.mpi.faults import parse
    from mpipipe.core.mpi.poisson import Process

    log = tmp_path / "poisson.h5"
    args = ["--config", str(RESPIPE), "--set", f'data.path="{digits}"', "--set", "run.steps=300",
            "--set", "pipeline.stages=2", "--set", "resilience.backups={0 = 1, 1 = 1}",
            "--set", "resilience.replicate_every=1", "--set", "resilience.deadline_s=1.5",
            "--set", "run.eval_every=0", "--set", f"data.batch_size={BATCH}",
            "--inject", POISSON, "--log", str(log)]
    result = _train(4, *args, ulfm=True, timeout=300)
    f = parse(POISSON)
    expected = Process(f.rate, f.seed, [0, 1, 2, 3], ends_victim=True).first(4)
    run = open_log(log)
    fired = run.events_of("fault_injected")
    assert 1 <= len(fired) <= 4, (run.events, result.stderr[-3000:])
    for e, want in zip(fired, expected[:len(fired)], strict=True):
        assert e["rank"] == want.victim
        assert e["detail"]["fault"] == (f"kill:rank={want.victim}:step={e['step']} "
                                        f"(poisson #{want.number} at {want.at_s:.1f} s)")
        assert e["time"] >= want.at_s  # the log opened before the run's clock started
    killed = {e["rank"] for e in fired}
    holders = {0: {0, 2}, 1: {1, 3}}
    lost = [k for k, ranks in holders.items() if ranks <= killed]
    if not lost:
        assert result.returncode == 0, result.stderr[-3000:]
        assert run.attrs["status"] == "completed"
        assert list(run.steps["step"]) == list(range(1, 301))  # every row once
        assert np.isfinite(run.steps["loss"]).all()
        # each stage killed was taken over by its backup
        taken = sorted(e["detail"]["stage"] for e in run.events_of("takeover"))
        assert taken == sorted(k for k, ranks in holders.items() if min(ranks) in killed)
    else:
        assert result.returncode == 2, result.stderr[-3000:]
        assert "has no backup left" in result.stderr
        assert run.attrs["status"].startswith(f"failed: stage {lost[0]}")
