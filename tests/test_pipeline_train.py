"""`mpirun python -m mpipipe train`: accuracy on digits, clear start-up errors, exact resume."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from mpipipe.tools.launch import ROOT, run_mpi

CONFIG = ROOT / "jobs" / "configs" / "pipeline-digits.toml"
ERROR_LINE = "mpipipe train: error:"


def mpirun(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m mpipipe train ARGS` on n ranks; a hang fails the test at `timeout`."""
    return run_mpi(n, ["-m", "mpipipe", "train", "--quiet", *args], timeout=timeout)


def _data(digits: Path) -> list[str]:
    return ["--config", str(CONFIG), "--set", f'data.path="{digits}"']


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lenet_on_digits_in_three_stages_reaches_95_percent(digits, tmp_path):
    log = tmp_path / "run.h5"
    result = mpirun(3, *_data(digits), "--log", str(log), timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = [line for line in result.stdout.splitlines() if "done:" in line]
    assert len(summary) == 1, result.stdout[-2000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", summary[0]).group(1))
    assert accuracy >= 0.95, summary[0]

    from mpipipe.core.logs.runlog import open_log
    run = open_log(log)
    assert run.steps["step"][-1] == 600
    assert run.eval["accuracy"][-1] == pytest.approx(accuracy, abs=1e-4)
    for rank in range(3):
        assert (run.ranks[rank]["bytes_sent"] > 0).all()


# make test runs three (a world, a key, a plan); make test-long the rest
_LONG = {"choose one of gpipe, 1f1b, interleaved-1f1b", "smaller than pipeline.chunks", "covers 2 layers",
         "stage 2 has no rank", "data set /nonexistent/digits does not exist", "needs v >= 2 chunks per rank",
         "multiple of the 2 ranks", "one chunk per rank"}
BAD = [
    # (ranks, extra arguments or config text, words the one error line must contain)
    (2, [], "needs 3 ranks"),
    (2, ["--set", "pipeline.chunkz=4"], "unknown key 'pipeline.chunkz'"),
    (2, ["--set", "pipeline.schedule=zigzag"], "choose one of gpipe, 1f1b, interleaved-1f1b"),
    (2, ["--set", "pipeline.stages=2", "--set", "data.batch_size=2"],
     "smaller than pipeline.chunks"),
    (2, ["--set", "pipeline.stages=2", "--set", "pipeline.balance=[1, 1]"], "covers 2 layers"),
    (3, "[plan]\n\"stage 0\" = 0\n\"stage 1\" = 1\n\"backup 1\" = 2\n", "stage 2 has no rank"),
    (3, "[plan]\n\"stage 0\" = 0\n\"stage 1\" = 0\n\"stage 2\" = 1\n", "rank 0 has two roles"),
    (2, ["--set", "pipeline.stages=2", "--set", 'data.path="/nonexistent/digits"'],
     "data set /nonexistent/digits does not exist"),
    (2, ["--set", "pipeline.stages=2", "--set", 'pipeline.schedule="interleaved-1f1b"',
         "--set", "pipeline.balance=[6, 6]"], "needs v >= 2 chunks per rank"),
    (2, ["--set", "pipeline.stages=2", "--set", 'pipeline.schedule="interleaved-1f1b"',
         "--set", "pipeline.chunks=3"], "multiple of the 2 ranks"),
    (2, ["--set", "pipeline.stages=2", "--set", 'pipeline.schedule="1f1b"',
         "--set", "pipeline.balance=[3, 3, 3, 3]"], "one chunk per rank"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks,extra,words", [
    pytest.param(*b, marks=pytest.mark.long) if b[2] in _LONG else b for b in BAD], ids=[b[2] for b in BAD])
def test_bad_plan_or_config_stops_every_rank_with_one_line(digits, tmp_path, ranks, extra,
                                                          words):
    args = _data(digits)
    if isinstance(extra, str):
        plan = tmp_path / "plan.toml"
        plan.write_text(CONFIG.read_text() + "\n" + extra)
        args = ["--config", str(plan), "--set", f'data.path="{digits}"']
    else:
        args += extra
    result = mpirun(ranks, *args, "--log", str(tmp_path / "bad.h5"), timeout=50)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(ERROR_LINE)]
    assert len(errors) == 1, result.stderr
    assert words in errors[0], errors[0]
    assert "Traceback" not in result.stderr


def _params(directory: Path, stages: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for k in range(stages):
        blob = torch.load(directory / f"stage-{k}.pt", weights_only=True)
        merged.update(blob["params"])
    return merged


@pytest.mark.long  # make test-long: stop and resume (ResPipe's resume is in make test)
@pytest.mark.timeout(240)
def test_stop_and_resume_ends_where_an_uninterrupted_run_ends(digits, tmp_path):
    common = [*_data(digits), "--set", "pipeline.stages=2",
              "--set", "run.eval_every=0", "--set", "run.checkpoint_every=8",
              "--set", "pipeline.balance_by=params", "--set", "optim.name=adam",
              "--set", "optim.lr=0.003",
              # A cosine schedule spans run.steps, so the shorter first run would decay
              # faster than the whole one; the rate's step-index rule is tested apart.
              "--set", 'optim.schedule="constant"']
    whole, first, second = tmp_path / "whole", tmp_path / "first", tmp_path / "second"
    runs = [
        common + ["--set", "run.steps=16", "--set", f'run.checkpoint_dir="{whole}"'],
        common + ["--set", "run.steps=8", "--set", f'run.checkpoint_dir="{first}"'],
        common + ["--set", "run.steps=16", "--set", f'run.checkpoint_dir="{second}"',
                  "--resume", str(first)],
    ]
    for i, args in enumerate(runs):
        result = mpirun(2, *args, "--log", str(tmp_path / f"run{i}.h5"), timeout=70)
        assert result.returncode == 0, result.stderr[-2000:]
    assert torch.load(second / "stage-0.pt", weights_only=True)["step"] == 16
    a, b = _params(whole, 2), _params(second, 2)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and the run really trained: the parameters moved away from the checkpoint at step 8
    c = _params(first, 2)
    assert any(not torch.equal(a[n], c[n]) for n in a)


@pytest.mark.timeout(300)
def test_epochs_with_a_padded_last_batch_train_and_schedule_every_batch(digits, tmp_path):
    """Two epochs of digits in batches of 32 with data.drop_last = false are 2 x 45 steps
    (44 full batches and a padded one), and the cosine schedule spans those 90: the last
    step's rate is rate_at(89, 90) > 0, where a schedule sized for 88 would be 0."""
    from mpipipe.core.logs.runlog import open_log
    from mpipipe.core.run.lr import rate_at
    from mpipipe.core.state.checkpoint import load_stage

    log, ckpt = tmp_path / "epochs.h5", tmp_path / "ckpt"
    result = mpirun(2, *_data(digits), "--set", "pipeline.stages=2", "--set", "pipeline.balance_by=params",
                    "--set", "run.steps=0", "--set", "run.epochs=2", "--set", "run.eval_every=0",
                    "--set", "data.batch_size=32", "--set", "data.drop_last=false",
                    "--set", 'optim.schedule="cosine"', "--set", f'run.checkpoint_dir="{ckpt}"',
                    "--log", str(log), timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    run = open_log(log)
    assert run.steps["step"].tolist() == list(range(1, 91))
    for stage in range(2):
        state = load_stage(ckpt, stage)
        assert state.step == 90
        lr = state.optimizer["param_groups"][0]["lr"]
        assert lr == pytest.approx(rate_at({"lr": 0.05, "schedule": "cosine"}, 89, 90), rel=1e-9) and lr > 0


@pytest.mark.timeout(300)
def test_interleaved_1f1b_trains_in_the_plain_command_as_1f1b_does(digits, tmp_path):
    """`schedule = "interleaved-1f1b"` with an automatic balance cuts LeNet into 2K = 4
    chunks (v = 2); stage k's checkpoint holds chunks k and k + 2, and the run ends with
    the parameters of the same run under 1F1B (same micro-batches, same maths)."""
    from mpipipe.core.logs.runlog import open_log

    common = [*_data(digits), "--set", "pipeline.stages=2", "--set", "pipeline.balance_by=params",
              "--set", "run.steps=12", "--set", "run.eval_every=6", "--set", "pipeline.chunks=4"]
    ckpt = {}
    for schedule in ("interleaved-1f1b", "1f1b"):
        ckpt[schedule] = tmp_path / schedule
        log = tmp_path / f"{schedule}.h5"
        result = mpirun(2, *common, "--set", f'pipeline.schedule="{schedule}"',
                        "--set", f'run.checkpoint_dir="{ckpt[schedule]}"', "--log", str(log),
                        timeout=140)
        assert result.returncode == 0, result.stderr[-2000:]
        run = open_log(log)
        assert run.steps["step"].tolist() == list(range(1, 13))
        assert len(run.eval["accuracy"]) == 2
    balance = torch.load(ckpt["interleaved-1f1b"] / "stage-0.pt", weights_only=True)["balance"]
    assert len(balance) == 4
    a, b = _params(ckpt["interleaved-1f1b"], 2), _params(ckpt["1f1b"], 2)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= 1e-5, name
