"""The clean collective stop (mpipipe.core.mpi.stop) under real mpirun: data errors and stop signals.

A damaged record read mid-run (records are CRC-checked when first read, not when a
shard is opened) or a label outside the model's classes stops every rank with one
line, the log's status ``failed: data: ...`` and exit status 2, on the plain
pipeline, on ResPipe (no backup may take over) and on Stannis. A stop signal
(SIGUSR1 to mpirun, which Open MPI forwards to every rank) stops every rank at one
step boundary with a checkpoint, status ``interrupted at step S`` and a resume line
whose command continues the run. Timeouts here are hang guards, not timings.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import native
from mpipipe import report
from mpipipe.core.logs.runlog import open_log
from mpipipe.tools.launch import ROOT, kill_job, run_mpi, start_mpi
from native.reader import read_all

# make test-long (.ci/run runs it): stops by signal and by a damaged record, in every system.
pytestmark = pytest.mark.long

PIPELINE = ROOT / "jobs" / "configs" / "pipeline-digits.toml"
RESPIPE = ROOT / "jobs" / "configs" / "respipe-digits.toml"
STANNIS = ROOT / "jobs" / "configs" / "stannis-digits.toml"
BATCH = 32


def _flip(shard: Path, record: int) -> None:
    """Flip one byte inside ``record`` of a dense shard (the writer makes only those)."""
    sh = native._shard.Shard(str(shard), "never")
    at = sh.data_offset + record * sh.record_size
    sh.close()
    data = bytearray(shard.read_bytes())
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.fixture
def damaged(digits: Path, tmp_path: Path) -> tuple[Path, int]:
    """A copy of the digits whose train record read first at step 5 (seed 0) is damaged."""
    out = tmp_path / "damaged"
    shutil.copytree(digits, out)
    ds = native.open_dataset(out / "train")
    sampler = native.Sampler(len(ds), seed=0)
    record = next(int(idx[0]) for i, idx in enumerate(sampler.batches(BATCH)) if i == 5)
    ds.close()
    _flip(out / "train" / "shard-00000.shard", record)
    return out, record


def _pipeline(n: int, config: Path, data: Path, log: Path, *extra: str, ulfm: bool = False,
              timeout: float = 200) -> subprocess.CompletedProcess:
    return run_mpi(n, ["-m", "mpipipe", "train", "--quiet", "--config", str(config),
                       "--set", f'data.path="{data}"', "--set", "run.steps=20",
                       "--set", "run.eval_every=0", "--set", f"data.batch_size={BATCH}",
                       "--log", str(log), *extra], ulfm=ulfm, timeout=timeout)


def _one_data_line(result: subprocess.CompletedProcess, prog: str, *words: str) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith(f"{prog}: error: data:")]
    assert len(lines) == 1, result.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "MPI_ABORT" not in result.stderr, result.stderr[-3000:]
    return lines[0]


@pytest.mark.timeout(260)
def test_damaged_record_mid_run_stops_the_plain_pipeline(damaged, tmp_path):
    data, record = damaged
    log = tmp_path / "plain.h5"
    result = _pipeline(3, PIPELINE, data, log)
    assert result.returncode == 2, result.stderr[-3000:]
    _one_data_line(result, "mpipipe train", "shard-00000.shard", f"record {record}",
                   "python -m native.check --verify")
    run = open_log(log)
    assert run.attrs["status"].startswith("failed: data: "), run.attrs["status"]
    assert list(run.steps["step"]) == [1, 2, 3, 4, 5]  # stopped before step 6, on every rank
    assert "late" not in {e["kind"] for e in run.events}


@pytest.mark.timeout(300)
def test_damaged_record_mid_run_is_no_takeover_under_respipe(damaged, tmp_path):
    data, record = damaged
    log = tmp_path / "respipe.h5"
    # stage 0 reads the data, and its backup could read it too: it must not take over
    result = _pipeline(4, RESPIPE, data, log, "--set", "resilience.backups={0 = 1}", ulfm=True,
                       timeout=280)
    assert result.returncode == 2, result.stderr[-3000:]
    _one_data_line(result, "mpipipe train", f"record {record}", "python -m native.check --verify")
    run = open_log(log)
    assert run.attrs["status"].startswith("failed: data: "), run.attrs["status"]
    kinds = {e["kind"] for e in run.events}
    assert not kinds & {"takeover", "late", "failure_detected", "stage_lost"}, kinds
    assert not list(tmp_path.glob("respipe*.tail.h5"))  # no side log: the writer closed it


def _labels_0_to_19(digits: Path, out: Path) -> None:
    """The digits with labels doubled (0..18): a data set of 19 classes."""
    for split in ("train", "test"):
        ds = native.open_dataset(digits / split)
        records = read_all(ds)
        ds.close()
        schema = {f.name: (f.dtype, f.shape) for f in ds.schema}
        with native.DatasetWriter(out / split, schema) as w:
            w.write({"image": records["image"], "label": records["label"] * 2})


@pytest.mark.timeout(120)
def test_labels_outside_num_classes_are_refused_at_start_up(digits, tmp_path):
    data = tmp_path / "labels19"
    _labels_0_to_19(digits, data)
    assert json.loads((data / "train" / "manifest.json").read_text())["ranges"]["label"] == [0, 18]
    log = tmp_path / "labels.h5"
    result = _pipeline(3, PIPELINE, data, log, timeout=100)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("mpipipe train: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "labels 0..18 but model.num_classes = 10" in errors[0]
    assert "set model.num_classes = 19" in errors[0]
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_a_label_out_of_range_in_an_old_data_set_is_a_data_error_when_read(digits, tmp_path):
    """A manifest without label ranges (older converter): the record is caught when read."""
    data = tmp_path / "old"
    _labels_0_to_19(digits, data)
    for split in ("train", "test"):
        path = data / split / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest["ranges"]
        path.write_text(json.dumps(manifest))
    from mpipipe.core.run import batches as mdata

    assert "records no label range" in mdata.check_labels(data, 10)
    batches = mdata.TrainBatches(data, BATCH, seed=0, num_classes=10)
    with pytest.raises(mdata.DataFault, match=r"shard-00000.shard: record \d+ .* has label 1\d, "
                                              r"outside 0..9"):
        for _ in range(len(batches)):
            batches.next()


def _damaged_csd1(stannis_split: Path, tmp_path: Path, nth: int) -> tuple[Path, int]:
    """A copy of the Stannis split with the ``nth`` record CSD 1 reads damaged; its index.

    CSD 1 (world rank 1) draws its records in the order of its stream's shuffle.
    """
    split = tmp_path / "split"
    shutil.copytree(stannis_split, split)
    ds = native.open_dataset(split / "csd1")
    record = int(np.random.default_rng(1).permutation(len(ds))[nth])
    ds.close()
    _flip(split / "csd1" / "shard-00000.shard", record)
    return split, record


@pytest.mark.timeout(300)
def test_damaged_record_on_a_csd_stops_stannis(stannis_split, tmp_path):
    # the 81st is read at step 3 or 4 (about 25 records a step with equal batches)
    split, record = _damaged_csd1(stannis_split, tmp_path, 80)
    log = tmp_path / "stannis.h5"
    result = run_mpi(5, ["-m", "stannis", "train", "--quiet", "--config", str(STANNIS),
                         "--log", str(log), "--set", f'data.path="{split}"',
                         "--set", "csd.slowdown=2.0", "--set", "run.eval_every=0",
                         "--set", "stannis.tune=false", "--set", "run.steps=10"], timeout=280)
    assert result.returncode == 2, result.stderr[-3000:]
    _one_data_line(result, "stannis train", "csd1", f"record {record}")
    run = open_log(log)
    assert run.attrs["status"].startswith("failed: data: "), run.attrs["status"]
    assert 1 <= len(run.steps["step"]) < 10
    assert "csd_dropped" not in {e["kind"] for e in run.events}


@pytest.mark.timeout(300)
def test_damaged_record_in_the_benchmark_phase_stops_stannis(stannis_split, tmp_path):
    """HyperTune's benchmark reads records too: a damaged one stops every rank before a step."""
    split, record = _damaged_csd1(stannis_split, tmp_path, 5)  # in the warm-up batch
    log = tmp_path / "stannis.h5"
    result = run_mpi(5, ["-m", "stannis", "train", "--quiet", "--config", str(STANNIS),
                         "--log", str(log), "--set", f'data.path="{split}"',
                         "--set", "csd.slowdown=2.0", "--set", "run.eval_every=0",
                         "--set", "run.steps=10"], timeout=280)
    assert result.returncode == 2, result.stderr[-3000:]
    _one_data_line(result, "stannis train", "csd1", f"record {record}")
    run = open_log(log)
    assert run.attrs["status"].startswith("failed: data: "), run.attrs["status"]
    assert len(run.steps.get("step", ())) == 0  # no step row: it stopped before step 1


