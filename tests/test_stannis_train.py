"""`python -m stannis train` end to end under mpirun: accuracy, re-tune, ULFM drop, privacy."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpipipe.core.logs.runlog import open_log
from mpipipe.core.run.models import build_model
from mpipipe.tools.launch import ROOT, mpirun_env, run_mpi

CONFIG = ROOT / "jobs" / "configs" / "stannis-digits.toml"


@pytest.fixture(scope="module")
def data(stannis_split: Path) -> Path:
    return stannis_split


def _train(data: Path, log: Path, *sets: str, inject: tuple[str, ...] = (), ulfm: bool = False,
           n: int = 5, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = ["-m", "stannis", "train", "--config", str(CONFIG),
        "--log", str(log), "--set", f'data.path="{data}"',
        # 1/2 speed keeps the test quick on two cores; the benchmark uses 1/8.
        "--set", "csd.slowdown=2.0", "--set", "run.eval_every=0"]
    for s in sets:
        cmd += ["--set", s]
    for spec in inject:
        cmd += ["--inject", spec]
    return run_mpi(n, cmd, ulfm=ulfm, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


# One run's test accuracy moves by about half a point with the seed (359 test images:
# one image is 0.28 points), for tuned and equal batches alike, so a single pair of
# runs differs by more than a point now and then by chance. The comparison is between
# the means of three seeds; every tuned run must still reach 95% on its own.
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def tuned_and_equal(data: Path, tmp_path_factory: pytest.TempPathFactory):
    """Tuned and equal-batch runs for each seed: ({seed: run}, {seed: run})."""
    out = tmp_path_factory.mktemp("logs")
    runs: dict[str, dict] = {"true": {}, "false": {}}
    for seed in SEEDS:
        for tune in runs:
            log = out / f"tune-{tune}-seed{seed}.h5"
            _ok(_train(data, log, f"stannis.tune={tune}", f"run.seed={seed}"))
            runs[tune][seed] = open_log(log)
    return runs["true"], runs["false"]


def _final_accuracy(run) -> float:
    return float(run.eval["accuracy"][-1])


@pytest.mark.long  # make test-long: two trainings to 95%
@pytest.mark.timeout(900)
def test_tuned_batches_reach_95_percent_like_equal_batches(tuned_and_equal) -> None:
    tuned_runs, equal_runs = tuned_and_equal
    acc_tuned = {seed: _final_accuracy(run) for seed, run in tuned_runs.items()}
    acc_equal = {seed: _final_accuracy(run) for seed, run in equal_runs.items()}
    # Each accuracy is a proportion over the test images: a run that reaches 95 % in
    # expectation lands within three standard errors, sqrt(p (1 - p) / n), of it (the
    # tuned split follows the machine's load, so a run may miss by an image or two: seen
    # at 0.9499).
    n_test = 359  # the digits' held-out split (one image is 0.28 points)
    floor = 0.95 - 3 * math.sqrt(0.95 * 0.05 / n_test)
    assert min(acc_tuned.values()) >= floor, acc_tuned
    mean_tuned = float(np.mean(list(acc_tuned.values())))
    mean_equal = float(np.mean(list(acc_equal.values())))
    # Their mean, over len(SEEDS) runs, within three of its own (smaller) standard error.
    assert mean_tuned >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / (n_test * len(SEEDS))), acc_tuned
    # One side only: tuned batches must not cost accuracy; doing better is no failure.
    # The difference of two means of len(SEEDS) runs has a standard error of
    # sqrt(2 p (1 - p) / (n * len(SEEDS))); three of them bound what chance alone can take away.
    p = max(mean_equal, mean_tuned)
    margin = 3 * math.sqrt(2 * p * (1 - p) / (n_test * len(SEEDS)))
    assert mean_tuned >= mean_equal - margin, (acc_tuned, acc_equal, margin)
    for seed in SEEDS:
        tuned, equal = tuned_runs[seed], equal_runs[seed]
        # Same number of steps and samples: the same number of epochs.
        assert tuned.steps["samples"].sum() == equal.steps["samples"].sum()
        # Tuned batches differ between ranks (the split follows measured speed); equal
        # ones do not. Which rank gets more depends on the load of the machine, so not
        # asserted.
        assert len({int(tuned.ranks[r]["batch_size"][0]) for r in range(5)}) > 1
        assert tuned.events_of("benchmark") and tuned.events_of("retune")
        assert set(equal.ranks[0]["batch_size"]) == {26}
    for run in (*tuned_runs.values(), *equal_runs.values()):
        assert run.attrs["status"] == "completed"
        emulation = json.loads(run.attrs["emulation"])
        assert sorted(emulation) == ["1", "2", "3", "4"]
        assert all(e["emulated"] and e["slowdown"] == 2.0 for e in emulation.values())
        sources = {e["rank"]: e["detail"]["source"] for e in run.events_of("energy_source")}
        assert sources[1] == "model"  # an emulated CSD never claims measured joules
        for r in range(5):
            assert (run.ranks[r]["joules"] > 0).all()


@pytest.mark.timeout(900)
def test_csds_send_only_gradients_and_control(tuned_and_equal) -> None:
    tuned = tuned_and_equal[0][SEEDS[0]]
    summary = json.loads(tuned.attrs["summary"])
    model = build_model("resnet", 10, (1, 8, 8))
    grad_bytes = 4 * (sum(p.numel() for p in model.parameters()) + 1)  # + the weight slot
    control_bytes = 8 * 10 + 8  # one row of ten float64 step figures, and the stop code
    assert summary["grad_bytes"] == grad_bytes
    assert summary["control_bytes"] == control_bytes
    for r in range(1, 5):
        sent = tuned.ranks[r]["bytes_sent"]
        assert len(sent) == len(tuned.steps["step"])
        assert (sent == grad_bytes + control_bytes).all(), (r, set(sent.tolist()))
        # MPI's own count, under every communicator: the gradients sent once, to the host
        # (stannis.exchange = "host"), and the 8-byte stop code's allreduce for each of the
        # 4 others (Open MPI counts a gather at its root), and nothing unaudited
        assert (tuned.ranks[r]["mpi_bytes"] == grad_bytes + 4 * 8).all(), r
    # the host: the summed gradients back to each of the 4 CSDs, and its figures' gather
    assert (tuned.ranks[0]["mpi_bytes"] > 4 * grad_bytes).all()
    for r in range(5):
        assert (tuned.ranks[r]["unaudited_bytes"] == 0).all(), r
    assert tuned.events_of("unaudited_traffic") == []
    # A private batch would be at least 256 bytes per sample on top of that.
    assert tuned.ranks[1]["batch_size"].max() > 0


# A CSD that leaks: at its 4th step, rank 1 sends one private sample to the host with a
# raw MPI.COMM_WORLD.Send, past the audited communicator. Run as ``python -c LEAK train ...``.
LEAK = """
import sys
from stannis import mpicount
mpicount.enable()
from mpi4py import MPI
import stannis.step
compute = stannis.step.DataParallelStep.compute
def leaky(self, b):
    if MPI.COMM_WORLD.Get_rank() == 1 and self.done == 3:
        x, _ = self.stream.next(1)
        MPI.COMM_WORLD.Send(x.numpy(), dest=0, tag=999)
    return compute(self, b)
