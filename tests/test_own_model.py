"""A user's own model, optimizer, scheduler and loss, end to end under mpirun (issue 26).

The model (tests/models/own.py) is a plain nn.Module with BatchNorm, residual adds and
Dropout, traced into a chain; AdamW and OneCycleLR come from torch by name. Every run is
held to a single-process reference computed here: gradient accumulation over the same
micro-batches, BatchNorm updated once per micro-batch in order, and Dropout drawn from
torch's generator seeded with ``micro_seed(seed, chunk, step, micro)`` before each
chunk's forward (the pipeline's rule). Losses of every step and the final state_dict,
BatchNorm's running statistics and counters included, agree to 1e-5. Real kills
(ULFM); nothing here asserts a time.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import pytest
import torch

from mpipipe.core.logs.runlog import open_log
from mpipipe.core.run import recipe
from mpipipe.pipeline.config import PIPELINE_DEFAULTS
from mpipipe.tools.launch import ROOT, run_mpi

STEPS = 12
BATCH = 32
MICRO = 4
SEED = 0
OWN = ('model.factory="tests/models/own.py:own_net"', 'optim.name="AdamW"',
       "optim.kwargs={weight_decay=0.01}", 'optim.scheduler="OneCycleLR"',
       "optim.scheduler_kwargs={max_lr=0.02}", 'optim.schedule="constant"',
       "model.loss_kwargs={label_smoothing=0.1}")


STEP_LR = ('optim.scheduler="StepLR"', "optim.scheduler_kwargs={step_size=4, gamma=0.5}")


def _cfg(step_lr: bool = False) -> dict:
    cfg = {k: dict(v) for k, v in PIPELINE_DEFAULTS.items()}
    cfg["model"].update(factory=str(ROOT / "tests/models/own.py") + ":own_net",
                        loss_kwargs={"label_smoothing": 0.1})
    cfg["optim"].update(name="AdamW", kwargs={"weight_decay": 0.01}, scheduler="OneCycleLR",
                        scheduler_kwargs={"max_lr": 0.02}, schedule="constant")
    if step_lr:  # a schedule that does not depend on the run's length (resume)
        cfg["optim"].update(scheduler="StepLR", scheduler_kwargs={"step_size": 4, "gamma": 0.5})
    return cfg


@cache
def _reference(digits: Path, balance: tuple[int, ...], step_lr: bool = False,
               deferred: bool = False) -> tuple[list[float], dict]:
    """Single-process training of STEPS steps: (losses, final state_dict). ``deferred``:
    BatchNorm's running statistics move once a step, from the whole mini-batch (checked
    against torch's own BatchNorm on the full batch in tests/test_deferred_bn.py)."""
    from mpipipe.core.run.batches import TrainBatches
    from mpipipe.pipeline.deferred_bn import begin_step, commit_step
    from mpipipe.pipeline.engine import micro_seed
    from mpipipe.pipeline.partition import split

    cfg = _cfg(step_lr)
    torch.manual_seed(SEED)
    made = recipe.Recipe(cfg)
    model = made.build_model((1, 8, 8))
    if deferred:
        from mpipipe.pipeline.deferred_bn import defer_batch_norm

        defer_batch_norm(model)
    chunks = split(model, list(balance))
    opt = made.make_optimizer(model)
    schedule = made.schedule(STEPS)
    loss_fn = made.make_loss()
    data = TrainBatches(digits, BATCH, seed=SEED, shuffle=True, drop_last=True, num_classes=10)
    losses = []
    for s in range(STEPS):
        x, y = data.next()
        for p in model.parameters():
            p.grad = None
        if deferred:
            begin_step(model)
        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.tensor_split(MICRO), y.tensor_split(MICRO), strict=True)):
            h = xi
            for c, chunk in enumerate(chunks):
                torch.default_generator.manual_seed(micro_seed(SEED, c, s, i))
                h = chunk(h)
            loss = loss_fn(h, yi) * (len(yi) / BATCH)
            loss.backward()
            total += float(loss.detach())
        if deferred:
            commit_step(model)
        schedule.apply(opt, s)
        opt.step()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(respipe_args, tmp_path_factory):
    """run(name, ranks, *settings, ulfm=False) -> (result, log path, checkpoint dir)."""
    base = tmp_path_factory.mktemp("own")

    @cache
    def run(name: str, ranks: int, *settings: str, ulfm: bool = False, steps: int = STEPS,
            resume: str = ""):
        log = base / f"{name}.h5"
        args = respipe_args(log, *OWN, f"pipeline.chunks={MICRO}", *settings, steps=steps,
                            batch=BATCH)
        if resume:
            args += ["--resume", str(base / f"{resume}-ckpt")]
        result = run_mpi(ranks, args, ulfm=ulfm, timeout=300)
        return result, log, base / f"{name}-ckpt"

    return run


