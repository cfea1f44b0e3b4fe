"""mpipipe.core.run.chain: any chain-shaped model as a flat nn.Sequential, bit for bit the model.

Every comparison is exact (torch.equal), never a tolerance: a chain runs the model's own
operations in the model's order on the model's own parameters, so nothing may differ.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from mpipipe.core.run.chain import ChainError, describe, sequential
from mpipipe.pipeline.partition import balance_by_params, check_balance, split

# --- a torchvision-style ResNet-18, written here (torchvision is not installed) ---------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        cin = width
        for i, cout in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)))
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet18() -> ResNet18:
    """Seeded, with BN running statistics and affine parameters off their defaults, so that a
    layer run out of order or in the wrong mode changes the output."""
    torch.manual_seed(0)
    model = ResNet18()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.uniform_(module.bias, -0.2, 0.2)
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return model


def images(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def piece_of(chain: nn.Sequential) -> dict[int, int]:
    """The index of the layer of `chain` holding each module (by identity)."""
    return {id(m): i for i, layer in enumerate(chain) for m in layer.modules()}


# --- ResNet-18 --------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_resnet_chain_equals_model_in_eval() -> None:
    model = resnet18().eval()
    chain = sequential(model, example_input=images(2))
    with torch.no_grad():
        assert torch.equal(chain(images()), model(images()))


@pytest.mark.timeout(120)
def test_resnet_pieces_fine_and_blocks_whole() -> None:
    model = resnet18()
    chain = sequential(model)
    assert len(chain) > 8
    owner = piece_of(chain)
    blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    for name in blocks:
        block = model.get_submodule(name)
        leaves = [m for m in block.modules() if not list(m.children())]
        assert {owner[id(m)] for m in leaves} == {owner[id(leaves[0])]}, f"{name} is split"
    # blocks are not merged with each other either: one piece per block, in order
    assert len({owner[id(model.get_submodule(b).conv1)] for b in blocks}) == len(blocks)
    assert [owner[id(model.get_submodule(b).conv1)] for b in blocks] == sorted(
        owner[id(model.get_submodule(b).conv1)] for b in blocks)


@pytest.mark.timeout(120)
def test_resnet_shares_parameters_and_buffers() -> None:
    model = resnet18()
    chain = sequential(model)
    ours = {id(t) for t in chain.state_dict(keep_vars=True).values()}
    theirs = {id(t) for t in model.state_dict(keep_vars=True).values()}
    assert ours == theirs
    # every key of the chain is "<layer>." + the model's key
    model_keys = set(model.state_dict())
    assert {k.split(".", 1)[1] for k in chain.state_dict()} == model_keys
    assert len(chain.state_dict()) == len(model_keys)


@pytest.mark.timeout(180)
def test_resnet_train_mode_outputs_and_running_stats() -> None:
    reference = resnet18().train()
    model = copy.deepcopy(reference)
    chain = sequential(model)
    assert chain.training and all(layer.training for layer in chain)
    for step in range(2):
        x = images() + step
        assert torch.equal(chain(x), reference(x))
    for name, module in reference.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            mine = model.get_submodule(name)
            assert torch.equal(mine.running_mean, module.running_mean), name
            assert torch.equal(mine.running_var, module.running_var), name
            assert torch.equal(mine.num_batches_tracked, module.num_batches_tracked), name


@pytest.mark.timeout(180)
def test_resnet_gradients_equal() -> None:
    reference = resnet18().train()
    model = copy.deepcopy(reference)
    chain = sequential(model)
    target = torch.arange(4) % 10
    nn.functional.cross_entropy(reference(images()), target).backward()
    nn.functional.cross_entropy(chain(images()), target).backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.equal(param.grad, grads[name].grad), name


@pytest.mark.timeout(120)
def test_resnet_chain_works_with_partition() -> None:
    model = resnet18().eval()
    chain = sequential(model)
    balance = balance_by_params(chain, 2, 1, 4)
    assert check_balance(chain, balance) == balance and len(balance) == 2
    balance4 = balance_by_params(chain, 2, 2, 4)  # interleaved: 2 chunks per rank
    assert check_balance(chain, balance4) == balance4 and len(balance4) == 4
    stages = split(chain, balance)
    x = images()
    with torch.no_grad():
        y = x
        for stage in stages:
            y = stage(y)
        assert torch.equal(y, model(x))


@pytest.mark.timeout(120)
def test_every_layer_can_open_a_stage() -> None:
    """A stage's input is a received leaf that requires grad (engine.py): no layer may start
    by writing into it in place (the model's ReLUs are inplace=True)."""
    model = resnet18().train()
    chain = sequential(model)
    x = images(2)
    for layer in chain:
        inp = x.detach().requires_grad_()
        out = layer(inp)
        out.sum().backward()
        assert inp.grad is not None
        x = out
    stem_relu = next(i for i, layer in enumerate(chain) if any(m is model.relu for m in layer.modules()))
    assert any(m is model.bn1 for m in chain[stem_relu].modules())  # bn1 and the in-place relu: one layer


@pytest.mark.timeout(120)
def test_describe_one_line_per_layer() -> None:
    chain = sequential(resnet18())
    lines = describe(chain)
    assert len(lines) == len(chain)
    assert all("\n" not in line and len(line) < 120 for line in lines)
    text = "\n".join(lines)
    for name in ["conv1", "maxpool", "layer1.0", "layer2.0", "layer4.1", "flatten", "fc"]:
        assert any(line.split(" ")[1] == name for line in lines), (name, text)
    fc_line = next(line for line in lines if line.split(" ")[1] == "fc")
    assert "5,130 params" in fc_line


def test_describe_plain_sequential() -> None:
    lines = describe(sequential(nn.Sequential(nn.Linear(3, 4), nn.ReLU())))
    assert lines == ["0: Linear (in_features=3, out_features=4, bias=True, 16 params)", "1: ReLU (0 params)"]


# --- nn.Sequential ----------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


def test_nested_sequential_flattens_to_same_modules() -> None:
    leaves = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), Residual(4), nn.Tanh(), nn.Linear(4, 2)]
    model = nn.Sequential(leaves[0], nn.Sequential(leaves[1], nn.Sequential(leaves[2], leaves[3]), nn.Sequential()),
                          leaves[4], nn.Sequential(leaves[5]))
    chain = sequential(model, example_input=torch.randn(3, 4))
    assert len(chain) == 6
    assert all(a is b for a, b in zip(chain, leaves, strict=True))
    x = torch.randn(5, 4)
    assert torch.equal(chain(x), model(x))
    mine = list(chain.state_dict(keep_vars=True).values())
    assert {id(t) for t in mine} == {id(t) for t in model.state_dict(keep_vars=True).values()}


