"""`chaos` takes the user's configuration as `train` does (issue 37, item 2).

Why: a user who trains with ``--set data.path=mine`` from their own folder must be able
to test the same job with ``chaos``. Its runs start in the caller's directory, as
``train`` does when the user starts it there, so a relative path resolves alike; and a
failure-free run that fails (the job itself does not run) is one line naming its first
error and the file that holds the rest, never a traceback. The failing runs here fail
at start-up (a data set that is not there), so they cost seconds.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from mpipipe.__main__ import build_parser
from mpipipe.tools import campaign
from mpipipe.tools.campaign import Job
from mpipipe.tools.launch import ROOT, mpirun_env

RESPIPE = str(ROOT / "jobs" / "configs" / "respipe-digits.toml")
STANNIS = str(ROOT / "jobs" / "configs" / "stannis-digits.toml")


def test_a_runs_first_error_line_names_it(tmp_path: Path) -> None:
    log = tmp_path / "ref.h5"
    stderr = ("noise from mpirun\nmpipipe train: error: data set x does not exist\n"
              "mpipipe train: error: data set x does not exist\nprterun: 2 ranks exited\n")
    e = campaign.reference_failed(Job(2, 1.0, "", stderr, log))
    assert str(e) == (f"the failure-free reference run failed (exit 2): data set x does not exist; "
                      f"the rest is in {tmp_path / 'ref.err'}")
    trace = "Traceback (most recent call last):\n  File \"x\", line 1\nKeyError: 'lr'\n"
    assert ": KeyError: 'lr'; the rest" in str(campaign.reference_failed(Job(1, 1.0, "", trace, log)))
    assert "(exit 9): it printed nothing on stderr;" in str(campaign.reference_failed(Job(9, 1.0, "", "", log)))
    timed_out = str(campaign.reference_failed(Job(None, 1.0, "", "", log), "the failure-free run"))
    assert timed_out == (f"the failure-free run did not end within its time limit; its output is in "
                         f"{tmp_path / 'ref.err'}")


@pytest.mark.timeout(120)
def test_runs_start_in_the_callers_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    job = campaign.run_job(1, ["-c", "import os; print(os.getcwd())"], log=Path("job.h5"), timeout=90,
                        ulfm=False)
    assert job.rc == 0, job.stderr
    assert job.stdout.strip() == str(tmp_path)
    assert (tmp_path / "job.out").read_text() == job.stdout  # beside the relative log, here


@pytest.mark.timeout(300)
def test_a_relative_data_path_from_another_directory_makes_the_reference(
        digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpipipe.respipe.chaos import _Campaign

    (tmp_path / "mine").symlink_to(digits, target_is_directory=True)
    monkeypatch.chdir(tmp_path)  # not the project's root: "mine" is only here
    args = build_parser().parse_args(["chaos", "--config", RESPIPE, "--set", 'data.path="mine"',
                                      "--stages", "2", "--steps", "10", "--modes", "neighbour"])
    camp = _Campaign(args)
    sc = camp.draw(random.Random("0:0"), 0)
    Path("out").mkdir()
    job, ref = camp.reference(sc, Path("out"))  # a relative --out too
    assert job.rc == 0, job.stderr[-2000:]
    assert len(ref.losses) == 10 and ref.state


def _chaos(system: str, config: str, cwd: Path, *sets: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", system, "chaos", "--config", config, "--runs", "1",
            "--steps", "10", "--out", str(cwd / "out"), *(a for s in sets for a in ("--set", s))]
    return subprocess.run(argv, cwd=cwd, env=mpirun_env(), capture_output=True, text=True,
                          timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("system,config,sets,what,first", [
    ("mpipipe", RESPIPE, ["pipeline.stages=2"], "the failure-free reference run", "data set nowhere"),
    ("stannis", STANNIS, ["stannis.csds=1"], "the failure-free run", "data directory nowhere/"),
])
def test_a_failing_failure_free_run_is_one_line_naming_its_error_and_file(
        tmp_path: Path, system: str, config: str, sets: list[str], what: str, first: str) -> None:
    done = _chaos(system, config, tmp_path, 'data.path="nowhere"', *sets)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    head = f"{system} chaos: error: {what} failed (exit 2): "
    assert lines[0].startswith(head) and first in lines[0], lines[0]
    err = Path(lines[0].rpartition("; the rest is in ")[2])
    assert err.suffix == ".err" and first in err.read_text()
