"""The user's recipe (mpipipe/core/run/recipe.py): names resolve, bad ones are one line with
the nearest known ones, and a precomputed schedule is the torch scheduler's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpipipe.core.run import recipe
from mpipipe.core.run.configfile import ConfigError, load_config
from mpipipe.core.run.recipe import MODEL_DEFAULTS, OPTIM_DEFAULTS, RecipeError
from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS


def _holding(*params: nn.Parameter) -> nn.Module:
    """A module holding ``params`` (a stage, as make_optimizer is given one)."""
    module = nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    return module


def _cfg(**sections) -> dict:
    cfg = {"model": dict(MODEL_DEFAULTS), "optim": dict(OPTIM_DEFAULTS)}
    for name, values in sections.items():
        cfg[name].update(values)
    return cfg


@pytest.mark.parametrize("name,kwargs,moved", [
    ("OneCycleLR", {"max_lr": 0.1}, ("lr", "betas")),
    ("CosineAnnealingLR", {"T_max": 7}, ("lr",)),
    ("StepLR", {"step_size": 3, "gamma": 0.5}, ("lr",)),
])
def test_the_precomputed_schedule_is_the_torch_schedulers_own(name, kwargs, moved):
    # The values set before step s are those a real scheduler, stepped once per step,
    # leaves in the optimizer: for every step, whichever order they are asked in.
    steps = 12
    cfg = _cfg(optim={"name": "AdamW", "scheduler": name, "scheduler_kwargs": kwargs})
    schedule = recipe.Recipe(cfg).schedule(steps)
    p = nn.Parameter(torch.zeros(3))
    real_opt = recipe.Recipe(cfg).make_optimizer(_holding(p))
    real = getattr(torch.optim.lr_scheduler, name)(real_opt, **({**kwargs, "total_steps": steps}
                                                                 if name == "OneCycleLR" else kwargs))
    want = []
    for _ in range(steps):
        want.append({k: real_opt.param_groups[0][k] for k in moved})
        p.grad = torch.zeros(3)
        real_opt.step()
        real.step()
    ours = recipe.Recipe(cfg).make_optimizer(_holding(nn.Parameter(torch.zeros(3))))
    for s in reversed(range(steps)):  # a replay asks for an earlier step again
        schedule.apply(ours, s)
        assert {k: ours.param_groups[0][k] for k in moved} == want[s], s


def test_any_torch_optimizer_by_name_with_its_keywords():
    params = _holding(nn.Parameter(torch.zeros(2)))
    opt = recipe.Recipe(_cfg(optim={"name": "RMSprop", "lr": 0.01,
                                    "kwargs": {"alpha": 0.9, "centered": True}})).make_optimizer(params)
    assert isinstance(opt, torch.optim.RMSprop) and opt.defaults["alpha"] == 0.9
    assert opt.defaults["lr"] == 0.01
    sgd = recipe.Recipe(_cfg()).make_optimizer(params)  # the shortcut: lr, momentum, weight decay
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    assert recipe.Recipe(_cfg()).make_optimizer(nn.ReLU()) is None  # a stage without parameters
    custom = recipe.Recipe(_cfg(optim={"name": "torch.optim:Adamax"})).make_optimizer(params)
    assert isinstance(custom, torch.optim.Adamax)


@pytest.mark.parametrize("sections,message", [
    ({"optim": {"name": "Adamw"}}, r"optim.name = 'Adamw': not a torch.optim optimizer; did you mean 'AdamW'"),
    ({"optim": {"name": "sgd", "kwargs": {"nesterov": True}}}, r"optim.kwargs .* only with a class name"),
    ({"optim": {"name": "AdamW", "kwargs": {"momentum": 0.9}}}, r"optimizer AdamW: got an unexpected keyword"),
    ({"optim": {"scheduler": "OneCycle"}}, r"not a torch.optim.lr_scheduler class; did you mean 'OneCycleLR'"),
    ({"optim": {"scheduler": "ReduceLROnPlateau"}}, r"needs a metric"),
    ({"optim": {"scheduler": "StepLR", "scheduler_kwargs": {"step_size": 2}, "schedule": "cosine"}},
     r"both set the rate: choose one"),
    ({"optim": {"scheduler_kwargs": {"max_lr": 1}}}, r"takes effect only with optim.scheduler"),
    ({"optim": {"scheduler": "StepLR"}}, r"scheduler StepLR: .*step_size"),
    ({"model": {"loss": "crossentropy"}}, r"did you mean 'cross_entropy'"),
    ({"model": {"loss_kwargs": {"smoothing": 0.1}}}, r"loss cross_entropy: got an unexpected keyword"),
    ({"model": {"kwargs": {"width": 3}}}, r"model.kwargs = .* only with model.factory"),
    ({"model": {"factory": "nope.py:net"}}, r"model.factory = 'nope.py:net': no file nope.py"),
    ({"model": {"factory": "torch.nn:Linearr"}}, r"torch.nn has no 'Linearr'; did you mean 'Linear'"),
    ({"model": {"factory": "no_such_package_xyz:net"}}, r"cannot import no_such_package_xyz"),
    ({"model": {"factory": "torch:float32"}}, r"is a dtype, not a function"),
    ({"model": {"factory": "torch.nn.init:calculate_gain"}}, r"model.factory .*: missing a required argument"),
])
def test_a_bad_recipe_is_one_line_naming_the_key(sections, message):
    cfg = _cfg(**sections)
    with pytest.raises(RecipeError, match=message) as e:
        made = recipe.Recipe(cfg)
        made.build_model((1, 8, 8))
        made.make_optimizer(_holding(nn.Parameter(torch.zeros(1))))
        made.schedule(10)
        made.make_loss()
    assert "\n" not in str(e.value)


def test_a_factory_file_resolves_beside_the_config_file_first(tmp_path, monkeypatch):
    (tmp_path / "nets.py").write_text("from torch import nn\n\ndef net(width=4):\n"
                                      "    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(),\n"
                                      "                         nn.Linear(width, 10))\n")
    config = tmp_path / "job.toml"
    config.write_text('[model]\nfactory = "nets.py:net"\nkwargs = {width = 6}\n')
    monkeypatch.chdir("/")  # not the current directory: the config file's folder
    cfg = load_config(config, [], PIPELINE_DEFAULTS, PIPELINE_CHOICES)
    assert cfg["model"]["factory"] == f"{tmp_path / 'nets.py'}:net"
    chain = recipe.Recipe(cfg).build_model((1, 8, 8))
    assert [type(m).__name__ for m in chain] == ["Flatten", "Linear", "ReLU", "Linear"]
    assert chain[1].out_features == 6
    with pytest.raises(ConfigError, match="must be a table"):
        load_config(None, ["model.kwargs=3"], PIPELINE_DEFAULTS, PIPELINE_CHOICES)


def test_the_same_seed_builds_the_same_weights_and_the_checksum_sees_a_change():
    cfg = _cfg(model={"factory": "torch.nn:Sequential"})
    cfg["model"]["factory"] = ""
    torch.manual_seed(3)
    a = recipe.Recipe(cfg).build_model((1, 8, 8))
    torch.manual_seed(3)
    b = recipe.Recipe(cfg).build_model((1, 8, 8))
    assert recipe.checksum(a) == recipe.checksum(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1
    assert recipe.checksum(a) != recipe.checksum(b)


def test_a_scripts_scheduler_sets_the_rate_as_the_configurations_would():
    # Stannis keeps its own scaled rate unless a scheduler, from the config or from a
    # script (mpipipe.train / stannis.train), sets it: both must say so.
    assert not recipe.Recipe(_cfg()).schedule(10).scheduled
    step = {"scheduler": "StepLR", "scheduler_kwargs": {"step_size": 2}}
    assert recipe.Recipe(_cfg(optim=step)).schedule(10).scheduled
    step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    schedule = recipe.Recipe(_cfg(), scheduler=step_lr).schedule(10)
    assert schedule.scheduled and schedule.values(2)[0]["lr"] == pytest.approx(0.025)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return x + self.bn(self.conv(x)).mean(1, keepdim=True)  # a residual: traced whole


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 1, 3, padding=1)
        self.block = _Block()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_a_given_optimizer_gets_each_stage_in_your_names_for_param_groups_by_name():
    # The common recipe: no weight decay on norms and biases, by name and by class.
    def no_decay_on_norms_and_biases(m: nn.Module) -> torch.optim.Optimizer:
        norms = {id(p) for mod in m.modules() if isinstance(mod, nn.BatchNorm2d) for p in mod.parameters()}
        decay = [p for n, p in m.named_parameters() if not n.endswith("bias") and id(p) not in norms]
        rest = [p for n, p in m.named_parameters() if n.endswith("bias") or id(p) in norms]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0}], lr=1e-3)

    seen: list[list[str]] = []

    def spy(m: nn.Module) -> torch.optim.Optimizer:
        seen.append([n for n, _ in m.named_parameters()])
        return no_decay_on_norms_and_biases(m)

    made = recipe.Recipe(_cfg(), model=_Net(), optimizer=spy)
    chain = made.build_model((1, 8, 8))
    from mpipipe.pipeline.partition import split

    stages = split(chain, [1, 1, len(chain) - 2])
    opts = [made.make_optimizer(stage) for stage in stages]
    theirs = [n for n, _ in _Net().named_parameters()]
    assert sorted(n for names in seen for n in names) == sorted(theirs)  # every one, in the user's names
    assert "block.bn.weight" in seen[1] and "head.1.weight" in [n for names in seen for n in names]
    block = opts[1]
    assert [len(g["params"]) for g in block.param_groups] == [1, 3]  # conv.weight | conv.bias, bn.weight, bn.bias
    # the view holds the stage's own tensors: the optimizer trains the stage
    assert {id(p) for g in block.param_groups for p in g["params"]} == {id(p) for p in stages[1].parameters()}


def test_an_optimizer_written_for_a_parameter_list_is_told_the_fix_in_one_line():
    made = recipe.Recipe(_cfg(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(RecipeError, match=r"called with the stage's module .*m\.parameters\(\)") as e:
        made.make_optimizer(_holding(nn.Parameter(torch.zeros(2))))
    assert "\n" not in str(e.value)


def test_two_recipes_share_nothing():
    a = recipe.Recipe(_cfg(), model=_Net())
    b = recipe.Recipe(_cfg())  # the shipped LeNet
    chain_a = a.build_model((1, 8, 8))
    b.build_model((1, 8, 8))
    assert a.names and not b.names and a.model_name() == "your model" and b.model_name() == "lenet"
    assert set(a.names) == set(chain_a.state_dict())


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 1, 3, padding=1)
        self.b = nn.Conv2d(1, 1, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(1))  # its own tensor beside children

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(1))  # a top-level tensor of the model
        self.block = _Scaled()
        self.emb = nn.Linear(64, 64, bias=False)
        self.head = nn.Linear(64, 64, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        return self.out(self.head(self.emb((self.block(x) + self.cls).flatten(1))))


def test_every_tensor_of_every_cut_is_in_the_view_and_tied_weights_keep_both_names():
    # Review of issue 34: a module with its own tensor and children, cut inside, lost its
    # children from the view (the optimizer never updated them); a tied weight lost one
    # of its names in the state given back.
    from mpipipe.pipeline.partition import split

    seen: list[list[str]] = []

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        seen.append([n for n, _ in m.named_parameters()])
        return torch.optim.SGD(m.parameters(), lr=0.1)

    made = recipe.Recipe(_cfg(), model=_Tied(), optimizer=sgd)
    chain = made.build_model((1, 8, 8))
    assert set(made.names.values()) == set(_Tied().state_dict())  # emb.weight and head.weight
    made.make_optimizer(chain)
    assert sorted(seen[-1]) == sorted(n for n, _ in _Tied().named_parameters())  # the user's names
    for cut in range(1, len(chain)):
        for stage in split(chain, [cut, len(chain) - cut]):
            opt = made.make_optimizer(stage)
            held = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else set()
            assert held == {id(p) for p in stage.parameters()}, (cut, seen[-1])


def test_a_scheduler_moves_only_what_it_moves_in_every_group():
    # Each group keeps its own momentum under StepLR (which moves the rate only); under
    # OneCycleLR, which cycles momentum, every group follows it.
    def two_groups(m: nn.Module) -> torch.optim.Optimizer:
        first, second = list(m.parameters())[:1], list(m.parameters())[1:]
        return torch.optim.SGD([{"params": first, "momentum": 0.9},
                                {"params": second, "momentum": 0.5}], lr=0.1)

    step = recipe.Recipe(_cfg(optim={"scheduler": "StepLR", "scheduler_kwargs": {"step_size": 2}}),
                         optimizer=two_groups)
    opt = step.make_optimizer(nn.Linear(2, 2))
    schedule = step.schedule(6)
    schedule.apply(opt, 3)
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.5]
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.1 * 0.1)] * 2
    cycle = recipe.Recipe(_cfg(optim={"scheduler": "OneCycleLR", "scheduler_kwargs": {"max_lr": 0.2}}),
                          optimizer=two_groups)
    opt = cycle.make_optimizer(nn.Linear(2, 2))
    cycle.schedule(6).apply(opt, 0)
    assert opt.param_groups[0]["momentum"] == opt.param_groups[1]["momentum"] != 0.5
