"""Pipelined training equals single-process training (K = 2, 3, 4; GPipe, 1F1B; interleaved 1F1B)."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpipipe import Pipeline
from mpipipe.core.mpi.transport import ACT, Late, Transport
from mpipipe.core.run.models import build_model
from mpipipe.pipeline.engine import Route
from mpipipe.pipeline.partition import balance_by_params, split

TOL = 1e-5
STEPS = 3


def _batches(n: int, batch: int, in_shape: tuple[int, ...], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *in_shape, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def _sub(world: MPI.Comm, k: int) -> MPI.Comm | None:
    color = 0 if world.rank < k else MPI.UNDEFINED
    sub = world.Split(color, world.rank)
    return None if sub == MPI.COMM_NULL else sub


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", [pytest.param(k, marks=pytest.mark.mpi(min_size=k))
                               for k in (2, 3, 4)])
@pytest.mark.parametrize("name,in_shape,chunks,batch", [
    ("lenet", (1, 8, 8), 4, 10),     # 10 samples in 4 micro-batches: uneven sizes 3,3,2,2
    ("resnet", (3, 16, 16), 3, 6),   # residual blocks as single modules, GroupNorm
])
def test_pipeline_equals_single_process(k, schedule, name, in_shape, chunks, batch):
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(name, 10, in_shape)
    reference_init = copy.deepcopy(model)
    batches = _batches(STEPS, batch, in_shape)
    sub = _sub(world, k)
    diff = 0.0
    losses_ok = True
    if sub is not None:
        # lenet: even cuts (some stages hold only parameter-free layers); resnet: by params
        balance = [12 // k] * k if name == "lenet" else balance_by_params(model, k)
        # a deadline turns a lost message into an error instead of a hang
        pipe = Pipeline(model, balance, chunks, schedule, sub, in_shape=in_shape, deadline=20)
        params = list(pipe.parameters())
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if params else None
        loss_fn = nn.CrossEntropyLoss()
        reference = copy.deepcopy(reference_init)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches:
            # only the first stage gets data: the others must not need it
            loss = pipe.step(x if pipe.first else None, y if pipe.first else None, loss_fn)
            if opt is not None:
                opt.step()
            ref_opt.zero_grad()
            expected = loss_fn(reference(x), y)
            expected.backward()
            ref_opt.step()
            if pipe.last:
                losses_ok &= abs(loss - expected.item()) <= 1e-5
            else:
                losses_ok &= loss is None
        mine = pipe.stage_module
        theirs = split(reference, pipe.balance)[pipe.stage]
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            diff = max(diff, (p - q).abs().max().item())
        sub.Free()
    worst = world.allreduce(diff, op=MPI.MAX)
    all_losses_ok = world.allreduce(losses_ok, op=MPI.LAND)
    assert worst <= TOL, f"K={k} {schedule}: max abs parameter difference {worst:.3g}"
    assert all_losses_ok, "the last stage's loss differs from single-process loss"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [pytest.param(k, marks=pytest.mark.mpi(min_size=k)) for k in (2, 3)])
@pytest.mark.parametrize("name,in_shape,batch", [
    ("lenet", (1, 8, 8), 10),     # m = 2K micro-batches of uneven sizes
    ("resnet", (3, 16, 16), 8),   # residual blocks as single modules, GroupNorm
])
def test_interleaved_1f1b_equals_single_process(k, name, in_shape, batch):
    """v = 2 chunks per rank: rank r holds chunks r and r + K, one Pipeline call with a
    balance of 2K entries; parameters, loss and evaluation equal single-process ones."""
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    torch.manual_seed(0)
    v, chunks = 2, 2 * k
    model = build_model(name, 10, in_shape)
    reference = copy.deepcopy(model)
    batches = _batches(STEPS, batch, in_shape)
    sub = _sub(world, k)
    diff, ok = 0.0, True
    if sub is not None:
        balance = [12 // (v * k)] * (v * k) if name == "lenet" else balance_by_params(model, v * k)
        pipe = Pipeline(model, balance, chunks, "interleaved-1f1b", sub, in_shape=in_shape,
                        deadline=20)
        assert (pipe.k, pipe.v, len(pipe.chunk_modules)) == (k, v, v * k)
        opt = torch.optim.SGD(list(pipe.parameters()), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        for x, y in batches:
            loss = pipe.step(x if pipe.first else None, y if pipe.first else None, loss_fn)
            opt.step()
            ref_opt.zero_grad()
            expected = loss_fn(reference(x), y)
            expected.backward()
            ref_opt.step()
            ok &= abs(loss - expected.item()) <= TOL if pipe.last else loss is None
        theirs = dict(reference.named_parameters())
        mine = dict(pipe.stage_module.named_parameters())
        # the stage's module is its chunks k, k + K: exactly those layers' parameters
        wanted = {n for c in range(pipe.stage, v * k, k)
                  for n, _ in split(reference, balance)[c].named_parameters()}
        ok &= set(mine) == wanted
        for n, p in mine.items():
            diff = max(diff, (p - theirs[n]).abs().max().item())
        x, y = batches[0]
        with torch.no_grad():
            reference.eval()
            right = int((reference(x).argmax(1) == y).sum())
        result = pipe.evaluate(x if pipe.first else None, y if pipe.first else None)
        ok &= result == (right, batch) if pipe.last else result is None
        sub.Free()
    worst = world.allreduce(diff, op=MPI.MAX)
    assert worst <= TOL, f"K={k} interleaved: max abs parameter difference {worst:.3g}"
    assert world.allreduce(ok, op=MPI.LAND), "a loss, evaluation or stage's parameter set differs"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_evaluate_counts_on_last_stage():
    world = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = build_model("lenet", 10, (1, 8, 8))
    x, y = _batches(1, 7, (1, 8, 8))[0]
    expected = int((model(x).argmax(1) == y).sum())
    sub = _sub(world, 2)
    ok = True
    if sub is not None:
        pipe = Pipeline(model, [5, 7], 3, "1f1b", sub, in_shape=(1, 8, 8))
        result = pipe.evaluate(x if pipe.first else None, y if pipe.first else None)
        ok = result == (expected, 7) if pipe.last else result is None
        sub.Free()
    assert world.allreduce(ok, op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_generation_and_route_isolate_messages():
    """A message sent under an old generation is never received under the new one."""
    world = MPI.COMM_WORLD
    sub = _sub(world, 2)
    ok = True
    if sub is not None:
        old, new = Transport(sub, generation=0), Transport(sub, generation=1)
        buf = torch.zeros(4)
        if sub.rank == 0:
            old.send(torch.full((4,), 7.0), 1, kind=ACT, step=5)
            new.send(torch.full((4,), 9.0), 1, kind=ACT, step=5)
            sub.Barrier()
            old.discard()
            new.flush()
        else:
            new.recv(buf, 0, kind=ACT, step=5, deadline=10)
            ok = bool((buf == 9.0).all())
            try:
                new.recv(buf, 0, kind=ACT, step=5, deadline=0.05)
                ok = False
            except Late:
                pass
            old.recv(buf, 0, kind=ACT, step=5, deadline=10)  # drain the stale message
            ok = ok and bool((buf == 7.0).all())
            sub.Barrier()
        assert Route((0, 1)).moved(1, 0).generation == 1
        sub.Free()
    assert world.allreduce(ok, op=MPI.LAND)
