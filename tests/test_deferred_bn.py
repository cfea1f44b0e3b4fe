"""Deferred BatchNorm: running statistics from the whole mini-batch, once a step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpipipe.pipeline.deferred_bn import begin_step, commit_step, defer_batch_norm


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("layer,shape", [(nn.BatchNorm1d, (12, 3)), (nn.BatchNorm2d, (12, 3, 4, 4)),
                                         (nn.BatchNorm3d, (12, 3, 2, 2, 2))])
def test_running_statistics_are_the_full_batchs_and_outputs_the_micro_batches(layer, shape, momentum):
    torch.manual_seed(0)
    deferred = layer(3, momentum=momentum)
    full, micro = copy.deepcopy(deferred), copy.deepcopy(deferred)
    assert defer_batch_norm(nn.Sequential(deferred)) == 1
    for step in range(3):
        x = torch.randn(*shape) * (step + 1) + step
        begin_step(deferred)
        got = torch.cat([deferred(c) for c in x.tensor_split(4)])
        commit_step(deferred)
        full(x)  # torch's BatchNorm on the whole mini-batch: the running statistics
        want = torch.cat([micro(c) for c in x.tensor_split(4)])  # each micro-batch normalized alone
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.allclose(deferred.running_mean, full.running_mean, atol=1e-6, rtol=0)
        assert torch.allclose(deferred.running_var, full.running_var, atol=1e-5, rtol=0)
        assert int(deferred.num_batches_tracked) == int(full.num_batches_tracked) == step + 1
    assert list(deferred.state_dict()) == list(full.state_dict())  # replicas, checkpoints: same names


def test_a_step_started_again_forgets_the_interrupted_one():
    bn = nn.BatchNorm1d(2)
    ref = copy.deepcopy(bn)
    defer_batch_norm(bn)
    x = torch.randn(8, 2)
    begin_step(bn)
    bn(torch.randn(4, 2) * 10)  # the micro-batch of a step a takeover cut short
    begin_step(bn)  # the replay
    bn(x[:4])
    bn(x[4:])
    commit_step(bn)
    ref(x)
    assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6)
    bn.eval()
    assert torch.equal(bn(x), nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias))
