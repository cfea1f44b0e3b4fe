"""Deadlines, replay and rebinding: what ResPipe's takeover relies on."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpipipe import Pipeline, Route
from mpipipe.core.mpi.transport import Late
from mpipipe.core.run.models import build_model


def _pair(world: MPI.Comm) -> MPI.Comm | None:
    sub = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    return None if sub == MPI.COMM_NULL else sub


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def _grads(model: nn.Module, x, y) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    nn.CrossEntropyLoss()(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _diff(pipe: Pipeline, expected: dict[str, torch.Tensor]) -> float:
    return max((p.grad - expected[n]).abs().max().item()
               for n, p in pipe.stage_module.named_parameters())


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_late_peer_raises_then_the_step_replays():
    world = MPI.COMM_WORLD
    sub = _pair(world)
    ok = True
    if sub is not None:
        torch.manual_seed(0)
        model = build_model("lenet", 10, (1, 8, 8))
        x, y = _batch()
        expected = _grads(model, x, y)
        pipe = Pipeline(model, [6, 6], 2, "1f1b", sub, in_shape=(1, 8, 8), deadline=0.3)
        loss_fn = nn.CrossEntropyLoss()
        if pipe.last:
            with pytest.raises(Late) as info:
                pipe.step(None, None, loss_fn)  # the first stage is not sending yet
            # Raised for the silent sender once its deadline had passed, not before. How
            # soon after is load, not correctness (a receive that never gave up would hang
            # until the test's timeout fails it).
            ok = info.value.source == 0 and info.value.waited_s > 0.3
        sub.Barrier()
        pipe.deadline = 30
        # the same step again, now with both stages: exact gradients, dirty grads zeroed
        for p in pipe.parameters():
            p.grad = torch.full_like(p, 5.0)
        pipe.step(x, y, loss_fn, step=0)
        ok = ok and _diff(pipe, expected) <= 1e-6 and pipe.step_count == 1
        sub.Free()
    assert world.allreduce(ok, op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_rebind_to_a_new_route_and_generation():
    """Stages swap ranks (as after a takeover): every rank holds every partition."""
    world = MPI.COMM_WORLD
    sub = _pair(world)
    ok = True
    if sub is not None:
        torch.manual_seed(0)
        model = build_model("lenet", 10, (1, 8, 8))
        x, y = _batch()
        expected = _grads(model, x, y)
        pipe = Pipeline(model, [6, 6], 3, "gpipe", sub, in_shape=(1, 8, 8), deadline=30)
        before = pipe.stage
        pipe.rebind(Route((1, 0), generation=1), sub.Dup())
        ok = pipe.stage == 1 - before and pipe.transport.generation == 1
        loss = pipe.step(x, y, nn.CrossEntropyLoss())
        ok = ok and _diff(pipe, expected) <= 1e-6
        ok = ok and ((loss is not None) == (sub.rank == 0))
        moved = Route((0, 1)).moved(0, 1)
        ok = ok and moved.generation == 1 and moved.ranks == (1, 1)
        sub.Free()
    assert world.allreduce(ok, op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_labels_local_and_uneven_micro_batches():
    world = MPI.COMM_WORLD
    sub = _pair(world)
    ok = True
    if sub is not None:
        torch.manual_seed(0)
        model = build_model("lenet", 10, (1, 8, 8))
        x, y = _batch()
        x, y = x[:7], y[:7]
        expected = _grads(model, x, y)
        pipe = Pipeline(model, [3, 9], 3, "1f1b", sub, in_shape=(1, 8, 8), labels="local",
                        deadline=30)
        pipe.step(x if pipe.first else None, y if pipe.last else None, nn.CrossEntropyLoss())
        ok = _diff(pipe, expected) <= 1e-6
        # no LABEL message: the first stage sent activations only
        acts = 7 * 16 * 4 * 4 * 4  # conv, ReLU, pool: 16 x 4 x 4 floats per sample
        ok = ok and (pipe.transport.total_sent == acts if pipe.first else True)
        sub.Free()
    assert world.allreduce(ok, op=MPI.LAND)