def test_sequential_with_own_forward_is_traced() -> None:
    class Doubling(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = Doubling(nn.Linear(4, 4), nn.ReLU())
    chain = sequential(model, example_input=torch.randn(2, 4))
    x = torch.randn(3, 4)
    assert torch.equal(chain(x), model(x))


def test_empty_sequential_is_an_error() -> None:
    with pytest.raises(ChainError, match="no layers"):
        sequential(nn.Sequential(nn.Sequential()))


# --- random layers, shared weights, arguments with defaults -------------------------------------


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def test_dropout_same_seed_same_output() -> None:
    torch.manual_seed(3)
    model = WithDropout().train()
    chain = sequential(model, example_input=torch.randn(2, 8))
    assert len(chain) == 4
    x = torch.randn(16, 8)
    torch.manual_seed(7)
    expected = model(x)
    torch.manual_seed(7)
    got = chain(x)
    assert torch.equal(got, expected)
    torch.manual_seed(8)
    assert not torch.equal(chain(x), expected)  # dropout did act: another seed, other output
    chain.eval()
    assert not model.drop.training
    assert torch.equal(chain(x), model(x))


def test_example_check_keeps_training_flags() -> None:
    model = WithDropout().train()
    model.drop.eval()
    sequential(model, example_input=torch.randn(2, 8))
    assert model.training and model.a.training and not model.drop.training


class Tied(nn.Module):
    """One weight used at both ends: no cut may separate them (each stage would get a copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.enc(x))
        x = self.mid(x * self.scale)
        x = torch.relu(x)
        return nn.functional.linear(x, self.enc.weight) * self.scale


def test_shared_parameter_stays_in_one_piece() -> None:
    model = Tied()
    chain = sequential(model, example_input=torch.randn(2, 6))
    x = torch.randn(3, 6)
    assert torch.equal(chain(x), model(x))
    holders = [i for i, layer in enumerate(chain) for p in layer.parameters() if p is model.enc.weight]
    assert len(holders) == 1


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, features: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            x = x * mask
        h = torch.relu(self.a(x))
        return h if features else self.b(h)


def test_arguments_with_defaults_are_traced_at_their_default() -> None:
    model = Flagged()
    chain = sequential(model, example_input=torch.randn(2, 4))
    x = torch.randn(3, 4)
    assert torch.equal(chain(x), model(x))
    assert len(chain) == 3


class Stats(nn.Module):
    """A non-tensor value in the middle (a size): never a cut point."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        n = y.size(0)
        return y.view(n, 2, 3).sum(1)


def test_no_cut_at_a_non_tensor_value() -> None:
    model = Stats()
    chain = sequential(model)
    x = torch.randn(5, 4)
    assert torch.equal(chain(x), model(x))
    assert len(chain) == 3  # a | size+view | sum


class Recurrent(nn.Module):
    """An LSTM (a tuple-valued call, unpacked) and a constant tensor made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) + torch.tensor([0.5, -1.0, 2.0])
        out, _ = self.lstm(y)
        return self.fc(out[:, -1])


def test_tuple_values_and_constants() -> None:
    torch.manual_seed(0)
    model = Recurrent()
    keys = set(model.state_dict())
    chain = sequential(model, example_input=torch.randn(2, 4, 3))
    x = torch.randn(3, 4, 3)
    assert torch.equal(chain(x), model(x))
    assert len(chain) == 4  # a | add | lstm, unpack, index | fc
    assert not any(k.startswith("_tensor_constant") for k in model.__dict__)  # the model is left as it was
    assert {k.split(".", 1)[1] for k in chain.state_dict()} == keys
    assert describe(chain)[1].startswith("1: add ")


@pytest.mark.timeout(120)
def test_chain_copies_and_pickles() -> None:
    model = resnet18().eval()
    chain = sequential(model)
    with torch.no_grad():
        expected = model(images())
        for other in (copy.deepcopy(chain), pickle.loads(pickle.dumps(chain))):
            assert torch.equal(other(images()), expected)


def test_training_flags_follow_the_model() -> None:
    model = resnet18().eval()
    chain = sequential(model)
    assert not any(m.training for m in chain.modules())
    model = resnet18().train()
    model.layer1[0].bn1.eval()  # a frozen BatchNorm stays frozen
    chain = sequential(model)
    assert not model.layer1[0].bn1.training
    assert all(m.training for m in chain.modules() if m is not model.layer1[0].bn1)


# --- errors -----------------------------------------------------------------------------------


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return x


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + y


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.a(x)
        return y, x


class TrainingBranch(nn.Module):
    """Python branching on self.training is frozen when traced: the example check catches it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y * 2 if self.training else y


def test_data_dependent_control_flow_is_one_line_error() -> None:
    with pytest.raises(ChainError) as info:
        sequential(DataDependent())
    message = str(info.value)
    assert "\n" not in message
    assert "DataDependent" in message and "control flow" in message and "leaf module" in message
    assert isinstance(info.value, ValueError)


def test_two_inputs_is_an_error() -> None:
    with pytest.raises(ChainError, match=r"TwoInputs\.forward takes 2 inputs \(x, y\)") as info:
        sequential(TwoInputs())
    assert "\n" not in str(info.value)


def test_tuple_output_is_an_error() -> None:
    with pytest.raises(ChainError, match=r"TupleOut\.forward returns a tuple") as info:
        sequential(TupleOut())
    assert "\n" not in str(info.value)


def test_example_mismatch_is_an_error() -> None:
    model = TrainingBranch().train()
    sequential(model)  # without an example nothing can tell
    with pytest.raises(ChainError, match="differs from the model on example_input") as info:
        sequential(model, example_input=torch.randn(2, 4))
    assert "\n" not in str(info.value)
    assert model.training  # the check put the model back in its mode


@pytest.mark.timeout(180)
def test_import_mpipipe_stays_light_and_exports_sequential() -> None:
    code = ("import sys, mpipipe; assert 'torch' not in sys.modules; "
            "import torch; from torch import nn; "
            "c = mpipipe.sequential(nn.Sequential(nn.Sequential(nn.ReLU()), nn.Tanh())); "
            "assert len(c) == 2, c")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
