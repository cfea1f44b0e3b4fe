"""Shared fixtures: the digits data set, converted once per test session."""

from __future__ import annotations

import subprocess
import sys
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