stannis.step.DataParallelStep.compute = leaky
from stannis.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.long  # make test-long: the audit's own check (make test has the audit)
@pytest.mark.timeout(300)
def test_a_send_past_the_audited_communicator_is_caught_by_mpis_own_count(
        data: Path, tmp_path: Path) -> None:
    log = tmp_path / "leak.h5"
    proc = run_mpi(5, ["-c", LEAK, "train", "--config", str(CONFIG), "--log", str(log),
                       "--set", f'data.path="{data}"', "--set", "csd.slowdown=2.0",
                       "--set", "run.eval_every=0", "--set", "run.steps=6"], timeout=240)
    _ok(proc)
    run = open_log(log)
    sample = 4 * 8 * 8  # one float32 image of 1x8x8
    # the audited door saw nothing: its count is the clean gradient-and-figures one
    assert len(set(run.ranks[1]["bytes_sent"].tolist())) == 1
    assert [(e["step"], e["rank"], e["detail"]["bytes"])
            for e in run.events_of("unaudited_traffic")] == [(4, 1, sample)]
    unaudited = run.ranks[1]["unaudited_bytes"]
    assert list(unaudited) == [0, 0, 0, sample, 0, 0]
    for r in (0, 2, 3, 4):
        assert (run.ranks[r]["unaudited_bytes"] == 0).all(), r


