"""The Stannis summary never adds RAPL's measured joules to modelled ones."""

import math

import pytest

from stannis.figures import run_summary


def _summary(sources: dict[int, str]) -> dict:
    totals = {0: {"samples": 900, "joules": 300.0, "busy_s": 1.0},
              1: {"samples": 100, "joules": 20.0, "busy_s": 1.0}}
    return run_summary(totals, sources, elapsed=2.0, steps=10, samples_per_s=10.0, accuracy=0.5,
                       loss=1.0, final_batches={0: 90, 1: 10}, grad_bytes=4, buffer_bytes=0)


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
