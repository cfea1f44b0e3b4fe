"""What a user sees while a run goes: the start-up line, progress (bar or plain lines), ResPipe's
events printed once, and one throughput figure that the summary and the report share.

The MPI runs are real mpirun jobs whose output goes to a pipe, as under Slurm or CI: the
progress must then be plain lines even though Open MPI gives rank 0 a pseudo-terminal.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from pathlib import Path

import pytest

from mpipipe.core.logs.progress import Progress, event_line, plain_lines, startup_line
from mpipipe.tools.launch import ROOT, run_mpi

PIPELINE = ROOT / "jobs" / "configs" / "pipeline-digits.toml"
RESPIPE = ROOT / "jobs" / "configs" / "respipe-digits.toml"


# ---------------------------------------------------------------- units


def test_plain_lines_rule() -> None:
    master, slave = os.openpty()  # a real terminal stream, for the isatty() side of the rule
    tty = open(slave, "w")  # noqa: SIM115 - closed below
    try:
        assert plain_lines(io.StringIO(), {"TERM": "xterm"})  # not a terminal
        assert not plain_lines(tty, {"TERM": "xterm"})  # a terminal, no launcher
        assert plain_lines(tty, {"TERM": "dumb"})
        assert plain_lines(tty, {})  # no TERM at all
        assert plain_lines(tty, {"TERM": "xterm", "MPIPIPE_PROGRESS": "lines"})
        assert not plain_lines(io.StringIO(), {"MPIPIPE_PROGRESS": "bar"})
        # under Open MPI isatty() lies; pytest has no mpirun among its ancestors, so no
        # launcher writes to a terminal here: lines
        assert plain_lines(tty, {"TERM": "xterm", "OMPI_COMM_WORLD_SIZE": "3"})
    finally:
        tty.close()
        os.close(master)


def test_plain_lines_show_elapsed_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIPIPE_PROGRESS", "lines")
    out = io.StringIO()
    progress = Progress(20, every=5, prog="p", stream=out)
    for step in range(1, 21):
        progress.update(step, loss=0.5, samples=10, time=step * 0.5)
    progress.evaluation(20, 0.75)
    progress.summary(steps=20, samples_per_s=progress.samples_per_s)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len([line for line in lines if " step " in line and "/20" in line]) == 4
    assert re.search(r"p: step 10/20  loss 0\.5000  20\.0 samples/s  elapsed \d\d:\d\d  eta \d\d:\d\d$",
                     lines[1]), lines
    assert lines[-2] == "p: step 20: test accuracy 0.7500"
    assert lines[-1] == "p: done: steps 20, samples per s 20.0"  # 19 steps x 10 over 9.5 s


def test_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIPIPE_PROGRESS", "bar")
    out = io.StringIO()
    progress = Progress(10, prog="p", stream=out)
    for step in range(1, 11):
        progress.update(step, loss=0.5, samples=10, time=step * 1.0)
    progress.message("step 10: test accuracy 0.5000")
    progress.summary(steps=10)
    text = out.getvalue()
    assert "10/10" in text and "10.0 samples/s" in text and "<" in text  # elapsed<remaining
    assert "p: step 10: test accuracy 0.5000\n" in text
    assert text.endswith("p: done: steps 10\n")


def test_startup_line_names_world_hosts_plan_and_log() -> None:
    line = startup_line(4, ["stage 0", "stage 1", "backup 1", "backup 1"], ["a", "a", "b", "b"], "/x/run.h5")
    assert line == ("4 ranks on a (ranks 0-1), b (ranks 2-3); plan: stage 0 on rank 0, stage 1 on rank 1, "
                    "backup 1 on ranks 2-3; log /x/run.h5")


# ---------------------------------------------------------------- real runs


def _train(n: int, config: Path, digits: Path, log: Path, *args: str, ulfm: bool = False,
           timeout: float = 240):
    env = {"MPIPIPE_PROGRESS": "auto"}  # the automatic rule decides, whatever CI sets
    argv = ["-m", "mpipipe", "train", "--config", str(config), "--set", f'data.path="{digits}"',
            "--log", str(log), *args]
    return run_mpi(n, argv, ulfm=ulfm, timeout=timeout, env=env)


def test_a_lost_backup_is_named_as_the_backup_of_its_stage() -> None:
    detail = {"stage": -1, "backup_of": 2, "detected_after_s": 0.25, "how": "ulfm"}
    assert event_line("failure_detected", 7, 4, detail) == \
        "step 7: rank 4 (backup of stage 2) failed, detected after 0.250 s (ulfm)"
    assert event_line("failure_detected", 7, 1, {**detail, "stage": 1, "backup_of": -1}) == \
        "step 7: rank 1 (stage 1) failed, detected after 0.250 s (ulfm)"


@pytest.mark.long  # make test-long: console lines
@pytest.mark.timeout(300)
def test_plain_run_console_and_one_throughput(digits: Path, tmp_path: Path) -> None:
    """Start-up line, plain lines into a pipe, balance_by=time the same on every rank and in
    the log, and the summary's samples/s equal to the report's."""
    from mpipipe import report
    from mpipipe.core.state import checkpoint

    log = tmp_path / "plain.h5"
    result = _train(3, PIPELINE, digits, log, "--set", "run.steps=24", "--set", "run.eval_every=12",
                    "--set", "run.log_every=6", "--set", 'pipeline.balance_by="time"',
                    "--set", "run.checkpoint_every=24", "--set", f'run.checkpoint_dir="{tmp_path / "ck"}"')
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "\r" not in out and "\x1b" not in out, out  # a pipe: plain lines, no bar
    lines = out.splitlines()
    start = [line for line in lines if " ranks on " in line]
    assert len(start) == 1 and lines[0] == start[0], out
    assert re.fullmatch(rf"mpipipe train: 3 ranks on \S+ \(3 ranks\); plan: stage 0 on rank 0, stage 1 on "
                        rf"rank 1, stage 2 on rank 2; log {re.escape(str(log))}", start[0]), start[0]
    progress = [line for line in lines if re.search(r"step \d+/24 ", line)]
    assert len(progress) == 4 and all("elapsed" in line and "eta" in line for line in progress), out
    assert len([line for line in lines if "test accuracy" in line and "done:" not in line]) == 2, out

    run = report.load_run(log)
    summary = json.loads(run.attrs["summary"])
    assert summary["samples_per_s"] == pytest.approx(report.throughput(run), rel=1e-9)
    printed = re.search(r"done: .*samples per s ([0-9,.]+?),? ", out).group(1)
    assert printed == f"{report.throughput(run):,.1f}" in report.summarize(run)
    assert progress[-1].split("  ")[2] == f"{printed} samples/s"  # the last progress line too

    balance = json.loads(run.attrs["balance"])
    assert [checkpoint.load_stage(tmp_path / "ck", k).balance for k in range(3)] == [balance] * 3


@pytest.mark.long  # make test-long: console lines under faults
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [1, 0], ids=["stage-1", "stage-0-the-log-writer"])
def test_respipe_prints_fault_takeover_and_evaluations_once(digits: Path, tmp_path: Path, stage: int) -> None:
    """Killing stage 0 also kills the log writer: the fault is announced by the dying writer,
    the takeover by the new one; neither line twice, and the summary still equals the report."""
    log = tmp_path / f"respipe-{stage}.h5"
    result = _train(4, RESPIPE, digits, log, "--set", "run.steps=20", "--set", "run.eval_every=10",
                    "--set", f"resilience.backups={{{stage} = 1}}", "--inject", f"kill:stage={stage}:step=8",
                    ulfm=True, timeout=360)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert out.count(f"fault injected on rank {stage}: kill:stage={stage}:step=8") == 1, out
    assert len(re.findall(rf"takeover: stage {stage} \(was rank {stage}\) now served by rank 3", out)) == 1, out
    assert out.count("takeover:") == 1, out
    assert "took over" not in out + result.stderr  # no second report from the promoted rank
    assert out.count("test accuracy") == 3, out  # steps 10 and 20, and the summary
    assert out.count(" ranks on ") == 1

    from mpipipe import report

    run = report.load_run(log)
    assert json.loads(run.attrs["summary"])["samples_per_s"] == pytest.approx(report.throughput(run),
                                                                               rel=1e-9)
    assert not math.isnan(report.throughput(run))
