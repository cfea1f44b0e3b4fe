"""The report prints the class names of the data set a run trained on (issue 27), read from the
data set's manifest via the log's ``data.path``; a data set that is gone or has no names prints
nothing and is no error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import native
from mpipipe import report, report_command
from mpipipe.core.logs.runlog import RunLog

CLASSES = ["ant", "bee", "cat"]


def make_dataset(out: Path, classes: list[str] | None = CLASSES, split: str = "train") -> Path:
    """OUT/<split>: six tiny images, two per class, with the class names in its manifest
    (none when classes is None: a list of pairs has no `classes` attribute to fall back on)."""
    rng = np.random.default_rng(0)
    items = [(rng.integers(0, 256, (3, 8, 8), dtype=np.uint8), i % 3) for i in range(6)]
    native.write_dataset(items, out, split=split, classes=classes)
    return out


def make_log(path: Path, data_path: Path, system: str = "mpipipe") -> Path:
    """A minimal finished run log whose config names `data_path`, with one step row."""
    log = RunLog(path, system=system, config={"data": {"path": str(data_path)}}, comm_size=1)
    log.step(1, time=0.1, loss=1.0, samples=6, samples_per_s=60.0)
    log.close()
    return path


def report_of(log: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = report_command.main([str(log), "--no-plots"])
    out, err = capsys.readouterr()
    return code, out, err


def classes_lines(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.strip().startswith("classes:")]


def test_report_prints_the_class_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = make_dataset(tmp_path / "shapes")
    code, out, err = report_of(make_log(tmp_path / "run.h5", data), capsys)
    assert code == 0, err
    assert err == ""
    assert classes_lines(out) == ["classes: ant, bee, cat"]


def test_stannis_data_path_holds_public_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Stannis run's data.path is the `stannis prepare` output: the names are in public/train."""
    split = tmp_path / "split"
    make_dataset(split / "public")
    code, out, err = report_of(make_log(tmp_path / "stannis.h5", split, system="stannis"), capsys)
    assert code == 0, err
    assert classes_lines(out) == ["classes: ant, bee, cat"]


def test_data_set_gone_prints_no_classes_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = make_dataset(tmp_path / "shapes")
    log = make_log(tmp_path / "run.h5", data)
    shutil.rmtree(data)
    code, out, err = report_of(log, capsys)
    assert code == 0, err
    assert err == ""
    assert classes_lines(out) == []
    assert "steps: 1" in out  # the rest of the summary is all there


@pytest.mark.parametrize("damage", ["no names", "not a list", "no manifest"])
def test_no_or_bad_names_print_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    """A data set made from arrays has no names; a broken manifest is the data set's problem,
    for `native.check` to find, not a reason for the report to fail."""
    data = make_dataset(tmp_path / "shapes", classes=None if damage == "no names" else CLASSES)
    manifest = data / "train" / "manifest.json"
    if damage == "not a list":
        m = json.loads(manifest.read_text())
        m["classes"] = "ant,bee,cat"
        manifest.write_text(json.dumps(m))
    elif damage == "no manifest":
        manifest.unlink()
    code, out, err = report_of(make_log(tmp_path / "run.h5", data), capsys)
    assert code == 0, err
    assert classes_lines(out) == []


def test_log_without_data_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = RunLog(tmp_path / "bare.h5", system="mpipipe", config={"model": {"name": "lenet"}}, comm_size=1)
    log.step(1, time=0.1, loss=1.0, samples=6, samples_per_s=60.0)
    log.close()
    code, out, err = report_of(tmp_path / "bare.h5", capsys)
    assert code == 0, err
    assert classes_lines(out) == []


def test_many_classes_are_cut_short() -> None:
    names = [f"c{i}" for i in range(1000)]
    line = report.classes_line(names)
    assert line.startswith("classes: c0, c1, ") and line.endswith(", ... (1000 in all)")
    assert f"c{report.MAX_CLASSES_SHOWN - 1}," in line and f"c{report.MAX_CLASSES_SHOWN}," not in line
