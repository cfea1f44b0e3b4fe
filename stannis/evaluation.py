"""The host's evaluation: accuracy and loss of the model on the public test split."""

from __future__ import annotations

from typing import Any

import torch

from mpipipe.core.mpi import watchdog
from mpipipe.core.run.batches import test_batches


class Evaluation:
    """Evaluates the model every ``every`` steps (0: only at the end) and logs the result."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, data: dict, every: int,
                 log: Any, progress: Any) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.data = data  # the [data] settings: where the test split is, its normalisation
        self.every = every
        self.log = log
        self.progress = progress

    def due(self, step: int, steps: int) -> bool:
        """An evaluation after ``step``, before the last (which always has one)."""
        return bool(self.every) and step % self.every == 0 and step < steps

    def evaluate(self, step: int) -> float:
        """Host: accuracy on the public test split."""
        self.model.eval()
        correct = count = 0
        loss = 0.0
        with torch.no_grad():
            d = self.data
            for x, y in test_batches(f"{d['path']}/public", 1024, mean=d["mean"], std=d["std"]):
                watchdog.beat()
                out = self.model(x)
                loss += float(self.loss_fn(out, y).item()) * len(y)
                correct += int((out.argmax(1) == y).sum())
                count += len(y)
        self.model.train()
        accuracy = correct / max(count, 1)
        self.log.eval(step, accuracy=accuracy, loss=loss / max(count, 1))
        self.progress.evaluation(step, accuracy)
        return accuracy
