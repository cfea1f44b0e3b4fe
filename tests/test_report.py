"""Tests of the `report` subcommand on logs written by RunLog itself, and on files that are not logs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpipipe import report, report_command
from mpipipe.core.logs.runlog import RunLog
from mpipipe.tools import logplot

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def pipeline_log(path: Path, *, steps: int = 30, failover: bool = True, samples_per_s: float = 500.0) -> Path:
    """A 3-stage ResPipe-like run with a backup of stage 1 that takes over after a kill at step 12."""
    cfg = {"model": {"name": "lenet"}, "data": {"batch_size": 64},
           "pipeline": {"stages": 3, "chunks": 4, "schedule": "1f1b"},
           "resilience": {"backups": {"1": 1}, "replicate_every": 1, "mode": "cold"}}
    log = RunLog(path, system="mpipipe", config=cfg, comm_size=4,
                 attrs={"plan": "0=stage 0, 1=stage 1, 2=stage 2, 3=backup 1"})
    t = 0.0
    for step in range(1, steps + 1):
        dt = 64 / samples_per_s * (3.0 if failover and step == 12 else 1.0)
        t += dt
        ranks = {}
        for r in range(4):
            if failover and r == 1 and step >= 12:
                continue  # the killed stage records nothing more
            ranks[r] = {"compute_s": dt * 0.6, "wait_s": dt * 0.4,
                        "bytes_sent": 4096 * (r != 2), "bytes_recv": 4096 * (r != 0)}
        log.step(step, time=t, loss=2.3 * math.exp(-step / 10), samples=64, samples_per_s=64 / dt, ranks=ranks)
        if step % 10 == 0:
            log.eval(step, time=t, accuracy=min(0.95, 0.3 + step / 40), loss=1.0 / step)
        if failover and step == 11:
            log.event("fault_injected", step=12, rank=1, time=t + 0.01, fault="kill")
            log.event("failure_detected", step=12, rank=1, time=t + 0.5, detected_after_s=0.49)
            log.event("takeover", step=12, rank=3, time=t + 1.1, stage=1, recovery_s=0.6)
        log.event("checkpoint", step=step, rank=3, time=t, directory="ckpt")
    log.set_attr("summary", {"steps": steps})
    log.close()
    return path


def stannis_log(path: Path, *, steps: int = 24) -> Path:
    """A host and two CSDs; a re-tune at step 8 moves samples from the CSDs to the host."""
    cfg = {"run": {"steps": steps}, "tune": {"objective": "throughput", "every": 8}}
    log = RunLog(path, system="stannis", config=cfg, comm_size=3,
                 emulation={"1": {"factor": 8}, "2": {"factor": 8}},
                 attrs={"plan": "0=host, 1=csd 1, 2=csd 2"})
    t = 0.0
    for r in range(3):
        log.event("energy_source", step=0, rank=r, time=0.0, source="model")
    for step in range(1, steps + 1):
        batches = [32, 32, 32] if step <= 8 else [80, 8, 8]
        speed = [400.0, 50.0, 40.0]
        dt = max(b / s for b, s in zip(batches, speed, strict=True))
        t += dt
        ranks = {r: {"compute_s": b / s, "wait_s": dt - b / s, "bytes_sent": 1000, "bytes_recv": 1000,
                     "batch_size": b, "joules": dt * (30.0 if r == 0 else 5.0)}
                 for r, (b, s) in enumerate(zip(batches, speed, strict=True))}
        log.step(step, time=t, loss=2.0 / step, samples=sum(batches), samples_per_s=sum(batches) / dt,
                 ranks=ranks)
        if step == 8:
            log.event("retune", step=8, time=t, old=[32, 32, 32], new=[80, 8, 8])
    log.eval(steps, time=t, accuracy=0.81)
    log.close()
    return path


def truncated_log(path: Path) -> Path:
    """A run killed mid-record: status stays 'running' and the last row reached only some columns."""
    log = RunLog(path, system="mpipipe", config={"pipeline": {"stages": 2}}, comm_size=2,
                 attrs={"plan": "0=stage 0, 1=stage 1"})
    for step in range(1, 8):
        log.step(step, time=0.1 * step, loss=1.0 / step, samples=32, samples_per_s=320.0,
                 ranks={r: {"compute_s": 0.05, "wait_s": 0.05, "bytes_sent": 10, "bytes_recv": 10} for r in (0, 1)})
    log.writer.file.close()  # what SIGKILL leaves behind: no close(), so status stays 'running'
    with h5py.File(path, "a") as f:
        for name in ("step", "time"):  # step 8 began to be written, loss and the rest did not
            ds = f["steps"][name]
            ds.resize((ds.shape[0] + 1,))
            ds[-1] = 8 if name == "step" else 0.8
        ds = f["ranks/0/compute_s"]
        ds.resize((ds.shape[0] + 1,))
        ds[-1] = 0.05
    return path


def assert_png(path: Path) -> None:
    assert path.exists(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 5000, f"{path} is suspiciously small"


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = report_command.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- good logs


@pytest.mark.timeout(120)
def test_pipeline_log_summary_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = pipeline_log(tmp_path / "respipe.h5")
    code, out, err = run_main([str(log), "--out", str(tmp_path / "plots")], capsys)
    assert code == 0, err
    assert err == ""
    assert "respipe.h5" in out and "mpipipe" in out and "status: completed" in out
    assert "pipeline.stages=3" in out and "resilience.backups" in out
    assert "steps: 30 (last step 30" in out
    assert "test accuracy: 95.00% (step 30" in out
    assert "final loss: 0.1145" in out  # 2.3 * exp(-3)
    # per-rank table: roles from the plan, the dead stage stops at 11 steps, bytes summed
    rows = {int(line.split()[0]): line for line in out.splitlines()
            if line.strip()[:1].isdigit() and ("stage" in line or "backup" in line)}
    assert set(rows) == {0, 1, 2, 3}
    assert "stage 1" in rows[1] and " 11 " in rows[1]
    assert "backup 1" in rows[3] and "122.9 kB" in rows[3]  # 30 x 4096 bytes
    assert "40.0%" in rows[0]  # wait share
    # events with their timings; routine checkpoint events are only counted
    assert "fault_injected" in out and "failure_detected" in out and "takeover" in out
    assert "detected after 0.490 s" in out and "recovery 0.600 s" in out
    assert "checkpoint x30 (steps 1..30)" in out
    for name in ("respipe-training.png", "respipe-ranks.png"):
        assert_png(tmp_path / "plots" / name)
    assert not (tmp_path / "plots" / "respipe-stannis.png").exists()


@pytest.mark.timeout(120)
def test_stannis_log_has_batch_and_energy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = stannis_log(tmp_path / "tuned.h5")
    code, out, err = run_main([str(log), "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "stannis" in out and "tune.objective=throughput" in out
    assert "emulated:" in out
    assert "samples/J" in out and "samples per joule" in out
    host = next(line for line in out.splitlines() if "host" in line and line.strip().startswith("0"))
    assert " 80 " in host  # last batch size of the host after the re-tune
    assert "retune" in out and "energy_source" in out
    for name in ("tuned-training.png", "tuned-ranks.png", "tuned-stannis.png"):
        assert_png(tmp_path / name)


@pytest.mark.timeout(120)
def test_several_logs_are_compared_and_overlaid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = pipeline_log(tmp_path / "respipe.h5")
    b = pipeline_log(tmp_path / "plain.h5", failover=False, samples_per_s=1000.0)
    c = stannis_log(tmp_path / "tuned.h5")
    code, out, err = run_main([str(a), str(b), str(c), "--out", str(tmp_path / "cmp")], capsys)
    assert code == 0, err
    assert "== comparison" in out
    table = out[out.index("== comparison"):]
    plain = next(line for line in table.splitlines() if "plain.h5" in line)
    assert float(plain.split()[5]) > 1.9  # about twice the samples/s of the first run (which lost a stage)
    assert_png(tmp_path / "cmp" / "respipe+plain+tuned-training.png")
    assert_png(tmp_path / "cmp" / "respipe+plain+tuned-ranks.png")
    assert_png(tmp_path / "cmp" / "respipe+plain+tuned-stannis.png")


@pytest.mark.timeout(120)
def test_truncated_log_is_reported_to_its_last_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = truncated_log(tmp_path / "killed.h5")
    code, out, err = run_main([str(log), "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "status: running" in out
    assert "did not finish" in out and "reported up to step 7" in out
    assert "steps: 7 (last step 7" in out
    assert "not evaluated" in out
    assert_png(tmp_path / "killed-training.png")


@pytest.mark.timeout(60)
def test_log_without_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "early.h5"
    RunLog(path, system="mpipipe", config={}, comm_size=2).writer.file.close()
    code, out, err = run_main([str(path), "--no-plots"], capsys)
    assert code == 0, err
    assert "steps: none recorded" in out and "events: none" in out


# ---------------------------------------------------------------- bad inputs


def _expect_error(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mpipipe report: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.timeout(60)
def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _expect_error([str(tmp_path / "nope.h5")], capsys, "nope.h5", "no such file")


@pytest.mark.timeout(60)
def test_text_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a log\n")
    _expect_error([str(path)], capsys, "notes.txt", "not a readable HDF5 file")


@pytest.mark.timeout(60)
def test_foreign_hdf5_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(10)
    _expect_error([str(path)], capsys, "other.h5", "not an mpipipe run log", "'format'")


@pytest.mark.timeout(60)
def test_log_missing_a_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = pipeline_log(tmp_path / "nogroup.h5", steps=3)
    with h5py.File(path, "a") as f:
        del f["eval"]
    _expect_error([str(path)], capsys, "group /eval is missing")


@pytest.mark.timeout(60)
def test_log_missing_a_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = pipeline_log(tmp_path / "nocol.h5", steps=3)
    with h5py.File(path, "a") as f:
        del f["steps/loss"]
        del f["ranks/2/wait_s"]
    _expect_error([str(path)], capsys, "/steps lacks column(s) loss")


@pytest.mark.timeout(60)
def test_log_missing_an_event_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = pipeline_log(tmp_path / "noevent.h5", steps=3)
    with h5py.File(path, "a") as f:
        del f["events/kind"]
    _expect_error([str(path)], capsys, "noevent.h5", "kind")


@pytest.mark.timeout(60)
def test_hdf5_file_cut_in_half(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = pipeline_log(tmp_path / "cut.h5", steps=3)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _expect_error([str(path)], capsys, "cut.h5")


@pytest.mark.timeout(60)
def test_one_bad_log_among_good_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The good logs are still reported; each bad one gets one line naming it; exit status 2."""
    good = pipeline_log(tmp_path / "good.h5", steps=3)
    other = stannis_log(tmp_path / "other.h5", steps=4)
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"\x00" * 100)
    code, out, err = run_main([str(good), str(tmp_path / "gone.h5"), str(other), str(junk), "--no-plots"],
                              capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert "gone.h5" in lines[0] and "junk.h5" in lines[1], err
    assert f"== {good}" in out and f"== {other}" in out and "comparison" in out
    assert "Traceback" not in err


# ---------------------------------------------------------------- end to end


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "mpipipe", "report", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_cli_end_to_end(tmp_path: Path) -> None:
    log = pipeline_log(tmp_path / "respipe.h5")
    done = _cli(str(log), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "takeover" in done.stdout and "plots:" in done.stdout
    assert_png(tmp_path / "out" / "respipe-training.png")


@pytest.mark.timeout(150)
def test_cli_bad_file_exits_2_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "junk.h5"
    path.write_bytes(b"\x00" * 100)
    done = _cli(str(path))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0
    assert "junk.h5" in done.stderr


@pytest.mark.timeout(120)
def test_late_column_and_unwritable_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A per-rank column that first appears mid-run is back-filled; plots into a file path fail cleanly."""
    path = tmp_path / "late.h5"
    log = RunLog(path, system="stannis", config={}, comm_size=2, attrs={"plan": "0=host, 1=csd 1"})
    for step in range(1, 6):
        extra = {"batch_size": 16, "joules": 2.0} if step > 2 else {}
        log.step(step, time=step * 0.1, loss=1.0, samples=32, samples_per_s=320.0,
                 ranks={r: {"compute_s": 0.05, "wait_s": 0.0, "bytes_sent": 1, "bytes_recv": 1, **extra}
                        for r in (0, 1)})
    log.close()
    code, out, err = run_main([str(path), "--out", str(tmp_path / "plots")], capsys)
    assert code == 0, err
    host = next(line for line in out.splitlines() if "host" in line and line.strip().startswith("0"))
    assert " 16 " in host and "8.00" in host  # 48 samples over 6 J, from the three steps that have them
    assert_png(tmp_path / "plots" / "late-stannis.png")
    blocker = tmp_path / "file"
    blocker.write_text("")
    _expect_error([str(path), "--out", str(blocker)], capsys, "cannot write plots")


@pytest.mark.timeout(120)
def test_many_events_are_counted_not_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "delays.h5"
    log = RunLog(path, system="mpipipe", config={}, comm_size=2, attrs={"plan": "0=stage 0, 1=stage 1"})
    for step in range(1, 201):
        log.step(step, time=step * 0.01, loss=1.0, samples=8, samples_per_s=800.0,
                 ranks={r: {"compute_s": 0.005, "wait_s": 0.005, "bytes_sent": 1, "bytes_recv": 1} for r in (0, 1)})
        if step % 4 == 0:
            log.event("fault_injected", step=step, rank=1, time=step * 0.01, fault="delay", seconds=0.01)
            log.event("late", step=step, rank=1, time=step * 0.01, waited_s=0.02)
    log.event("takeover", step=150, rank=1, time=1.5, recovery_s=0.25)
    log.close()
    code, out, err = run_main([str(path), "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "fault_injected x50 (steps 4..200)" in out and "late x50 (steps 4..200)" in out
    assert out.count("fault_injected") == 1
    assert "takeover" in out and "recovery 0.250 s" in out
    assert_png(tmp_path / "delays-training.png")


# ---------------------------------------------------------------- closed pipe, live logs


@pytest.mark.timeout(150)
def test_closed_pipe_is_quiet_and_plots_are_still_made(tmp_path: Path) -> None:
    """`report X.h5 | head -1`: the reader leaves before the report prints anything."""
    log = pipeline_log(tmp_path / "piped.h5")
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    job = subprocess.Popen([sys.executable, "-m", "mpipipe", "report", str(log), str(log), "--out",
                            str(tmp_path / "out")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    job.stdout.close()  # closed before the first write: every print meets a broken pipe
    err = job.stderr.read()
    assert job.wait(120) == 0, err
    assert err == "", err
    assert_png(tmp_path / "out" / "piped+piped-training.png")
    shell = subprocess.run(f"{sys.executable} -m mpipipe report --no-plots {log} {log} | head -1",
                           shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert shell.stdout.startswith("== ") and shell.stdout.count("\n") == 1, shell.stdout
    assert shell.stderr == "", shell.stderr


WRITER = """
import os, sys, time
from mpipipe.core.logs.runlog import RunLog
log = RunLog(sys.argv[1], system="mpipipe", config={}, comm_size=2, attrs={"plan": "0=stage 0, 1=stage 1"})
step = 0
while not os.path.exists(sys.argv[2]):  # until the test has read enough
    step += 1
    log.step(step, loss=1.0 / step, samples=8, samples_per_s=80.0,
             ranks={r: {"compute_s": 0.01, "wait_s": 0.01, "bytes_sent": 1, "bytes_recv": 1} for r in (0, 1)})
    if step % 5 == 0:
        log.event("checkpoint", step=step, rank=1, directory="ckpt")
    if step == 3:
        print("ready", flush=True)
    time.sleep(0.005)
log.close()
"""


@pytest.mark.timeout(120)
def test_reads_a_log_while_its_run_writes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A writer process holds the log open (and HDF5's lock) and appends rows as fast as it can;
    the report reads it again and again meanwhile, always up to a consistent last row."""
    import time

    path, stop = tmp_path / "live.h5", tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(stop)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        seen = []
        # The writer appends until told to stop, so neither the number of reads nor seeing
        # it append between them depends on how fast either process runs on a loaded machine.
        give_up = time.monotonic() + 90  # a hang guard, not a timing
        while len(seen) < 15 or seen[-1][1] == seen[0][1]:
            assert writer.poll() is None, writer.stderr.read()
            assert time.monotonic() < give_up, seen
            run = report.load_run(path)
            steps = run.steps["step"]
            assert list(steps) == list(range(1, len(steps) + 1))  # no torn or missing row
            assert all(len(c["step"]) >= len(steps) - 1 for c in run.ranks.values())
            seen.append((str(run.attrs["status"]), len(steps)))
        assert all(status == "running" for status, _ in seen)
        assert seen[-1][1] > seen[0][1]  # it was appending while we read
        stop.touch()
        assert writer.wait(60) == 0, writer.stderr.read()
        code, out, err = run_main([str(path), "--no-plots"], capsys)
        assert code == 0, err
        assert "the run did not finish (killed, or still going)" in out or "status: completed" in out
    finally:
        writer.kill()
        writer.wait()


# ---------------------------------------------------------------- one throughput, plots


def test_throughput_is_the_same_figure_in_progress_and_report(tmp_path: Path) -> None:
    from mpipipe.core.logs.progress import Progress, throughput

    run = report.load_run(pipeline_log(tmp_path / "t.h5"))
    progress = Progress(30, enabled=False)
    for step, t, n in zip(run.steps["step"], run.steps["time"], run.steps["samples"], strict=True):
        progress.update(int(step), loss=1.0, samples=int(n), time=float(t))
    expected = 64 * 29 / (run.steps["time"][-1] - run.steps["time"][0])  # steps 2..30 over step 1..30
    assert report.throughput(run) == pytest.approx(expected, rel=1e-12)
    assert progress.samples_per_s == pytest.approx(expected, rel=1e-12)
    assert math.isnan(throughput([1.0], [64]))  # one step: no figure rather than a different one


def test_a_resumed_log_counts_neither_the_gap_nor_each_sessions_first_step(tmp_path: Path) -> None:
    from mpipipe.core.logs.progress import throughput

    path = tmp_path / "resumed.h5"
    log = RunLog(path, system="mpipipe", config={}, comm_size=3)
    for step, t in zip(range(1, 4), (1.0, 2.0, 3.0), strict=True):
        log.step(step, time=t, loss=1.0, samples=10, samples_per_s=10.0)
    log.event("resume", step=3, rank=-1, time=50.0, directory="ckpt")  # 47 s later
    for step, t in zip(range(4, 7), (51.0, 52.5, 54.0), strict=True):
        log.step(step, time=t, loss=1.0, samples=10, samples_per_s=10.0)
    assert log.throughput() == pytest.approx(40 / (2.0 + 3.0), rel=1e-12)  # steps 2, 3, 5, 6
    log.close()
    assert report.throughput(report.load_run(path)) == pytest.approx(8.0, rel=1e-12)
    assert throughput([1.0, 2.0, 3.0, 51.0], [10, 10, 10, 10]) == pytest.approx(30 / 50.0)  # no sessions


def test_event_labels_never_overlap_and_cost_model_is_not_a_fault(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "ev.h5"
    log = RunLog(path, system="mpipipe", config={}, comm_size=3, attrs={"plan": "0=stage 0, 1=stage 1, 2=backup 1"})
    log.event("cost_model", step=0, rank=-1, time=0.5, bytes_per_step=1.0)
    for step in range(1, 101):
        log.step(step, time=1.0 + step * 0.1, loss=1.0, samples=8, samples_per_s=80.0,
                 ranks={r: {"compute_s": 0.05, "wait_s": 0.05, "bytes_sent": 1, "bytes_recv": 1} for r in (0, 1)})
    for kind, t in (("fault_injected", 5.0), ("failure_detected", 5.05), ("takeover", 5.1),
                    ("takeover_recovered", 5.2)):
        log.event(kind, step=40, rank=1, time=t)
    log.event("fault_injected", step=90, rank=1, time=10.0)
    log.close()
    run = report.load_run(path)
    for x in ("step", "time"):
        fig, ax = plt.subplots()
        logplot.mark_events(ax, run, "black", x, label_kinds=True)
        texts = [t.get_text().strip() for t in ax.texts]
        lines = [line.get_xdata()[0] for line in ax.lines]
        plt.close(fig)
        assert len(texts) == 2, texts  # four events close together share one label
        assert "cost_model" not in " ".join(texts) and 0 not in lines
        assert texts[0] == "fault, detected, takeover, recovered", texts
        if x == "time":  # time counts from the first step (t = 1.1)
            assert min(lines) == pytest.approx(5.0 - 1.1)


def test_idle_backups_appear_in_the_table(tmp_path: Path) -> None:
    run = report.load_run(pipeline_log(tmp_path / "idle.h5", failover=False))
    assert report.idle_ranks(run) == []  # the backup ran steps here (it recorded rows)
    path = tmp_path / "idle2.h5"
    log = RunLog(path, system="mpipipe", config={}, comm_size=3, attrs={"plan": "0=stage 0, 1=stage 1, 2=backup 0"})
    for step in range(1, 4):
        log.step(step, time=step * 0.1, loss=1.0, samples=8, samples_per_s=80.0,
                 ranks={r: {"compute_s": 0.05, "wait_s": 0.05, "bytes_sent": 1, "bytes_recv": 1} for r in (0, 1)})
    log.close()
    run = report.load_run(path)
    assert report.idle_ranks(run) == [2]
    row = next(line for line in report.summarize(run).splitlines() if line.strip().startswith("2 "))
    assert "backup 0" in row and "idle" in row
    paths = report.plot_runs([run], tmp_path / "plots")
    assert_png(paths[1])


def test_tradeoff_plot_is_written_and_a_row_without_a_key_is_named(tmp_path: Path) -> None:
    rows = [{"mode": m, "R": r, "link_mbit": rate, "overhead": 0.01 * r, "lost_updates": 0 if m == "hot" else r - 1}
            for m in ("cold", "hot") for r in (1, 10) for rate in (20.0, 100.0)]
    rows[0]["overhead_interval"] = (-0.005, 0.03)  # a point measured in pairs: drawn with its interval
    path = report.plot_tradeoff(rows, tmp_path / "sub" / "tradeoff.png", title="t",
                                measured_lost=[("cold", 10, 5.0)])
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="lacks overhead"):
        report.plot_tradeoff([{"mode": "cold", "R": 1, "link_mbit": 20.0, "lost_updates": 0}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one row"):
        report.plot_tradeoff([], tmp_path / "x.png")


def test_the_log_docs_say_what_the_schema_module_declares() -> None:
    """docs/hdf5-log.md holds the column tables exactly as mpipipe.core.logs.logschema prints them,
    and its events table lists exactly the EventKind members: one schema, described once."""
    import re

    from mpipipe.core.logs import logschema

    docs = (ROOT / "docs" / "hdf5-log.md").read_text()
    assert logschema.markdown() in docs, (
        "docs/hdf5-log.md: the column tables differ from mpipipe/core/logs/logschema.py; paste the output "
        "of `python -m mpipipe.core.logs.logschema` over them")
    for columns in logschema.GROUPS.values():
        for column in columns:
            assert f"| `{column.name}` |" in docs
    table = docs[docs.index("| kind | written by | detail |"):]
    table = table[:table.index("\n\n")]
    documented = {kind for row in table.splitlines()[2:]
                  for kind in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    declared = {k.value for k in logschema.EventKind}
    assert documented == declared, (f"docs/hdf5-log.md's events table lacks {sorted(declared - documented)} "
                                    f"and has kinds EventKind does not declare: {sorted(documented - declared)}")


def test_a_system_s_plots_come_from_its_own_module(tmp_path: Path) -> None:
    """The report draws Stannis's plots through the registry (stannis/plots.py registers them);
    a system with no plot module draws none of its own, and a broken one is an error, not silence."""
    assert report.plots_for("mpipipe") is None and report.plots_for("no-such-system") is None
    own = report.plots_for("stannis")
    assert own is not None and own.plot.__module__ == "stannis.plots" and own.suffix == "stannis"
    pkg = tmp_path / "brokensys"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plots.py").write_text("raise RuntimeError('a bug in the plot module')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="a bug in the plot module"):
            report.plots_for("brokensys")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("brokensys", None)
