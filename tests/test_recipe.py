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
    schedule = recipe.Schedule(cfg, steps)
    p = nn.Parameter(torch.zeros(3))
    real_opt = recipe.make_optimizer(cfg, [p])
    real = getattr(torch.optim.lr_scheduler, name)(real_opt, **({**kwargs, "total_steps": steps}
                                                                 if name == "OneCycleLR" else kwargs))
    want = []
    for _ in range(steps):
        want.append({k: real_opt.param_groups[0][k] for k in moved})
        p.grad = torch.zeros(3)
        real_opt.step()
        real.step()
    ours = recipe.make_optimizer(cfg, [nn.Parameter(torch.zeros(3))])
    for s in reversed(range(steps)):  # a replay asks for an earlier step again
        schedule.apply(ours, s)
        assert {k: ours.param_groups[0][k] for k in moved} == want[s], s


def test_any_torch_optimizer_by_name_with_its_keywords():
    params = [nn.Parameter(torch.zeros(2))]
    opt = recipe.make_optimizer(_cfg(optim={"name": "RMSprop", "lr": 0.01,
                                            "kwargs": {"alpha": 0.9, "centered": True}}), params)
    assert isinstance(opt, torch.optim.RMSprop) and opt.defaults["alpha"] == 0.9
    assert opt.defaults["lr"] == 0.01
    sgd = recipe.make_optimizer(_cfg(), params)  # the shortcut: lr, momentum, weight decay
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    assert recipe.make_optimizer(_cfg(), []) is None  # a stage without parameters
    custom = recipe.make_optimizer(_cfg(optim={"name": "torch.optim:Adamax"}), params)
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
        recipe.build_model(cfg, (1, 8, 8))
        recipe.make_optimizer(cfg, [nn.Parameter(torch.zeros(1))])
        recipe.Schedule(cfg, 10)
        recipe.make_loss(cfg)
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
    chain = recipe.build_model(cfg, (1, 8, 8))
    assert [type(m).__name__ for m in chain] == ["Flatten", "Linear", "ReLU", "Linear"]
    assert chain[1].out_features == 6
    with pytest.raises(ConfigError, match="must be a table"):
        load_config(None, ["model.kwargs=3"], PIPELINE_DEFAULTS, PIPELINE_CHOICES)


def test_the_same_seed_builds_the_same_weights_and_the_checksum_sees_a_change():
    cfg = _cfg(model={"factory": "torch.nn:Sequential"})
    cfg["model"]["factory"] = ""
    torch.manual_seed(3)
    a = recipe.build_model(cfg, (1, 8, 8))
    torch.manual_seed(3)
    b = recipe.build_model(cfg, (1, 8, 8))
    assert recipe.checksum(a) == recipe.checksum(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1
    assert recipe.checksum(a) != recipe.checksum(b)


def test_a_scripts_scheduler_sets_the_rate_as_the_configurations_would():
    # Stannis keeps its own scaled rate unless a scheduler, from the config or from a
    # script (mpipipe.train / stannis.train), sets it: both must say so.
    assert not recipe.Schedule(_cfg(), 10).scheduled
    assert recipe.Schedule(_cfg(optim={"scheduler": "StepLR", "scheduler_kwargs": {"step_size": 2}}), 10).scheduled
    recipe.give(scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    try:
        schedule = recipe.Schedule(_cfg(), 10)
    finally:
        recipe.give()
    assert schedule.scheduled and schedule.values(2)[0]["lr"] == pytest.approx(0.025)
