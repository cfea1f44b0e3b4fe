"""The Stannis summary never adds RAPL's measured joules to modelled ones."""

import math
import time
from types import SimpleNamespace

import pytest

from stannis.trainer import Trainer


def _summary(sources: dict[int, str]) -> dict:
    written: dict = {}
    fake = SimpleNamespace(
        t_train=time.perf_counter() - 2.0, step=10, members=[0, 1], batches=[90, 10],
        totals={0: {"samples": 900, "joules": 300.0, "busy_s": 1.0},
                1: {"samples": 100, "joules": 20.0, "busy_s": 1.0}},
        sources=sources, last_loss=1.0, reducer=SimpleNamespace(payload_bytes=4), buffers=None,
        log=SimpleNamespace(set_attr=lambda key, value: written.update({key: value})),
        run=SimpleNamespace(progress=SimpleNamespace(summary=lambda **kw: None, samples_per_s=10.0),
                            log=SimpleNamespace(path="x.h5"), result={}))
    Trainer._summary(fake, 0.5)
    return written["summary"]


def test_one_source_gives_a_total_and_two_give_none() -> None:
    modelled = _summary({0: "model", 1: "model"})
    assert modelled["energy_sources"] == ["model"]
    assert modelled["joules"] == 320.0
    assert modelled["samples_per_joule"] == pytest.approx(1000 / 320)
    mixed = _summary({0: "rapl", 1: "model"})
    assert mixed["energy_sources"] == ["model", "rapl"]
    assert math.isnan(mixed["joules"]) and math.isnan(mixed["samples_per_joule"])
    # Each rank keeps its own joules, named by their source.
    assert mixed["ranks"][0]["energy_source"] == "rapl" and mixed["ranks"][0]["joules"] == 300.0