def _state(ckpt: Path) -> dict:
    out: dict = {}
    for p in sorted(ckpt.glob("stage-*.pt")):
        out.update(torch.load(p, weights_only=False)["params"])
    return out


def _equals_reference(digits: Path, result, log: Path, ckpt: Path, first: int = 1,
                      step_lr: bool = False, deferred: bool = False) -> object:
    """The run's log holds steps ``first``..STEPS with the reference's losses, and its
    last checkpoint the reference's final state_dict."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert [int(s) for s in run.steps["step"]] == list(range(first, STEPS + 1))
    balance = tuple(int(b) for b in str(run.attrs["balance"]).strip("[]").split(","))
    losses, state = _reference(digits, balance, step_lr, deferred)
    losses = losses[first - 1:]
    got = [float(v) for v in run.steps["loss"]]
    assert max(abs(a - b) for a, b in zip(got, losses, strict=True)) <= 1e-5, (got, losses)
    mine = _state(ckpt)
    assert set(mine) == set(state)
    assert any("running_var" in k for k in state) and any("num_batches_tracked" in k for k in state)
    for k, want in state.items():
        assert mine[k].dtype == want.dtype, k
        assert torch.allclose(mine[k].double(), want.double(), atol=1e-5, rtol=0), k
    return run


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule,ranks", [("gpipe", 3), pytest.param("1f1b", 3, marks=pytest.mark.long),
                                            ("interleaved-1f1b", 2)])
def test_the_pipeline_trains_your_model_as_one_process_would(runs, digits, schedule, ranks):
    result, log, ckpt = runs(f"plain-{schedule}", ranks, f'pipeline.schedule="{schedule}"',
                             f"pipeline.stages={ranks}", "resilience.backups={}")
    _equals_reference(digits, result, log, ckpt)


@pytest.mark.timeout(900)
def test_respipe_without_failure_and_with_a_kill_cold_r1_and_hot_equals_the_reference(runs, digits):
    backed = ('resilience.backups="all"', "resilience.replicate_every=1")
    for name, settings in (("respipe", ()), ("cold-kill", ("inject:kill:stage=1:step=6",)),
                           ("hot-kill", ('resilience.mode="hot"', "inject:kill:stage=2:step=6:micro=1"))):
        result, log, ckpt = runs(name, 6, *backed, *settings, ulfm=True)
        run = _equals_reference(digits, result, log, ckpt)
        assert len(run.events_of("takeover")) == (0 if name == "respipe" else 1)


@pytest.mark.long  # make test-long: a variant of a fast test
@pytest.mark.timeout(900)
def test_deferred_batch_norm_commits_once_a_step_in_the_pipeline_and_after_kills(runs, digits):
    deferred = ("pipeline.deferred_batch_norm=true",)
    backed = ('resilience.backups="all"', "resilience.replicate_every=1")
    result, log, ckpt = runs("deferred", 3, *deferred, "resilience.backups={}")
    _equals_reference(digits, result, log, ckpt, deferred=True)
    for name, settings in (("deferred-cold", ("inject:kill:stage=1:step=6:micro=2",)),
                           ("deferred-hot", ('resilience.mode="hot"', "inject:kill:stage=0:step=6:micro=1"))):
        result, log, ckpt = runs(name, 6, *deferred, *backed, *settings, ulfm=True)
        _equals_reference(digits, result, log, ckpt, deferred=True)


@pytest.mark.long  # make test-long: a variant of a fast test
@pytest.mark.timeout(900)
def test_a_kill_under_r5_stays_within_the_documented_loss(runs):
    result, log, _ = runs("cold-r5", 6, 'resilience.backups="all"', "resilience.replicate_every=5",
                          "inject:kill:stage=1:step=8", ulfm=True)
    assert result.returncode == 0, result.stderr[-4000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert [int(s) for s in run.steps["step"]] == list(range(1, STEPS + 1))
    assert all(math.isfinite(float(v)) for v in run.steps["loss"])
    (takeover,) = run.events_of("takeover")
    assert 0 <= takeover["detail"]["lost_updates"] <= 4  # at most R - 1 updates of stage 1


@pytest.mark.long  # make test-long: a variant of a fast test
@pytest.mark.timeout(900)
def test_a_resumed_run_continues_as_if_never_stopped(runs, digits):
    # The first run stops at step 6 of 12: a schedule of the run's length (OneCycleLR)
    # would differ between the two, so this one steps the rate every 4 steps.
    plain = ("resilience.backups={}", *STEP_LR)
    first, _, _ = runs("half", 3, *plain, "run.checkpoint_every=6", steps=6)
    assert first.returncode == 0, first.stderr[-3000:]
    result, log, ckpt = runs("resumed", 3, *plain, resume="half")
    _equals_reference(digits, result, log, ckpt, first=7, step_lr=True)


@pytest.mark.long  # make test-long: a variant of the checks in make test
@pytest.mark.timeout(300)
def test_a_factory_that_is_not_deterministic_is_one_line(runs, tmp_path):
    factory = tmp_path / "random_net.py"
    factory.write_text("import random\nfrom torch import nn\n\n"
                       "def net():\n    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(),\n"
                       "                      nn.Linear(32, 10))\n"
                       "    nn.init.constant_(m[1].bias, random.random())\n    return m\n")
    result, _, _ = runs("random", 3, f'model.factory="{factory}:net"', "resilience.backups={}",
                        steps=2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors and "model.factory is not deterministic" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


_SCRIPT = """
import json, sys, torch
from torch import nn
import mpipipe, stannis
sys.path.insert(0, {root!r})
from tests.models.own import own_net

