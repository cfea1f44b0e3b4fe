"""Per-stage checkpoints: a stage's state (:meth:`mpipipe.core.state.stagestate.StageState.state_dict`)
with where it belongs (stage, balance, data position), written atomically, loaded safely.

The file is ``torch.save`` of plain containers and tensors; its keys ``step``, ``params``
and ``optimizer`` are the state_dict's ``step``, ``module`` and ``optimizer``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "Checkpoint", "stage_path", "save_stage", "load_stage"]

FORMAT = "mpipipe-stage-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or was written for another pipeline."""


@dataclass
class Checkpoint:
    """What one stage's file holds: its state and where it belongs."""

    step: int  # optimizer steps completed
    stage: int
    balance: list[int]
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    sampler: tuple[int, int]  # (epoch, offset) of the data reader; (-1, -1) if none
    eval_count: int = 0

    @property
    def state(self) -> dict[str, Any]:
        """The stage's state in :meth:`StageState.state_dict`'s form (for its ``load_state_dict``)."""
        return {"step": self.step, "module": self.params, "optimizer": self.optimizer}


def stage_path(directory: str | Path, stage: int) -> Path:
    return Path(directory) / f"stage-{stage}.pt"


def save_stage(directory: str | Path, state: dict[str, Any], *, stage: int,
               balance: Sequence[int], sampler: tuple[int, int] = (-1, -1),
               eval_count: int = 0) -> Path:
    """Write this stage's checkpoint atomically (temporary file, then rename).

    Why atomic: a job killed while saving must leave the previous checkpoint intact,
    or resume would read half a file.
    """
    path = stage_path(directory, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "format": FORMAT,
        "step": int(state["step"]),
        "stage": int(stage),
        "balance": [int(b) for b in balance],
        "params": state["module"],
        "optimizer": state["optimizer"],
        "sampler": [int(sampler[0]), int(sampler[1])],
        "eval_count": int(eval_count),
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(blob, tmp)
    os.replace(tmp, path)
    return path


def load_stage(directory: str | Path, stage: int) -> Checkpoint:
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
    return Checkpoint(step=int(blob["step"]), stage=stage, balance=list(blob["balance"]),
                      params=blob["params"], optimizer=blob["optimizer"],
                      sampler=(int(blob["sampler"][0]), int(blob["sampler"][1])),
                      eval_count=int(blob.get("eval_count", 0)))
