"""Per-stage checkpoints: parameters, optimizer state and sampler position, loaded safely."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointError", "StageState", "stage_path", "save_stage", "load_stage"]

FORMAT = "mpipipe-stage-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or was written for another pipeline."""


@dataclass
class StageState:
    """What one stage needs to continue exactly where it stopped."""

    step: int  # optimizer steps completed
    stage: int
    balance: list[int]
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    sampler: tuple[int, int]  # (epoch, offset) of the data reader; (-1, -1) if none
    eval_count: int = 0


def stage_path(directory: str | Path, stage: int) -> Path:
    return Path(directory) / f"stage-{stage}.pt"


def save_stage(directory: str | Path, *, step: int, stage: int, balance: Sequence[int],
               module: nn.Module, optimizer: torch.optim.Optimizer | None,
               sampler: tuple[int, int] = (-1, -1), eval_count: int = 0) -> Path:
    """Write this stage's checkpoint atomically (temporary file, then rename).

    Why atomic: a job killed while saving must leave the previous checkpoint intact,
    or resume would read half a file.
    """
    path = stage_path(directory, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "format": FORMAT,
        "step": int(step),
        "stage": int(stage),
        "balance": [int(b) for b in balance],
        "params": module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else {},
        "sampler": [int(sampler[0]), int(sampler[1])],
        "eval_count": int(eval_count),
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(blob, tmp)
    os.replace(tmp, path)
    return path


def load_stage(directory: str | Path, stage: int) -> StageState:
    """Read one stage's checkpoint with torch.load(weights_only=True): tensors and plain
    containers only, so a crafted file cannot run code.

    Raises:
        CheckpointError: the file is missing, unreadable, or not a stage checkpoint.
    """
    path = stage_path(directory, stage)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint for stage {stage}: {path} does not exist")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mpipipe stage checkpoint")
    if blob["stage"] != stage:
        raise CheckpointError(f"{path} holds stage {blob['stage']}, expected stage {stage}")
    return StageState(step=int(blob["step"]), stage=stage, balance=list(blob["balance"]),
                      params=blob["params"], optimizer=blob["optimizer"],
                      sampler=(int(blob["sampler"][0]), int(blob["sampler"][1])),
                      eval_count=int(blob.get("eval_count", 0)))