system, data, out = sys.argv[1], sys.argv[2], sys.argv[3]
common = dict(model=own_net,  # a builder: called after run.seed seeds torch, on every rank
              optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01),
              scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps={steps}),
              loss=nn.CrossEntropyLoss(label_smoothing=0.1), log=out + ".h5", quiet=True)
if system == "mpipipe":
    config = {{"run": {{"steps": {steps}, "eval_every": 0, "seed": {seed}}},
              "data": {{"path": data, "batch_size": {batch}}},
              "pipeline": {{"stages": 3, "chunks": {micro}}}}}
    result = mpipipe.train(config, **common)
else:
    config = {{"run": {{"steps": 6}}, "data": {{"path": data}}, "stannis": {{"csds": 2}}}}
    result = stannis.train(config, **common)
if result.is_writer:
    model = own_net()
    model.load_state_dict(result.state_dict)  # the names of your own model
    torch.save(result.state_dict, out + ".pt")
    print("METRICS", json.dumps(result.metrics, default=str))
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "my_training.py"
    path.write_text(_SCRIPT.format(root=str(ROOT), steps=STEPS, seed=SEED, batch=BATCH, micro=MICRO))
    return path


@pytest.mark.timeout(600)
def test_the_python_api_trains_your_objects_as_the_configuration_would(digits, tmp_path):
    # mpipipe.train with Python objects (a builder, lambdas, a loss module) and a dict
    # config: the same program as the command, so the single-process reference holds,
    # and the writer gets the whole state_dict back in the names of the user's model.
    out = tmp_path / "api"
    result = run_mpi(3, [str(_script(tmp_path)), "mpipipe", str(digits), str(out)], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("METRICS ")]
    import json

    metrics = json.loads(line.split(" ", 1)[1])
    assert metrics["steps"] == STEPS and metrics["log"] == str(out) + ".h5"
    run = open_log(str(out) + ".h5")
    balance = tuple(int(b) for b in str(run.attrs["balance"]).strip("[]").split(","))
    losses, state = _reference(digits, balance)
    assert max(abs(float(a) - b) for a, b in zip(run.steps["loss"], losses, strict=True)) <= 1e-5
    torch.manual_seed(SEED)
    made = recipe.Recipe(_cfg())
    made.build_model((1, 8, 8))
    theirs = made.names  # chain name -> the user's model's name
    got = torch.load(str(out) + ".pt", weights_only=True)
    assert set(got) == {theirs[k] for k in state}
    for k, want in state.items():
        assert torch.allclose(got[theirs[k]].double(), want.double(), atol=1e-5, rtol=0), k


_TWO_RUNS = """
import sys, torch
from torch import nn
import mpipipe
sys.path.insert(0, {root!r})
from tests.models.own import own_net

data, out = sys.argv[1], sys.argv[2]
config = {{"run": {{"steps": 2, "eval_every": 0}}, "data": {{"path": data, "batch_size": 16}},
          "pipeline": {{"stages": 2, "chunks": 2}}}}
try:  # a misspelt key: one exception on every rank, which the script catches
    mpipipe.train(config, settings=["pipeline.chunkz=4"], log=out + "-bad.h5", quiet=True)
except mpipipe.TrainingFailed as e:
    print("CAUGHT", e.status, e.line, flush=True)
try:  # an optimizer written for a parameter list: the line says how to write it
    mpipipe.train(config, model=own_net, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                  log=out + "-list.h5", quiet=True)
except mpipipe.TrainingFailed as e:
    print("CAUGHT", e.status, e.line, flush=True)
# two runs, different models and objects: nothing of the first is in the second
mine = mpipipe.train(config, model=own_net, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                     log=out + "-mine.h5", quiet=True)
shipped = mpipipe.train(config, log=out + "-lenet.h5", quiet=True)
if mine.is_writer:
    own_net().load_state_dict(mine.state_dict)
    print("MINE", sorted(mine.state_dict)[0], flush=True)
if shipped.is_writer:
    print("SHIPPED", len(shipped.state_dict), flush=True)
print("DONE", flush=True)
"""


