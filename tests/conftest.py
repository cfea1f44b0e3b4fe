"""Shared fixtures: the digits data set, converted once per test session, and its Stannis split."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from mpipipe.tools.launch import ROOT, mpirun_env

# Property tests: no per-example deadline and no too_slow health check (Hypothesis's
# defaults, 200 ms an example and about 1 s for the first draws, are timings: on a loaded
# machine one descheduled example fails the test as "Unreliable test timings"), and the
# same examples on every run (seeded from each test), so that a run's verdict does not
# depend on its luck. Tests that set these themselves keep their own values.
settings.register_profile("mpipipe", deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("mpipipe")


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    """scikit-learn's digits as shards (train/ and test/), made by the real converter."""
    out = tmp_path_factory.mktemp("data") / "digits"
    subprocess.run([sys.executable, "-m", "native.convert", "digits", str(out)], cwd=ROOT,
                   env=mpirun_env(), check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="session")
def stannis_split(digits: Path, tmp_path_factory) -> Path:
    """The digits split by ``stannis prepare`` for a host and 4 CSDs (do not modify it:
    it is shared by the session; copy it to damage it)."""
    out = tmp_path_factory.mktemp("stannis") / "split"
    subprocess.run([sys.executable, "-m", "stannis", "prepare", "--source", str(digits), "--out", str(out),
                    "--csds", "4"], check=True, env=mpirun_env(), cwd=ROOT, timeout=120, capture_output=True)
    return out


@pytest.fixture(scope="session")
def respipe_args(digits: Path) -> Callable[..., list[str]]:
    """respipe_args(log, *settings, steps=20, batch=32) -> the ``python`` arguments of a
    ResPipe run of LeNet on the digits in 3 stages (respipe-digits.toml), checkpointed at
    its last step; a setting ``inject:SPEC`` becomes ``--inject SPEC``, others ``--set``."""

    def args(log: Path, *settings: str, steps: int = 20, batch: int = 32) -> list[str]:
        cmd = ["-m", "mpipipe", "train", "--quiet", "--config", str(ROOT / "jobs/configs/respipe-digits.toml"),
               "--set", f'data.path="{digits}"', "--set", f"run.steps={steps}",
               "--set", "run.eval_every=0", "--set", f"run.checkpoint_every={steps}",
               "--set", f"data.batch_size={batch}", "--log", str(log)]
        for s in settings:
            cmd += ["--inject", s[len("inject:"):]] if s.startswith("inject:") else ["--set", s]
        return cmd

    return args


@pytest.fixture(scope="session")
def assert_csd_dropped(stannis_split: Path) -> Callable[..., None]:
    """assert_csd_dropped(run, rank, steps): CSD ``rank`` of a Stannis run on the split was
    dropped with its records counted as lost, the survivors re-tuned to the same global
    batch, and the others (the last CSD among them) trained every one of ``steps``."""

    def check(run, rank: int, steps: int) -> None:
        dropped = run.events_of("csd_dropped")
        assert [e["rank"] for e in dropped] == [rank]
        split = json.loads((stannis_split / "split.json").read_text())
        assert dropped[0]["detail"]["samples_lost"] == split["records"][f"csd{rank}"]
        after = [e for e in run.events_of("retune") if "dropped" in e["detail"]["reason"]]
        assert after and len(after[0]["detail"]["new"]) == len(after[0]["detail"]["old"]) - 1
        assert sum(after[0]["detail"]["new"]) == sum(after[0]["detail"]["old"])  # survivors take it
        assert len(run.ranks[rank]["step"]) < steps and len(run.ranks[4]["step"]) == steps

    return check