def _stop_mid_run(n: int, argv: list[str], ckpt: Path, *, ulfm: bool = False,
                  sig: int = signal.SIGUSR1) -> subprocess.CompletedProcess:
    """Start a job, wait for its first checkpoint, then signal mpirun; returns the result."""
    job = start_mpi(n, argv, ulfm=ulfm, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
    try:
        give_up = time.monotonic() + 200
        while not (ckpt / "stage-0.pt").exists():
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < give_up, "no checkpoint within 200 s"
            time.sleep(0.2)
        job.send_signal(sig)
        out, err = job.communicate(timeout=120)
    except BaseException:
        kill_job(job)
        raise
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def _interrupted(result: subprocess.CompletedProcess, log: Path, ckpt: Path) -> tuple[int, str]:
    assert result.returncode == 143, result.stderr[-3000:]
    lines = [ln for ln in result.stderr.splitlines() if "interrupted by SIGUSR1 at step" in ln]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    run = open_log(log)
    status = run.attrs["status"]
    assert status.startswith("interrupted at step "), status
    step = int(status.rsplit(" ", 1)[1])
    assert f"at step {step};" in lines[0] and f"--resume {ckpt}" in lines[0], lines[0]
    import torch

    for k in range(3):
        assert torch.load(ckpt / f"stage-{k}.pt", weights_only=False)["step"] == step
    return step, lines[0].split("resume with: ", 1)[1]


@pytest.mark.timeout(600)
def test_sigusr1_to_mpirun_stops_the_pipeline_at_a_step_with_a_resumable_checkpoint(digits,
                                                                                  tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "first.h5"
    argv = ["-m", "mpipipe", "train", "--quiet", "--config", str(PIPELINE),
            "--set", f'data.path="{digits}"', "--set", "run.steps=2000", "--set",
            "run.eval_every=0", "--set", "run.checkpoint_every=5",
            "--set", f'run.checkpoint_dir="{ckpt}"', "--log", str(log)]
    result = _stop_mid_run(3, argv, ckpt)
    step, command = _interrupted(result, log, ckpt)
    assert 5 <= step < 2000
    # The reader's position is the one after step S's batch, not after the batch read for
    # step S + 1 (read before the stop was agreed on): resuming trains on that batch.
    from mpipipe.core.state.checkpoint import load_stage

    batch = 32  # data.batch_size of pipeline-digits.toml, not overridden here
    with native.open_dataset(Path(digits) / "train") as train:
        per_epoch = native.Sampler(len(train), seed=0).num_batches(batch)
    assert load_stage(ckpt, 0).sampler == (step // per_epoch, step % per_epoch * batch)
    # The printed command resumes the run: run it (fewer steps, a fresh log).
    words = shlex.split(command)
    # one host, and on a machine with fewer cores than ranks mpirun needs --oversubscribe
    launch = ["mpirun", *(["--oversubscribe"] if (os.cpu_count() or 1) < 3 else []), "-n", "3"]
    assert words[:len(launch)] == launch, command
    words = words[len(launch):]
    assert words[:3] == ["python", "-m", "mpipipe"]
    rest = words[3:]
    rest[rest.index("run.steps=2000")] = f"run.steps={step + 3}"
    rest[rest.index(str(log))] = str(tmp_path / "second.h5")
    own = rest.index(f'run.checkpoint_dir="{ckpt}"')
    rest[own] = f'run.checkpoint_dir="{tmp_path / "ckpt2"}"'  # keep ckpt for the next one
    again = run_mpi(3, ["-m", "mpipipe", *rest], timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    second = open_log(tmp_path / "second.h5")
    assert second.attrs["status"] == "completed"
    assert list(second.steps["step"]) == [step + 1, step + 2, step + 3]
    # Into its own log: one row a step, and one throughput in the summary and the report,
    # the time between the two sessions left out.
    rest[rest.index(str(tmp_path / "second.h5"))] = str(log)
    rest[own] = f'run.checkpoint_dir="{ckpt}"'
    again = run_mpi(3, ["-m", "mpipipe", *rest], timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    first = open_log(log)
    assert first.attrs["status"] == "completed"
    assert list(first.steps["step"]) == list(range(1, step + 4))
    summary = json.loads(first.attrs["summary"])["samples_per_s"]
    assert summary == pytest.approx(report.throughput(report.load_run(log)), rel=1e-9)
    # A checkpoint at the run's last step: nothing to resume, said in one line; log untouched.
    before = log.read_bytes()
    nothing = run_mpi(3, ["-m", "mpipipe", *rest], timeout=200)
    assert nothing.returncode == 2, nothing.stderr[-3000:]
    assert nothing.stderr.count("error:") == 1 and "nothing to resume" in nothing.stderr, nothing.stderr
    assert log.read_bytes() == before


@pytest.mark.timeout(600)
def test_sigusr1_to_mpirun_stops_respipe_without_a_takeover(digits, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "respipe.h5"
    argv = ["-m", "mpipipe", "train", "--quiet", "--config", str(RESPIPE),
            "--set", f'data.path="{digits}"', "--set", "run.steps=2000", "--set",
            "run.eval_every=0", "--set", "run.checkpoint_every=5", "--set",
            "resilience.backups={1 = 1}", "--set", f'run.checkpoint_dir="{ckpt}"',
            "--log", str(log)]
    result = _stop_mid_run(4, argv, ckpt, ulfm=True)
    step, _ = _interrupted(result, log, ckpt)
    run = open_log(log)
    assert not {"takeover", "late", "failure_detected"} & {e["kind"] for e in run.events}
    assert run.steps["step"][-1] == step  # every row up to the stop is written