@pytest.mark.timeout(300)
def test_slow_csds_trigger_retune_and_killed_csd_is_dropped(data: Path, assert_csd_dropped,
                                                            tmp_path: Path) -> None:
    log = tmp_path / "faults.h5"
    # Every CSD slowed 8x from step 10 (a CSD that already has its minimum batch
    # cannot shed work, so one slowed CSD alone would not always show a re-tune).
    # Why 8: the host's step time is wall time, which a loaded machine stretches by its
    # load L, while an emulated CSD's is its CPU time times its slowdown (2 here, 2f once
    # slowed by f); a large f keeps the CSDs the slowest ranks on a loaded machine.
    # No batch floors here (overhead_share = 0): on 8x8 digits the CSDs' floors (20-30
    # samples, overhead / per-sample cost, whatever the slowdown) are above the batch
    # the tuner would give them at 2x, so they start at their floors with nothing to shed.
    # A low bar from noise (noise_retunes_per_100 = 100: 0.84 standard errors, against
    # 2.33 by default): the rule that keeps a steady run from re-tuning is tested on
    # simulated noise (tests/test_hypertune.py); here the default bar, from this short
    # run's spread, came within a few percent of the slow-down's predicted gain (28%
    # against 33%), which a loaded machine could tip either way.
    slow = tuple(f"slow:rank={r}:step=10:factor=8" for r in range(1, 5))
    proc = _train(data, log, "run.steps=45", "stannis.overhead_share=0", "stannis.noise_retunes_per_100=100",
                  inject=slow + ("kill:rank=3:step=30",), ulfm=True)
    _ok(proc)
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert int(run.steps["step"][-1]) == 45
    assert {e["rank"] for e in run.events_of("fault_injected")} >= {1, 2, 3, 4}
    slow_retunes = [e for e in run.events_of("retune")
                    if 10 < e["step"] <= 30 and "predicted gain" in e["detail"]["reason"]
                    and sum(e["detail"]["new"][1:]) < sum(e["detail"]["old"][1:])]
    assert slow_retunes, [e["detail"] for e in run.events_of("retune")]
    assert_csd_dropped(run, 3, 45)


def _pid_of_rank(rank: int, marker: str) -> int | None:
    """The pid of world ``rank`` of the job whose command line contains ``marker``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and b"stannis" in cmdline and \
                f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.long  # make test-long: a fault variant
@pytest.mark.timeout(240)
def test_csd_killed_during_the_benchmark_is_dropped_and_the_rest_start_over(
        data: Path, tmp_path: Path) -> None:
    import os
    import signal
    import threading

    from mpipipe.tools.launch import kill_job, start_mpi

    log = tmp_path / "bench-kill.h5"
    argv = ["-m", "stannis", "train", "--config", str(CONFIG), "--log", str(log),
            "--set", f'data.path="{data}"', "--set", "csd.slowdown=2.0",
            "--set", "run.eval_every=0", "--set", "run.steps=20",
            # a long benchmark phase, so the kill lands inside it
            "--set", "stannis.benchmark_repeats=60"]
    job = start_mpi(5, argv, ulfm=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True)
    timer = threading.Timer(200, kill_job, (job,))  # a hang fails the test instead of blocking it
    timer.start()
    lines: list[str] = []
    killed = None
    try:
        for line in job.stdout:
            lines.append(line)
            if killed is None and "benchmark:" in line:
                killed = _pid_of_rank(3, str(log))
                assert killed is not None, "rank 3's process was not found"
                os.kill(killed, signal.SIGKILL)
        job.wait()
    finally:
        timer.cancel()
        if job.poll() is None:
            kill_job(job)
    assert job.returncode == 0, "".join(lines)[-4000:]
    assert killed is not None, "".join(lines)
    assert sum("benchmark:" in line for line in lines) == 2, "".join(lines)  # once more
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert int(run.steps["step"][-1]) == 20
    dropped = run.events_of("csd_dropped")
    assert [e["rank"] for e in dropped] == [3] and dropped[0]["step"] == 0
    split = json.loads((data / "split.json").read_text())
    assert dropped[0]["detail"]["samples_lost"] == split["records"]["csd3"]
    # The survivors were benchmarked again and planned from those figures alone (the
    # first phase may or may not have got as far as a plan before it failed).
    bench = run.events_of("benchmark")
    assert sorted(int(r) for r in bench[-1]["detail"]["models"]) == [0, 1, 2, 4], bench
    start = [e["detail"] for e in run.events_of("retune") if e["step"] == 0][-1]
    assert start["ranks"] == [0, 1, 2, 4] and sum(start["new"]) == 128
    assert 3 not in run.ranks or len(run.ranks[3]["step"]) == 0
    assert len(run.ranks[4]["step"]) == 20


@pytest.mark.timeout(120)
def test_wrong_world_size_is_one_clear_error(data: Path, tmp_path: Path) -> None:
    proc = _train(data, tmp_path / "x.h5", n=3, timeout=90)
    assert proc.returncode != 0
    assert "needs 5 ranks (1 host + 4 CSDs) but the MPI world has 3" in proc.stderr


def test_prepare_with_half_a_source_is_one_error(tmp_path: Path) -> None:
    """A source holding train/ but no test/ is refused by convert; prepare says so without a traceback."""
    (tmp_path / "src" / "train").mkdir(parents=True)
    (tmp_path / "src" / "train" / "keep.txt").write_text("mine")
    done = subprocess.run([sys.executable, "-m", "stannis", "prepare", "--source", str(tmp_path / "src"),
                           "--out", str(tmp_path / "out")],
                          env=mpirun_env(), cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "stannis prepare: error: could not make the source data set" in done.stderr
    assert (tmp_path / "src" / "train" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists()
