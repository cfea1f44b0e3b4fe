"""Helpers of the tests that run ResPipe jobs under mpirun and hold them to a failure-free
run (tests/test_chaos_found.py, tests/test_augment_mpi.py): one way to run a job, read
its checkpoints and check it completed; and one way to run a small MPI script under
ULFM and read what its ranks printed (tests/test_ft_*.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from mpipipe.core.logs.runlog import open_log
from mpipipe.tools.launch import run_mpi


def make_runs(respipe_args: Callable[..., list[str]], base: Path, steps: int,
              timeout: float = 240) -> Callable[..., tuple[Any, Path, Path]]:
    """run(name, ranks, *settings, ulfm=True) -> (CompletedProcess, log, checkpoint dir),
    each job run once per test module (cached by its arguments)."""

    @cache
    def run(name: str, ranks: int, *settings: str, ulfm: bool = True):
        log = base / f"{name}.h5"
        result = run_mpi(ranks, respipe_args(log, *settings, steps=steps), ulfm=ulfm, timeout=timeout)
        return result, log, base / f"{name}-ckpt"

    return run


def checkpoint_tensors(ckpt: Path) -> list[torch.Tensor]:
    """Every stage's checkpointed state, stage by stage, in order."""
    files = sorted(ckpt.glob("stage-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return [t for p in files for t in torch.load(p, weights_only=False)["params"].values()]


def completed_once(result: Any, log: Path, steps: int) -> Any:
    """The job exited 0 without a traceback, its log is completed with every step's row
    once and a finite loss in each; returns the log."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert [int(s) for s in run.steps["step"]] == list(range(1, steps + 1))
    assert all(math.isfinite(float(x)) for x in run.steps["loss"]), run.steps["loss"]
    return run


def ulfm_script_lines(folder: Path, script: str, ranks: int,
                      timeout: float = 120) -> tuple[set[str], str]:
    """Run ``script`` (Python source) on ``ranks`` ranks under ``mpirun --with-ft ulfm``:
    (the lines its ranks printed, what to show when an assertion on them fails)."""
    path = folder / "script.py"
    path.write_text(script)
    result = run_mpi(ranks, [str(path)], ulfm=True, timeout=timeout)
    return set(result.stdout.splitlines()), result.stdout + result.stderr[-3000:]
