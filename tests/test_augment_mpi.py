"""Augmentation under ResPipe's failures (issue 27, part 3), under mpirun with ULFM and real kills.

A backup that takes over the first stage opens its own reader, seeks to the step and
replays the batches the dead stage had read: with random crops and flips on, it must
read the very same augmented samples (each a pure function of (seed, epoch, record)),
so the run stays the failure-free run's, losses and parameters (1e-5), as
tests/test_chaos_found.py holds the plain data to. Nothing here asserts a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs import checkpoint_tensors, completed_once, make_runs

# make test-long (.ci/run runs it): augmentation under kills, exact against its failure-free run.
pytestmark = pytest.mark.long

STEPS = 30
ALL = 'resilience.backups="all"'
AUGMENT = ('data.augment=["random_crop:1","hflip"]', "data.mean=[0.5]", "data.std=[0.25]")


@pytest.fixture(scope="module")
def runs(respipe_args, tmp_path_factory):
    """run(name, ranks, *settings) -> (CompletedProcess, log, checkpoint dir)."""
    return make_runs(respipe_args, tmp_path_factory.mktemp("augment-mpi"), STEPS)


def _state(ckpt: Path) -> list[torch.Tensor]:
    return checkpoint_tensors(ckpt)


def _completed_once(result, log: Path) -> object:
    return completed_once(result, log, STEPS)


def _failure_free(runs) -> tuple[object, Path]:
    """The plain pipeline (3 ranks, no backups, no ULFM) with the same augmentation."""
    result, log, ckpt = runs("plain-augmented", 3, "resilience.backups={}", *AUGMENT, ulfm=False)
    return _completed_once(result, log), ckpt


@pytest.mark.timeout(600)
def test_augmentation_is_on_in_the_failure_free_run(runs):
    """Guards the test below against passing vacuously: the augmented run's losses are
    not those of the same run without augmentation, and its log keeps the ops."""
    run, _ = _failure_free(runs)
    assert run.config["data"]["augment"] == ["random_crop:1", "hflip"]
    assert run.config["data"]["mean"] == [0.5] and run.config["data"]["std"] == [0.25]
    result, log, _ = runs("plain-unaugmented", 3, "resilience.backups={}", ulfm=False)
    bare = _completed_once(result, log)
    assert max(abs(float(a) - float(b)) for a, b in zip(run.steps["loss"], bare.steps["loss"], strict=True)) > 1e-4


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,kill", [
    # the reading stage: its backup opens a reader, seeks to the step and replays it
    ("reader-killed", "inject:kill:stage=0:step=12"),
    # mid-step, in the middle stage: the first stage replays the step from its cache
    ("middle-killed-mid-step", "inject:kill:stage=1:step=9:micro=2"),
])
def test_a_kill_under_cold_r1_with_augmentation_stays_exact(runs, name, kill):
    result, log, ckpt = runs(name, 6, ALL, "resilience.replicate_every=1", *AUGMENT, kill)
    run = _completed_once(result, log)
    assert run.events_of("takeover"), "the kill caused no takeover"
    plain, plain_ckpt = _failure_free(runs)
    want = plain.steps["loss"]
    assert max(abs(float(a) - float(b)) for a, b in zip(run.steps["loss"], want, strict=True)) <= 1e-5
    got, ref = _state(ckpt), _state(plain_ckpt)
    assert len(got) == len(ref) > 0
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, atol=1e-5, rtol=0)
