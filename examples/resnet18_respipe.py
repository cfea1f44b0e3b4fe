"""A CIFAR-style ResNet-18 with BatchNorm, trained under ResPipe in hot mode, with a stage
killed mid-run: your own model in a pipeline that survives the loss of a rank.

    python -m native.convert synthetic --shape 3,32,32 --count 2048 data/synthetic32
    mpirun --with-ft ulfm -n 4 python examples/resnet18_respipe.py --data data/synthetic32

Four ranks: two pipeline stages and one hot backup each. Stage 1 is killed (a real
SIGKILL) in step 4; its backup, which mirrored every update, carries on with no step
lost. The model is written here, as torchvision writes it (torchvision itself is not
needed); mpipipe traces it into a chain and cuts it between residual blocks only.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import mpipipe


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images: a 3x3 stem, four stages of two BasicBlocks each."""

    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            layers.append(nn.Sequential(BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/synthetic32", help="a 3x32x32 shard data set")
    parser.add_argument("--width", type=int, default=64, help="channels of the stem (ResNet-18: 64)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--log", default="runs/resnet18-respipe.h5")
    args = parser.parse_args()
    config = {
        "run": {"steps": args.steps, "eval_every": 0},
        "data": {"path": args.data, "batch_size": 32},
        "pipeline": {"stages": 2, "chunks": 4},
        "resilience": {"backups": "all", "mode": "hot", "inject": ["kill:stage=1:step=4:micro=2"]},
    }
    result = mpipipe.train(
        config,
        model=lambda: ResNet18(width=args.width),  # built on every rank after run.seed seeds torch
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4),
        scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=args.steps),
        log=args.log, overwrite=True)
    if result.is_writer:
        model = ResNet18(width=args.width)
        model.load_state_dict(result.state_dict)  # your model's own names, BatchNorm included
        print(f"resnet18: {result.metrics['steps']} steps, takeovers {result.metrics['takeovers']}, "
              f"final loss {result.metrics['final_loss']:.3f}; log {result.log}")


if __name__ == "__main__":
    main()
