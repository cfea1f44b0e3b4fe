"""Pieces of the pipeline engine that need no MPI: schedules, partition, zoo, tags, checkpoints."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpipipe.core.mpi.transport import make_tag, split_tag
from mpipipe.core.run.models import build_model
from mpipipe.core.state import checkpoint
from mpipipe.core.state.stagestate import StageState
from mpipipe.pipeline.config import PIPELINE_CHOICES
from mpipipe.pipeline.partition import balance_by_params, balance_by_time, balance_costs, split
from mpipipe.pipeline.schedule import (
    REGISTRY,
    SCHEDULES,
    Action,
    Op,
    Schedule,
    actions,
    gpipe,
    makespan,
    onef1b,
    virtual_stages,
)

F, B = Op.FORWARD, Op.BACKWARD


def _simulate(name: str, k: int, v: int, m: int) -> None:
    """Run every rank's action list against the others with sends that never block (as
    the transport's Isend) and receives that do (schedule.makespan raises on a deadlock
    or a backward before its forward); each rank runs its own chunks only."""
    for r in range(k):
        assert all(a.stage % k == r for a in actions(name, r, k, m, v)), f"{name}: rank {r}"
    ones = [1.0] * (v * k)
    assert makespan(name, k, v, m, ones, ones) >= 2 * v * m


@given(k=st.integers(1, 6), m=st.integers(1, 12), name=st.sampled_from(["gpipe", "1f1b"]))
def test_every_micro_batch_runs_forward_then_backward_once(k, m, name):
    for stage in range(k):
        acts = actions(name, stage, k, m)
        assert sorted((a.op, a.micro) for a in acts) == sorted(
            [(F, i) for i in range(m)] + [(B, i) for i in range(m)])
        assert {a.stage for a in acts} == {stage}
        for i in range(m):
            assert acts.index(Action(F, i, stage)) < acts.index(Action(B, i, stage))
        # backwards run in micro-batch order on every stage, so gradients meet in order
        assert [a.micro for a in acts if a.op == B] == list(range(m))
    _simulate(name, k, 1, m)


@given(k=st.integers(1, 5), v=st.integers(2, 4), rounds=st.integers(1, 4))
def test_interleaved_runs_every_chunk_of_every_micro_batch_without_deadlock(k, v, rounds):
    m = rounds * k
    for rank in range(k):
        acts = actions("interleaved-1f1b", rank, k, m, v)
        chunks = range(rank, v * k, k)
        assert sorted((a.op, a.stage, a.micro) for a in acts) == sorted(
            (op, c, i) for op in (F, B) for c in chunks for i in range(m))
    _simulate("interleaved-1f1b", k, v, m)


def test_interleaved_order_and_its_checks():
    # K = 2, v = 2, m = 4: rank 0 warms up with (v-1)K + 2(K-1) = 4 forwards, in rounds of K
    assert [str(a) for a in actions("interleaved-1f1b", 0, 2, 4, 2)][:6] == [
        "F0@0", "F1@0", "F0@2", "F1@2", "F2@0", "B0@2"]
    assert str(actions("interleaved-1f1b", 1, 2, 4, 2)[3]) == "B0@3"
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        actions("interleaved-1f1b", 0, 2, 3, 2)
    assert virtual_stages("interleaved-1f1b", 6, 3) == 2
    assert virtual_stages("1f1b", 3, 3) == 1
    with pytest.raises(ValueError, match="v >= 2 chunks per rank"):
        virtual_stages("interleaved-1f1b", 3, 3)
    with pytest.raises(ValueError, match="v >= 2 chunks per rank"):
        virtual_stages("interleaved-1f1b", 5, 2)
    with pytest.raises(ValueError, match="one chunk per rank"):
        virtual_stages("gpipe", 4, 2)


@given(k=st.integers(1, 6), m=st.integers(1, 12))
def test_1f1b_keeps_at_most_k_minus_stage_micro_batches_in_flight(k, m):
    for stage in range(k):
        in_flight = peak = 0
        for a in onef1b(stage, k, 1, m):
            in_flight += 1 if a.op == F else -1
            peak = max(peak, in_flight)
        assert peak <= min(k - stage, m)
    assert gpipe(0, 1, 1, m)[:m] == [Action(F, i, 0) for i in range(m)]


@pytest.mark.parametrize("k,m", [(2, 4), (3, 6), (4, 8)])
def test_makespan_shows_the_bubble_each_schedule_promises(k, m):
    # K stages of one unit of work per micro-batch (forward 1, backward 2): (m + K - 1) x 3
    for name in ("gpipe", "1f1b"):
        assert makespan(name, k, 1, m, [1.0] * k, [2.0] * k) == (m + k - 1) * 3
    # the same work in 2 chunks per rank: the bubble shrinks, the work stays m x 3
    inter = makespan("interleaved-1f1b", k, 2, m, [0.5] * 2 * k, [1.0] * 2 * k)
    assert m * 3 < inter < (m + k - 1) * 3


def test_interleaved_balance_is_no_slower_than_the_smallest_largest_chunk():
    from mpipipe.pipeline.partition import balance_interleaved

    costs = [1.6, 0.5, 6.7, 0.4, 1.4, 2.6, 0.2, 4.7, 0.2, 0.7, 2.5, 0.1, 4.3, 0.1, 0.4, 0.1, 1.2]

    def step(b):
        bounds = list(itertools.accumulate(b, initial=0))
        chunk = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(len(b))]
        return makespan("interleaved-1f1b", 2, 2, 8, [c / 3 for c in chunk], [2 * c / 3 for c in chunk])

    cut = balance_interleaved(costs, 2, 2, 8)
    assert len(cut) == 4 and sum(cut) == len(costs) and min(cut) >= 1
    assert step(cut) <= step(balance_costs(costs, 4))
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4"):
        balance_interleaved([1, 1, 1], 2, 2, 4)


def test_a_builder_that_runs_a_backward_before_its_forward_is_caught(monkeypatch):
    def backwards_first(rank, k, v, m):
        return [a for a in gpipe(rank, k, v, m) if a.op == B] + \
            [a for a in gpipe(rank, k, v, m) if a.op == F]

    monkeypatch.setitem(REGISTRY, "wrong", Schedule("wrong", backwards_first, "for a test"))
    with pytest.raises(ValueError, match="before its forward"):
        makespan("wrong", 2, 1, 2, [1.0] * 2, [1.0] * 2)


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; choose one of gpipe, 1f1b, "
                                         "interleaved-1f1b"):
        actions("zigzag", 0, 2, 4)


def test_the_config_choices_are_the_registry():
    assert PIPELINE_CHOICES["pipeline.schedule"] == tuple(REGISTRY) == SCHEDULES
    assert all(s.description for s in REGISTRY.values())


@settings(max_examples=60)
@given(costs=st.lists(st.floats(0, 100), min_size=1, max_size=8), k=st.integers(1, 8))
def test_balance_is_the_best_contiguous_cut(costs, k):
    if k > len(costs):
        with pytest.raises(ValueError):
            balance_costs(costs, k)
        return
    balance = balance_costs(costs, k)
    assert len(balance) == k and sum(balance) == len(costs) and min(balance) >= 1

    def worst(b):
        bounds = list(itertools.accumulate(b, initial=0))
        return max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(len(b)))

    best = min(worst([b - a for a, b in zip((0, *cut), (*cut, len(costs)), strict=True)])
               for cut in itertools.combinations(range(1, len(costs)), k - 1))
    assert worst(balance) == pytest.approx(best)


@pytest.mark.parametrize("name,in_shape", [("lenet", (1, 8, 8)), ("lenet", (1, 28, 28)),
                                           ("vgg", (3, 32, 32)), ("resnet", (3, 32, 32))])
def test_zoo_models_are_sequential_and_cut_anywhere(name, in_shape):
    torch.manual_seed(0)
    model = build_model(name, 10, in_shape)
    assert isinstance(model, torch.nn.Sequential)
    x = torch.randn(2, *in_shape)
    whole = model(x)
    assert whole.shape == (2, 10)
    for k in (2, 3):
        parts = split(model, balance_by_params(model, k))
        y = x
        for part in parts:
            y = part(y)
        assert torch.equal(y, whole)
    assert sum(balance_by_time(model, x, 2, repeat=1)) == len(model)


def test_split_keeps_layer_names_and_rejects_bad_balance():
    model = build_model("lenet", 10, (1, 8, 8))
    parts = split(model, [5, 7])
    names = set(parts[0].state_dict()) | set(parts[1].state_dict())
    assert names == set(model.state_dict())
    with pytest.raises(ValueError, match="covers 3 layers but the model has 12"):
        split(model, [1, 2])
    with pytest.raises(ValueError, match="at least one layer"):
        split(model, [12, 0])
    with pytest.raises(ValueError, match="unknown model"):
        build_model("alexnet", 10, (3, 32, 32))


@given(gen=st.integers(0, 100), kind=st.integers(0, 7), step=st.integers(0, 10**5),
       micro=st.integers(0, 5000))
def test_tags_fit_and_round_trip(gen, kind, step, micro):
    tag = make_tag(gen, kind, step, micro)
    assert 0 <= tag < 2**31 - 1
    assert split_tag(tag) == (gen % 32, kind, step % 4096, micro % 1024)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    model = build_model("lenet", 10, (1, 8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    opt.step()
    StageState(model, lambda m: None, optimizer=opt, step=7).save(
        tmp_path, stage=1, balance=[6, 6], sampler=(2, 64))
    state = checkpoint.load_stage(tmp_path, 1)
    assert (state.step, state.balance, state.sampler) == (7, [6, 6], (2, 64))
    assert all(torch.equal(state.params[k], v) for k, v in model.state_dict().items())
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(state.optimizer)
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.load_stage(tmp_path, 0)
    (tmp_path / "stage-2.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load_stage(tmp_path, 2)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"format": "x", "evil": Evil()}, tmp_path / "stage-3.pt")
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load_stage(tmp_path, 3)


@pytest.mark.parametrize("drop_last", [True, False])
def test_run_epochs_count_the_batches_the_reader_hands_out(digits, drop_last):
    """run.epochs becomes steps with the run's own data.drop_last: exactly the batches
    TrainBatches gives in that many epochs (digits: 1438 train records, 44 full batches
    of 32 and a remainder of 30, which is a step only when padded)."""
    from mpipipe.core.run import batches
    from mpipipe.core.run.configfile import load_config
    from mpipipe.pipeline.config import PIPELINE_DEFAULTS

    sets = [f'data.path="{digits}"', "data.batch_size=32", f"data.drop_last={str(drop_last).lower()}"]
    cfg = load_config(None, [*sets, "run.steps=0", "run.epochs=2"], PIPELINE_DEFAULTS)
    steps = batches.run_steps(cfg)
    assert steps == (88 if drop_last else 90)
    reader = batches.TrainBatches(digits, 32, seed=0, drop_last=drop_last)
    handed = 0
    while reader.position[0] < 2:
        x, _ = reader.next()
        assert len(x) == 32
        handed += 1
    assert handed == steps
    # run.steps wins over epochs; too small a data set is the usual one-line DataError
    assert batches.run_steps(load_config(None, [*sets, "run.steps=7", "run.epochs=2"], PIPELINE_DEFAULTS)) == 7
    with pytest.raises(batches.DataError, match="fewer than one batch of 5000"):
        batches.run_steps(load_config(None, [f'data.path="{digits}"', "data.batch_size=5000"], PIPELINE_DEFAULTS))
