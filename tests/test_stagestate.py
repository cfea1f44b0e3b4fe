"""StageState, the one owner of a stage's state: every way the state moves (a replica, a
checkpoint, a neighbour's merge) gives back exactly the state that stayed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpipipe.core.state import checkpoint
from mpipipe.core.state.stagestate import StageState
from mpipipe.core.state.statecodec import StateError


class _Const:
    """A schedule that sets one learning rate (what Schedule.apply does, per step)."""

    def __init__(self, lr: float) -> None:
        self.lr, self.steps = lr, []

    def apply(self, opt: torch.optim.Optimizer, step: int) -> None:
        self.steps.append(step)
        for g in opt.param_groups:
            g["lr"] = self.lr


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


def _adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)


def _train(state: StageState, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed + state.step)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        state.module(x).square().mean().backward()
        state.apply_step(_Const(0.01), state.step)
        state.optimizer.zero_grad()


def _same(a: StageState, b: StageState) -> None:
    for (ka, va), (kb, vb) in zip(a.module.state_dict().items(), b.module.state_dict().items(),
                                  strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)
    assert a.step == b.step


def test_apply_step_sets_the_schedule_then_steps_and_counts():
    state = StageState(_net(), _adam)
    sched = _Const(0.5)
    state.module(torch.randn(4, 6)).sum().backward()
    state.apply_step(sched, 7)
    assert sched.steps == [7] and state.step == 8
    assert state.optimizer.param_groups[0]["lr"] == 0.5


def test_a_replica_carries_the_whole_state_and_its_size_is_known_before_a_step():
    a = StageState(_net(), _adam)
    size = a.nbytes  # before the optimizer's first step: from the layout alone
    _train(a, 3)
    flat = a.pack()
    assert flat.numel() == size == a.nbytes
    b = StageState(_net(seed=5), _adam)
    b.unpack(flat, a.step)
    _same(a, b)
    _train(a, 2)
    _train(b, 2)
    _same(a, b)  # and they go on alike


def test_a_replica_of_step_0_leaves_the_optimizer_empty_and_a_rollback_names_its_step():
    a = StageState(_net(), _adam)
    flat = a.pack()
    _train(a, 2)
    a.unpack(flat, 0, step=5)
    assert not a.optimizer.state and a.step == 5


def test_a_replica_of_another_layout_is_refused():
    a = StageState(_net(), _adam)
    other = StageState(nn.Linear(6, 2), _adam)
    with pytest.raises(StateError, match="does not fit"):
        a.unpack(other.pack(), 1)


def test_a_checkpoint_is_the_state_dict_and_loads_back_exactly(tmp_path):
    a = StageState(_net(), _adam)
    _train(a, 3)
    path = a.save(tmp_path, stage=2, balance=[2, 2], sampler=(1, 16), eval_count=4)
    ck = checkpoint.load_stage(tmp_path, 2)
    assert path == checkpoint.stage_path(tmp_path, 2)
    assert (ck.step, ck.balance, ck.sampler, ck.eval_count) == (3, [2, 2], (1, 16), 4)
    raw = torch.load(path, weights_only=True)  # a torch user reads it without us
    assert raw["params"].keys() == a.module.state_dict().keys()
    b = StageState(_net(seed=9), _adam)
    b.load_state_dict(ck.state)
    _same(a, b)
    # the replica of the loaded state is the replica of the saved one, byte for byte
    assert torch.equal(a.pack(), b.pack())


def test_a_checkpoint_of_another_model_says_it_does_not_fit(tmp_path):
    StageState(_net(), _adam).save(tmp_path, stage=0, balance=[4])
    other = StageState(nn.Linear(6, 2), _adam)
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model"):
        other.load_state_dict(checkpoint.load_stage(tmp_path, 0).state)


def test_a_neighbour_merge_equals_the_two_stages_trained_apart():
    """absorb: one optimizer over both slices, the holder's state kept and the ward's from
    its replica; a step of the merged stage equals a step of each stage alone."""
    torch.manual_seed(3)
    front, back = nn.Linear(6, 5), nn.Linear(5, 3)

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    mine, ward = StageState(front, sgd), StageState(back, sgd)
    ref_front, ref_back = copy.deepcopy(mine), copy.deepcopy(ward)
    g = torch.Generator().manual_seed(0)
    for st in (mine, ward, ref_front, ref_back):  # one step each, so momentum exists
        (sum(q.sum() for q in st.module.parameters()) * 0.5).backward()
        st.apply_step(_Const(0.1), 0)
        st.optimizer.zero_grad()
    replica = ward.pack()
    merged = nn.Sequential(front, back)
    mine.absorb(merged, back, replica, count=1)
    assert mine.module is merged and len(mine.optimizer.state) == 4
    x = torch.randn(4, 6, generator=g)
    merged(x).square().sum().backward()
    mine.apply_step(_Const(0.1), 1)
    h = ref_front.module(x)
    h.retain_grad()
    ref_back.module(h).square().sum().backward()
    ref_front.apply_step(_Const(0.1), 1)
    ref_back.apply_step(_Const(0.1), 1)
    for p, q in zip(merged.parameters(), [*ref_front.module.parameters(),
                                          *ref_back.module.parameters()], strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_stage_without_a_torch_optimizer_checkpoints_its_module_alone(tmp_path):
    a = StageState(nn.Linear(2, 2), lambda m: None)
    assert a.optimizer is None
    a.apply_step(_Const(0.1), 0)  # nothing to step; the count moves
    assert a.step == 1
    a.save(tmp_path, stage=0, balance=[1])
    b = StageState(nn.Linear(2, 2), lambda m: None)
    b.load_state_dict(checkpoint.load_stage(tmp_path, 0).state)
    assert torch.equal(a.module.weight, b.module.weight) and b.step == 1
