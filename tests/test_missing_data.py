"""A wrong ``data.path``: the error names what is missing (the folder, its train/ or
test/, the shards) and the converter that fits what the user has; a run that failed so,
before its first step, leaves a log that the rerun replaces without --overwrite, and
never a real run's log (issue 37, item 5)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import pytest

from mpipipe.core.logs.runlog import RunLog, open_log
from mpipipe.core.run import batches, cli
from mpipipe.tools.launch import ROOT, run_mpi
from native import advice

CONFIG = ROOT / "jobs" / "configs" / "pipeline-digits.toml"
SOURCES = ["digits", "cifar10-bin", "mnist-idx", "npz", "synthetic", "folder", "dataset"]


def photos(root: Path, classes: tuple[str, ...] = ("cat", "dog", "owl", "pig")) -> Path:
    """A user's images: one folder per class (the files need not decode: nothing reads them)."""
    for c in classes:
        (root / c).mkdir(parents=True)
        (root / c / "1.png").write_bytes(b"")
    return root


def error_of(path: Path | str, split: str = "train") -> str:
    with pytest.raises(batches.DataError) as e:
        batches._open(path, split)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_the_converters_named_are_those_of_native_convert_help() -> None:
    help_text = subprocess.run([".venv/bin/python", "-m", "native.convert", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60, check=True).stdout
    assert list(advice.converters()) == SOURCES
    assert all(name in help_text for name in SOURCES)


def test_a_missing_folder_with_the_images_beside_it_suggests_folder(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's case: data.path = data/fotos does not exist; their photos are in fotos/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    photos(tmp_path / "fotos")
    message = error_of("data/fotos")
    assert message.startswith("data set data/fotos does not exist (no such folder)"), message
    assert "`python -m native.convert folder fotos data/fotos --size 64`" in message
    assert "4 class folders (cat, dog, owl, pig)" in message
    assert "digits" not in message and "train/" not in message


def test_a_missing_folder_beside_a_folder_of_images_suggests_it(tmp_path: Path) -> None:
    photos(tmp_path / "photos")
    message = error_of(tmp_path / "fotos")
    assert f"`python -m native.convert folder {tmp_path}/photos {tmp_path}/fotos --size 64`" in message


def test_a_missing_folder_whose_parent_holds_class_folders_suggests_the_parent(tmp_path: Path) -> None:
    photos(tmp_path)
    message = error_of(tmp_path / "shards")
    assert f"`python -m native.convert folder {tmp_path} {tmp_path}/shards --size 64`" in message


def test_a_misspelt_data_set_is_named(tmp_path: Path) -> None:
    (tmp_path / "digits" / "train").mkdir(parents=True)
    (tmp_path / "digits" / "train" / "manifest.json").write_text("{}")
    assert f"did you mean {tmp_path}/digits?" in error_of(tmp_path / "digitz")


def test_nothing_near_lists_every_converter(tmp_path: Path) -> None:
    message = error_of(tmp_path / "nowhere" / "data")
    assert f"data set {tmp_path}/nowhere/data does not exist, nor does the folder {tmp_path}/nowhere" in message
    assert all(f"{name}: " in message for name in SOURCES), message
    assert f"`python -m native.convert SOURCE ... {tmp_path}/nowhere/data`" in message


def test_a_folder_of_images_given_as_the_data_set(tmp_path: Path) -> None:
    """data.path points at the images themselves: not a converted data set; the converter
    writes beside it, and data.path must then name that."""
    src = photos(tmp_path / "fotos")
    message = error_of(src)
    assert message.startswith(f"data set {src} has no train/ directory: it is not a converted data set"), message
    assert f"`python -m native.convert folder {src} {src}-shards --size 64` and set data.path = \"{src}-shards\"" \
        in message


def test_loose_images_are_told_to_go_into_class_folders(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / "fotos" / f"{i}.jpg").parent.mkdir(exist_ok=True)
        (tmp_path / "fotos" / f"{i}.jpg").write_bytes(b"")
    message = error_of(tmp_path / "fotos")
    assert "holds 3 image files (0.jpg, 1.jpg, 2.jpg) but no class folders" in message
    assert "folder of its own" in message


@pytest.mark.parametrize("files,command", [
    (["data_batch_1.bin", "data_batch_2.bin", "test_batch.bin"], "cifar10-bin {src}/*.bin {src}-shards"),
    (["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
      "t10k-labels-idx1-ubyte.gz"],
     "mnist-idx {src}/train-images-idx3-ubyte.gz {src}/train-labels-idx1-ubyte.gz {src}-shards "
     "--test-images {src}/t10k-images-idx3-ubyte.gz --test-labels {src}/t10k-labels-idx1-ubyte.gz"),
    (["mnist.npz"], "npz {src}/mnist.npz {src}-shards"),
])
def test_a_known_download_gets_its_converter(tmp_path: Path, files: list[str], command: str) -> None:
    src = tmp_path / "download"
    src.mkdir()
    for name in files:
        (src / name).write_bytes(b"")
    assert f"`python -m native.convert {command.format(src=src)}`" in error_of(src)


def test_a_train_folder_of_images_is_not_shards(tmp_path: Path) -> None:
    photos(tmp_path / "set" / "train")
    message = error_of(tmp_path / "set")
    assert message.startswith(f"{tmp_path}/set/train holds no shards (no manifest.json)"), message
    assert f"folder {tmp_path}/set/train {tmp_path}/set-shards" in message


def test_a_missing_test_split_is_named(digits: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(digits / "train", tmp_path / "d" / "train")
    message = error_of(tmp_path / "d", "test")
    assert message.startswith(f"data set {tmp_path}/d has no test/ directory (it has the other split only)")


def test_a_file_given_as_the_data_set(tmp_path: Path) -> None:
    (tmp_path / "mnist.npz").write_bytes(b"")
    message = error_of(tmp_path / "mnist.npz")
    assert "is a file, not a data set folder" in message
    assert f"`python -m native.convert npz {tmp_path}/mnist.npz {tmp_path}/mnist`" in message


# ---------------------------------------------------------------- the log of a failed start


def _log(path: Path, *, status: str, steps: int = 0, event_step: int | None = None) -> Path:
    log = RunLog(path, system="mpipipe", config={}, comm_size=2)
    log.event("cost_model", step=0, bytes_per_step=1.0)  # start-up notes are at step 0
    for step in range(1, steps + 1):
        log.step(step, time=0.1 * step, loss=1.0, samples=8, samples_per_s=80.0)
    if event_step is not None:
        log.event("fault_injected", step=event_step, rank=1, fault="kill")
    if status == "running":
        log.writer.file.close()  # a killed run: no close()
    else:
        log.close(status)
    return path


@pytest.mark.parametrize("kind,replaceable", [
    ("failed before step 1", True),
    ("completed", False),
    ("failed after a step", False),
    ("failed inside step 1", False),
    ("running, no rows", False),
    ("not a log", False),
])
def test_only_the_log_of_a_failed_start_may_be_replaced(tmp_path: Path, kind: str, replaceable: bool) -> None:
    path = tmp_path / "run.h5"
    if kind == "failed before step 1":
        _log(path, status="failed: data set data/fotos does not exist")
    elif kind == "completed":
        _log(path, status="completed", steps=3)
    elif kind == "failed after a step":
        _log(path, status="failed: stage 1 lost", steps=1)
    elif kind == "failed inside step 1":
        _log(path, status="failed: stage 1 lost", event_step=1)
    elif kind == "running, no rows":
        _log(path, status="running")
    else:
        with h5py.File(path, "w") as f:
            f.attrs["status"] = "failed: mine"
    found = cli.failed_before_first_step(path)
    assert (found is not None) == replaceable, (kind, found)
    args = type("Args", (), {"overwrite": False, "resume": None})()
    mode, error = cli._log_mode(path, args)
    assert (mode, error is None) == (("w", True) if replaceable else ("x", False))


def mpirun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_mpi(2, ["-m", "mpipipe", "train", "--quiet", "--config", str(CONFIG),
                       "--set", "pipeline.stages=2", "--set", "run.steps=4", "--set", "run.eval_every=0",
                       *args], timeout=timeout)


@pytest.mark.long  # make test-long: two failing starts and a run
@pytest.mark.timeout(300)
def test_a_rerun_after_a_failed_start_needs_no_overwrite(digits: Path, tmp_path: Path) -> None:
    log = tmp_path / "run.h5"
    bad = mpirun("--set", f'data.path="{tmp_path}/fotos"', "--log", str(log), timeout=100)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert f"data set {tmp_path}/fotos does not exist" in bad.stderr
    failed = open_log(log)
    assert failed.attrs["status"].startswith(f"failed: data set {tmp_path}/fotos does not exist")
    assert len(failed.steps.get("step", [])) == 0

    good = mpirun("--set", f'data.path="{digits}"', "--log", str(log), timeout=200)
    assert good.returncode == 0, good.stderr[-2000:]
    assert f"note: replacing {log}, the log of a run that failed before its first step" in good.stderr
    ran = open_log(log)
    assert ran.attrs["status"] == "completed" and ran.steps["step"].tolist() == [1, 2, 3, 4]

    # that log holds a real run: a third run is refused and leaves it as it was
    before = log.read_bytes()
    again = mpirun("--set", f'data.path="{digits}"', "--log", str(log), timeout=100)
    assert again.returncode == 2
    assert f"the run log {log} exists; pass --overwrite" in again.stderr
    assert log.read_bytes() == before
