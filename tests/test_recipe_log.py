"""The log records the recipe that ran (issue 37, item 1).

A script's objects (``mpipipe.train(model=..., optimizer=..., scheduler=..., loss=...)``)
replace configuration keys. The log's ``config`` must then not name the defaults that
never ran (``model.name = "lenet"``, ``optim.name = "sgd"``, ``lr = 0.05``), and its
``recipe`` attribute names what did: read from the objects themselves
(:func:`mpipipe.core.run.recipe.describe`, schema :data:`mpipipe.core.logs.logschema.RECIPE`).

The unit tests need no MPI; three short runs (a script with its own objects, a TOML
factory, Stannis with the shipped LeNet) check the writers and ``mpipipe report``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mpipipe.core.logs.logschema import RECIPE, SchemaError, check_recipe
from mpipipe.core.logs.runlog import RunLog, open_log
from mpipipe.core.run import recipe
from mpipipe.core.run.recipe import MODEL_DEFAULTS, OPTIM_DEFAULTS
from mpipipe.report import load_run, recipe_lines, summarize
from mpipipe.tools.launch import ROOT, mpirun_env, run_mpi
from tests.models.own import own_net

SHAPE = (1, 8, 8)


def _cfg(**sections: dict) -> dict:
    cfg = {"model": dict(MODEL_DEFAULTS), "optim": dict(OPTIM_DEFAULTS)}
    for name, values in sections.items():
        cfg[name].update(values)
    return cfg


@pytest.fixture
def given() -> dict:
    """A script's objects, as mpipipe.train gives them: the user's builder, AdamW,
    OneCycleLR and a loss module."""
    return {"model": own_net, "optimizer": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01),
            "scheduler": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=12),
            "loss": nn.CrossEntropyLoss(label_smoothing=0.1)}


def _describe(cfg: dict, seed: int = 0, **given) -> dict:
    torch.manual_seed(seed)
    made = recipe.Recipe(cfg, **given)
    chain = made.build_model(SHAPE)
    return made.describe(chain, made.schedule(12), made.make_loss())


# ---------------------------------------------------------------- without MPI

def test_a_scripts_objects_are_recorded_and_the_keys_they_replaced_are_not(given):
    cfg = _cfg()
    record = _describe(cfg, **given)
    assert record["model"] == {"source": "builder", "class": "OwnNet", "module": "tests.models.own",
                               "parameters": sum(p.numel() for p in own_net().parameters()),
                               "digest": record["model"]["digest"]}
    torch.manual_seed(0)
    assert record["model"]["digest"] == f"crc32:{recipe.checksum(own_net()):08x}"  # the user can check it
    opt = record["optimizer"]
    assert (opt["source"], opt["class"], opt["module"]) == ("object", "AdamW", "torch.optim.adamw")
    assert opt["groups"][0]["lr"] == 3e-3 and opt["groups"][0]["weight_decay"] == 0.01
    assert opt["groups"][0]["betas"] == [0.9, 0.999] and "params" not in opt["groups"][0]
    sched = record["schedule"]
    assert (sched["source"], sched["class"]) == ("object", "OneCycleLR")
    assert sched["arguments"]["total_steps"] == 12 and sched["group"]["max_lr"] == 0.02
    assert "optimizer" not in sched["arguments"] and "last_epoch" not in sched["arguments"]
    assert sched["first_step"]["lr"] == pytest.approx(0.02 / 25)  # OneCycleLR's div_factor
    assert record["loss"] == {"source": "object", "class": "CrossEntropyLoss", "module": "torch.nn.modules.loss",
                              "arguments": {"reduction": "mean", "ignore_index": -100, "label_smoothing": 0.1}}
    json.dumps(record, allow_nan=False)  # plain JSON, nothing a reader must guess
    stored = recipe.Recipe(cfg, **given).stored_config()
    assert stored["model"] == {"num_classes": 10}  # the data checks read it
    assert stored["optim"] == {}
    assert cfg["model"]["name"] == "lenet"  # the run's own configuration is untouched


def test_a_factory_is_recorded_and_model_name_is_not_stored_beside_it():
    cfg = _cfg(model={"factory": f"{ROOT / 'tests/models/own.py'}:own_net", "kwargs": {"width": 4}},
               optim={"name": "AdamW", "kwargs": {"weight_decay": 0.01}, "scheduler": "StepLR",
                      "scheduler_kwargs": {"step_size": 3, "gamma": 0.5}})
    record = _describe(cfg)
    model = record["model"]
    assert (model["source"], model["class"], model["kwargs"]) == ("factory", "OwnNet", {"width": 4})
    assert model["module"] == str(ROOT / "tests/models/own.py")  # loaded from a file: its path
    assert record["optimizer"]["source"] == "config" and record["optimizer"]["class"] == "AdamW"
    assert record["schedule"]["arguments"] == {"step_size": 3, "gamma": 0.5, "base_lrs": [0.05]}
    stored = recipe.Recipe(cfg).stored_config()
    assert "name" not in stored["model"] and stored["model"]["factory"] == cfg["model"]["factory"]
    # A class takes optim.kwargs, not the sgd shortcut's momentum; a scheduler sets the rate.
    assert {"momentum", "weight_decay", "schedule"}.isdisjoint(stored["optim"])
    assert stored["optim"]["name"] == "AdamW" and stored["optim"]["lr"] == 0.05


def test_a_shipped_model_is_recorded_by_name():
    cfg = _cfg()
    record = _describe(cfg)
    assert record["model"]["source"] == "shipped" and record["model"]["name"] == "lenet"
    assert record["optimizer"]["groups"][0]["momentum"] == 0.9
    assert record["schedule"] == {"source": "config", "rule": "constant", "base": "optim.lr", "lr": 0.05}
    stored = recipe.Recipe(cfg).stored_config()
    assert stored["model"]["name"] == "lenet" and "factory" not in stored["model"]
    assert stored["optim"]["name"] == "sgd" and "kwargs" not in stored["optim"]


def test_the_digest_is_of_the_weights_as_built():
    cfg = _cfg()
    assert _describe(cfg, seed=1)["model"]["digest"] == _describe(cfg, seed=1)["model"]["digest"]
    assert _describe(cfg, seed=1)["model"]["digest"] != _describe(cfg, seed=2)["model"]["digest"]


def test_a_given_optimizer_trains_at_its_own_rate_not_optim_lr():
    # optim.lr (0.05 by default) is left out of the log when an optimizer is given, so
    # it must not be what trains: the optimizer's own rate is the base of optim.schedule.
    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.01)

    for rule, want in (("constant", 0.01), ("cosine", 0.005)):
        made = recipe.Recipe(_cfg(optim={"schedule": rule}), optimizer=sgd)
        schedule = made.schedule(10)
        opt = made.make_optimizer(nn.Linear(1, 1))
        schedule.apply(opt, 5)
        assert opt.param_groups[0]["lr"] == pytest.approx(want)
        schedule.apply(opt, 0)  # from the base, not from the rate last set
        assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
        assert made.schedule(10).describe()["base"] == "optimizer"
    # A resumed run's optimizer comes from its checkpoint: the base travels with it.
    again = made.make_optimizer(nn.Linear(1, 1))
    schedule.apply(opt, 5)
    again.load_state_dict(opt.state_dict())
    schedule.apply(again, 5)
    assert again.param_groups[0]["lr"] == pytest.approx(0.005)


def test_the_schema_refuses_what_it_does_not_declare():
    check_recipe({part: {f.name: 1 for f in fields} for part, fields in RECIPE.items()})
    with pytest.raises(SchemaError, match="'colour'"):
        check_recipe({"model": {"colour": "red"}})
    with pytest.raises(SchemaError, match="unknown recipe part 'data'"):
        check_recipe({"data": {}})


def test_the_report_shows_the_recipe_that_ran(given, tmp_path):
    cfg = _cfg()
    record = _describe(cfg, **given)
    log = RunLog(tmp_path / "run.h5", system="mpipipe", config=recipe.Recipe(cfg, **given).stored_config(),
                 comm_size=3)
    log.set_attr("recipe", record)
    log.close()
    text = summarize(load_run(tmp_path / "run.h5"))
    block = "\n".join(recipe_lines(load_run(tmp_path / "run.h5")))
    assert block in text
    for word in ("OwnNet (tests.models.own)", "AdamW", "lr=0.003", "OneCycleLR", "max_lr=0.02",
                 "total_steps=12", "step 1:", "lr=0.0008", "CrossEntropyLoss", "label_smoothing=0.1",
                 record["model"]["digest"]):
        assert word in block, (word, block)
    assert "model.name=" not in text and "optim.name=" not in text and "optim.lr=" not in text


def test_a_log_without_a_recipe_reports_none(tmp_path):
    log = RunLog(tmp_path / "old.h5", system="mpipipe", config={}, comm_size=1)
    log.close()
    assert recipe_lines(load_run(tmp_path / "old.h5")) == []


# ---------------------------------------------------------------- real runs

_SCRIPT = """
import sys, torch
from torch import nn
import mpipipe
sys.path.insert(0, {root!r})
from tests.models.own import own_net

