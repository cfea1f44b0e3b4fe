"""The weighted allreduce gives the gradient of the union batch, at any world size."""

import pytest
import torch
from mpi4py import MPI

from stannis.allreduce import WeightedAllreduce


def _model() -> torch.nn.Sequential:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10),
    )


def _union_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _check(comm: MPI.Comm, sizes: list[int], bucket_bytes: int, exchange: str = "allreduce",
           overlap: bool = False) -> None:
    assert len(sizes) == comm.Get_size()
    x, y = _union_batch(sum(sizes))
    loss_fn = torch.nn.CrossEntropyLoss()

    reference = _model()
    loss_fn(reference(x), y).backward()
    expected = _grads(reference)

    model = _model()
    start = sum(sizes[:comm.Get_rank()])
    b = sizes[comm.Get_rank()]
    reducer = WeightedAllreduce(comm, model.parameters(), bucket_bytes=bucket_bytes, exchange=exchange)
    leaf = overlap and exchange == "host" and comm.Get_rank() != 0
    sent_before_first_layer = []
    if b > 0:
        if overlap:
            reducer.arm(b)
            first = model[0].weight  # its gradient is among the last backward produces
            first.register_post_accumulate_grad_hook(lambda _p: sent_before_first_layer.append(reducer.calls))
        loss_fn(model(x[start:start + b]), y[start:start + b]).backward()
        if leaf:
            # a leaf sent the last layers' buckets while backward still ran, and all of
            # them by its end: reduce only waits
            assert sent_before_first_layer[0] > 0
            assert reducer.calls == len(reducer.buckets)
    total = reducer.reduce(b)
    assert total == sum(sizes)
    assert reducer.calls == len(reducer.buckets) > 1
    for got, want in zip(_grads(model), expected, strict=True):
        assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.mpi(min_size=2)  # at one rank there is nothing to reduce
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bucket_bytes", [256, 1024, 4096])
@pytest.mark.parametrize("exchange", ["allreduce", "host"])
@pytest.mark.parametrize("overlap", [False, True])
def test_unequal_batches_match_union_batch(bucket_bytes: int, exchange: str, overlap: bool) -> None:
    comm = MPI.COMM_WORLD
    sizes = [3 + 5 * r for r in range(comm.Get_size())]
    _check(comm, sizes, bucket_bytes, exchange, overlap)
    _check(comm, sizes[::-1], bucket_bytes, exchange, overlap)  # again, with other batches: buffers reused


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("exchange", ["allreduce", "host"])
def test_rank_with_empty_batch_contributes_nothing(exchange: str) -> None:
    comm = MPI.COMM_WORLD
    sizes = [7 + r for r in range(comm.Get_size())]
    sizes[1] = 0
    _check(comm, sizes, 512, exchange)
    _check(comm, sizes, 512, exchange, overlap=True)
    sizes[0] = 0  # the root's own batch empty too: it still sums and sends
    _check(comm, sizes, 512, exchange)
    _check(comm, sizes, 512, exchange, overlap=True)


@pytest.mark.mpi(min_size=4)  # two sub-communicators of at least two ranks each
@pytest.mark.timeout(60)
def test_works_on_a_sub_communicator() -> None:
    world = MPI.COMM_WORLD
    sub = world.Split(world.Get_rank() % 2, world.Get_rank())
    try:
        _check(sub, [2 * r + 1 for r in range(sub.Get_size())], 300)
        _check(sub, [2 * r + 1 for r in range(sub.Get_size())], 300, "host")
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)  # every rank's zero must reach the others
@pytest.mark.timeout(60)
@pytest.mark.parametrize("exchange", ["allreduce", "host"])
def test_all_empty_gives_zero_gradient(exchange: str) -> None:
    comm = MPI.COMM_WORLD
    model = _model()
    reducer = WeightedAllreduce(comm, model.parameters(), exchange=exchange)
    assert reducer.reduce(0) == 0
    assert all(p.grad.abs().max().item() == 0 for p in model.parameters())


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_broadcast_state_gives_every_rank_the_roots_parameters_and_momentum(optim: str) -> None:
    # What survivors do after a CSD is dropped: they continue from the host's state,
    # optimizer moments included, so one more identical update keeps them identical.
    from mpipipe.core.state.stagestate import StageState
    from stannis.allreduce import broadcast_state

    comm = MPI.COMM_WORLD
    model = _model()
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if optim == "sgd"
           else torch.optim.Adam(params, lr=0.01))
    g = torch.Generator().manual_seed(7 + comm.Get_rank())  # every rank drifts its own way
    for _ in range(2 + comm.Get_rank()):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    key = "momentum_buffer" if optim == "sgd" else "exp_avg"
    mine = [opt.state[p][key].clone() for p in params]
    roots = comm.bcast(mine, root=0)
    if comm.Get_rank() == 1:
        assert any((a - b).abs().max().item() > 0 for a, b in zip(mine, roots, strict=True))
    state = StageState(model, lambda m: None, optimizer=opt, step=5)
    broadcast_state(comm, state)
    for p, want in zip(params, roots, strict=True):
        assert torch.equal(opt.state[p][key], want)
    common = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=common)
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(flat, comm.bcast(flat, root=0))
    state.step = 0
    broadcast_state(comm, state)  # no step yet: no state
    assert all(not opt.state.get(p) for p in params)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_batchnorm_statistics_averaged_by_batch_weight_are_the_union_batchs_mean() -> None:
    # Each rank normalizes its own batch (of its own size; one rank may have none); the
    # running means, averaged with the gradients' weights, equal those the union batch
    # gives one BatchNorm. The running variances are the weighted mean of the ranks'
    # (unbiased) batch variances, the rule docs/stannis.md states; the counter is the step.
    from stannis.allreduce import BufferAverage

    comm = MPI.COMM_WORLD
    sizes = [0 if r == 1 else 3 + 2 * r for r in range(comm.Get_size())]
    x, _ = _union_batch(sum(sizes))
    start, b = sum(sizes[:comm.Get_rank()]), sizes[comm.Get_rank()]
    union = torch.nn.BatchNorm2d(1, momentum=0.3)
    union(x)
    mine = torch.nn.BatchNorm2d(1, momentum=0.3)
    if b > 0:
        mine(x[start:start + b])
    avg = BufferAverage(comm, mine)
    assert avg.nbytes == 8 * (1 + 1 + 1) + 8  # mean, var, the weight slot; the counter
    MPI.Request.Waitall(avg.requests(float(b)))
    avg.apply()
    assert torch.allclose(mine.running_mean, union.running_mean, atol=1e-6, rtol=0)
    variances = []
    for r, n in enumerate(sizes):
        if n:
            lo = sum(sizes[:r])
            variances.append((n, x[lo:lo + n].var(unbiased=True)))
    want = 0.7 * 1.0 + 0.3 * sum(n * v for n, v in variances) / sum(sizes)
    assert torch.allclose(mine.running_var, torch.tensor([float(want)]), atol=1e-5, rtol=0)
    assert int(mine.num_batches_tracked) == 1
