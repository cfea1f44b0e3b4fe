"""The cost model of interleaved 1F1B: every chunk boundary carries bytes, a stage's
replica carries all its chunks (measured against runs in tests/test_respipe_runs.py)."""

from __future__ import annotations

import torch

from mpipipe.core.run.models import build_model
from mpipipe.pipeline.partition import StageChunks, split, stage_modules
from mpipipe.respipe import costmodel


def _SGD(module):  # noqa: N802 - the optimizer each stage builds, from its module
    return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9) if list(module.parameters()) else None


def _lenet():
    torch.manual_seed(0)
    return build_model("lenet", 10, (1, 8, 8))


def test_stage_shapes_group_chunks_by_rank_and_count_every_boundary():
    model = _lenet()
    chunks = split(model, [2] * 6)
    flat, in_bytes = costmodel.stage_shapes(chunks, (1, 8, 8), _SGD)  # 6 stages
    grouped, same_in = costmodel.stage_shapes(chunks, (1, 8, 8), _SGD, stages=3)
    assert in_bytes == same_in == 8 * 8 * 4
    # a pipeline's stage modules (StageChunks) give the same figures as the chunks
    modules = stage_modules(chunks, 3)
    assert all(isinstance(m, StageChunks) for m in modules)
    assert costmodel.stage_shapes(modules, (1, 8, 8), _SGD)[0] == grouped
    for s in range(3):
        assert grouped[s].chunk_acts == (flat[s].act_out, flat[s + 3].act_out)
        assert grouped[s].params == flat[s].params + flat[s + 3].params
    assert grouped[2].chunk_acts[-1] == 0  # the last chunk sends nothing forward
    # the plain pipeline's bytes: all 5 chunk boundaries, forward and back
    batch = 32
    cost = costmodel.predict(grouped, batch_size=batch, label_bytes=8)
    assert cost.pipeline == 2 * batch * sum(s.act_out for s in flat)
    assert cost.pipeline == costmodel.predict(flat, batch_size=batch).pipeline


def test_link_bytes_of_interleaved_wrap_from_the_last_rank_to_the_first():
    chunks = split(_lenet(), [3] * 4)
    flat, _ = costmodel.stage_shapes(chunks, (1, 8, 8), _SGD)
    grouped, _ = costmodel.stage_shapes(chunks, (1, 8, 8), _SGD, stages=2)
    batch = 16
    links = costmodel.predict(grouped, batch_size=batch, backups={1: 1}, label_bytes=8).links
    a = [batch * s.act_out for s in flat]  # chunk c -> c + 1 (rank c % 2 -> (c + 1) % 2)
    # rank 0: activations of chunks 0 and 2, the gradient into chunk 1 (from chunk 2), labels
    sent0 = a[0] + a[2] + a[1] + 8 * batch
    assert links["stage 0"][0] == sent0
    # rank 1: chunk 1's activation, the gradients into chunks 0 and 2, stage 1's replica
    assert links["stage 1"][0] == a[1] + a[0] + a[2] + grouped[1].replica
    total = costmodel.predict(grouped, batch_size=batch, backups={1: 1}, label_bytes=8).total
    assert sum(sent for sent, _ in links.values()) == total