mpipipe.train({{"run": {{"steps": 3, "eval_every": 0}}, "data": {{"path": sys.argv[1], "batch_size": 16}},
               "pipeline": {{"stages": 2, "chunks": 2}}}},
              model=own_net,
              optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01),
              scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=3),
              loss=nn.CrossEntropyLoss(label_smoothing=0.1), log=sys.argv[2], quiet=True)
"""


def _report(log: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "mpipipe", "report", str(log), "--out", str(log.parent / "plots")],
                          cwd=ROOT, env=mpirun_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _ok(result: subprocess.CompletedProcess, log: Path) -> dict:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    return json.loads(run.attrs["recipe"])


@pytest.mark.timeout(300)
def test_an_api_run_records_the_users_objects(digits, tmp_path):
    script, log = tmp_path / "mine.py", tmp_path / "api.h5"
    script.write_text(_SCRIPT.format(root=str(ROOT)))
    record = _ok(run_mpi(2, [str(script), str(digits), str(log)], timeout=240), log)
    assert (record["model"]["class"], record["model"]["source"]) == ("OwnNet", "builder")
    assert record["optimizer"]["class"] == "AdamW" and record["optimizer"]["groups"][0]["lr"] == 3e-3
    assert record["schedule"]["class"] == "OneCycleLR" and record["schedule"]["group"]["max_lr"] == 0.02
    assert record["loss"]["arguments"]["label_smoothing"] == 0.1
    config = open_log(log).config
    assert "name" not in config["model"] and "factory" not in config["model"]
    assert {"name", "lr", "scheduler", "schedule"}.isdisjoint(config["optim"])
    text = _report(log)
    assert "recipe (what ran):" in text and "OwnNet (tests.models.own)" in text
    assert "AdamW" in text and "OneCycleLR" in text
    assert "lenet" not in text and "sgd" not in text and "optim.lr=" not in text


@pytest.mark.timeout(300)
def test_a_toml_run_with_a_factory_stores_no_model_name(digits, tmp_path):
    log = tmp_path / "factory.h5"
    args = ["-m", "mpipipe", "train", "--quiet", "--config", str(ROOT / "jobs/configs/pipeline-digits.toml"),
            "--set", f'data.path="{digits}"', "--set", "run.steps=3", "--set", "run.eval_every=0",
            "--set", "data.batch_size=16", "--set", "pipeline.stages=2", "--set", "pipeline.chunks=2",
            "--set", 'model.factory="tests/models/own.py:own_net"', "--set", "model.kwargs={width=4}",
            "--log", str(log)]
    record = _ok(run_mpi(2, args, timeout=240), log)
    assert record["model"]["source"] == "factory" and record["model"]["class"] == "OwnNet"
    assert record["model"]["kwargs"] == {"width": 4}
    config = open_log(log).config
    assert "name" not in config["model"] and config["model"]["factory"] == "tests/models/own.py:own_net"
    text = _report(log)
    assert "model.factory = 'tests/models/own.py:own_net'" in text and "lenet" not in text


@pytest.mark.long  # make test-long: the same record from Stannis
@pytest.mark.timeout(300)
def test_stannis_records_the_shipped_model_by_name(stannis_split, tmp_path):
    log = tmp_path / "stannis.h5"
    args = ["-m", "stannis", "train", "--config", str(ROOT / "jobs/configs/stannis-digits.toml"),
            "--set", f'data.path="{stannis_split}"', "--set", "run.steps=3", "--set", "run.eval_every=0",
            "--set", 'model.name="lenet"', "--set", "stannis.csds=2", "--set", "stannis.tune=false",
            "--set", "csd.slowdown=1.0", "--log", str(log)]
    record = _ok(run_mpi(3, args, timeout=240), log)
    assert record["model"]["source"] == "shipped" and record["model"]["name"] == "lenet"
    schedule = record["schedule"]
    assert schedule["base"] == "optim.lr" and {"base_batch", "warmup_steps"} <= set(schedule)
    config = open_log(log).config
    assert config["model"]["name"] == "lenet" and "factory" not in config["model"]
    assert "shipped 'lenet'" in _report(log)