@pytest.mark.timeout(600)
def test_a_script_catches_a_bad_run_and_two_runs_share_nothing(digits, tmp_path):
    # Issue 34: a misspelt key ended the script with SystemExit(2); now every rank gets
    # TrainingFailed carrying the command's line, and the script goes on. Two train()
    # calls with different models share nothing (no module state between them), and
    # each gives back its own model, gathered over MPI (no checkpoint directory).
    script = tmp_path / "two_runs.py"
    script.write_text(_TWO_RUNS.format(root=str(ROOT)))
    out = tmp_path / "run"
    result = run_mpi(2, [str(script), str(digits), str(out)], timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    caught = [ln for ln in lines if ln.startswith("CAUGHT ")]
    assert len(caught) == 4, result.stdout  # two failures, on each of the 2 ranks
    assert all(ln.startswith("CAUGHT 2 mpipipe train: error: ") for ln in caught)
    assert sum("pipeline.chunkz" in ln for ln in caught) == 2
    assert sum("m.parameters()" in ln for ln in caught) == 2
    assert lines.count("DONE") == 2
    assert any(ln.startswith("MINE ") for ln in lines)  # the user's model's names
    (shipped,) = [ln for ln in lines if ln.startswith("SHIPPED ")]
    from mpipipe.core.run.models import build_model

    assert int(shipped.split()[1]) == len(build_model("lenet", 10, (1, 8, 8)).state_dict())
    assert not Path(str(out) + "-bad.h5").exists()  # no log for a run that never started
    assert not list(tmp_path.glob("*-ckpt"))  # no checkpoint directory was forced


@pytest.mark.timeout(600)
def test_stannis_from_python_gives_the_host_the_final_model(stannis_split, tmp_path):
    out = tmp_path / "stannis-api"
    result = run_mpi(3, [str(_script(tmp_path)), "stannis", str(stannis_split), str(out)], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("METRICS ")]
    assert open_log(str(out) + ".h5").attrs["status"] == "completed"
    got = torch.load(str(out) + ".pt", weights_only=True)
    assert any(k.endswith("running_mean") for k in got)  # BatchNorm's statistics came back


@pytest.mark.timeout(900)
def test_replicas_of_your_model_are_the_bytes_the_cost_model_counts(runs):
    # The failure-free ResPipe run (cold R = 1, one backup per stage) of the BatchNorm
    # model with AdamW: every step's payload bytes, summed over the ranks, equal the cost
    # model's, whose replica bytes are the stage state's exact layout (parameters,
    # BatchNorm's buffers, AdamW's moments and step counters).
    from mpipipe.pipeline.partition import split
    from mpipipe.respipe import costmodel

    result, log, _ = runs("respipe", 6, 'resilience.backups="all"', "resilience.replicate_every=1",
                          ulfm=True)
    assert result.returncode == 0, result.stderr[-3000:]
    run = open_log(log)
    balance = [int(b) for b in str(run.attrs["balance"]).strip("[]").split(",")]
    cfg = _cfg()
    torch.manual_seed(SEED)
    made = recipe.Recipe(cfg)
    model = made.build_model((1, 8, 8))
    shapes, in_bytes = costmodel.stage_shapes(split(model, balance), (1, 8, 8),
                                              made.make_optimizer, stages=3)
    assert all(s.state > 2 * s.params for s in shapes if s.params)  # moments + buffers
    cost = costmodel.predict(shapes, batch_size=BATCH, backups=dict.fromkeys(range(3), 1),
                             replicate_every=1, mode="cold", label_bytes=8, input_bytes=in_bytes)
    measured: dict[int, int] = {}
    for figures in run.ranks.values():
        for step, sent in zip(figures["step"], figures["bytes_sent"], strict=True):
            measured[int(step)] = measured.get(int(step), 0) + int(sent)
    assert sorted(measured) == list(range(1, STEPS + 1))
    assert measured == {s: cost.at_step(s) for s in measured}
