"""Shared fixtures: the digits data set, converted once per test session."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mpipipe.launch import ROOT, mpirun_env


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    """scikit-learn's digits as shards (train/ and test/), made by the real converter."""
    out = tmp_path_factory.mktemp("data") / "digits"
    subprocess.run([sys.executable, "-m", "native.convert", "digits", str(out)], cwd=ROOT,
                   env=mpirun_env(), check=True, capture_output=True, timeout=120)
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
