"""Your own CNN (BatchNorm and Dropout) with AdamW and OneCycleLR, trained by Stannis on a
host and two storage devices whose data never leaves them.

    python -m stannis prepare --source data/digits --out data/stannis-digits --csds 2
    mpirun -n 3 python examples/own_model_stannis.py --data data/stannis-digits

HyperTune sizes each rank's batch so that all finish each step together; BatchNorm's
running statistics are averaged every step with the gradients' batch weights (set
stannis.local_buffers = true to keep them per device, as FedBN does). The CSDs' speed
is emulated on this machine (docs/stannis.md).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import stannis


def own_cnn(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 4 * 4, num_classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/stannis-digits", help="made by python -m stannis prepare")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log", default="runs/own-model-stannis.h5")
    args = parser.parse_args()
    from mpi4py import MPI

    config = {"run": {"steps": args.steps, "eval_every": 0}, "data": {"path": args.data},
              "stannis": {"csds": MPI.COMM_WORLD.Get_size() - 1, "global_batch": 128}}
    result = stannis.train(
        config, model=own_cnn,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.003, weight_decay=0.01),
        scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=args.steps),
        loss=nn.CrossEntropyLoss(label_smoothing=0.05), log=args.log, overwrite=True)
    if result.is_writer:
        print(f"own model under Stannis: accuracy {result.metrics['accuracy']:.3f} after "
              f"{result.metrics['steps']} steps; final batches {result.metrics['final_batches']}")


if __name__ == "__main__":
    main()
