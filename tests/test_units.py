"""Rates and durations as users write them (mpipipe.core.units)."""

from __future__ import annotations

import pytest

from mpipipe.core.units import format_rate, parse_duration, parse_link_rate, parse_rate


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("20m", 1200), ("30min", 1800), ("1h", 3600), ("50ms", 0.05),
                                           ("2d", 172800), ("12", 12), ("0.5h", 1800), ("h", 3600)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, per_s", [("1/30min", 1 / 1800), ("2/h", 2 / 3600), ("0.5/min", 1 / 120),
                                         ("0.01", 0.01), ("0", 0.0), ("1/90s", 1 / 90)])
def test_rates(text, per_s):
    assert parse_rate(text) == pytest.approx(per_s)


@pytest.mark.parametrize("text, mbit", [("100mbit", 100), ("1gbit", 1000), ("500kbit", 0.5),
                                        ("20", 20), ("100Mbit/s", 100), ("10mbps", 10)])
def test_link_rates(text, mbit):
    assert parse_link_rate(text) == pytest.approx(mbit)


@pytest.mark.parametrize("parse, text, says", [
    (parse_rate, "often", "is not a rate"), (parse_rate, "1/fortnight", "is not a rate"),
    (parse_rate, "-1", "cannot be negative"), (parse_duration, "0s", "must be positive"),
    (parse_duration, "soon", "is not a duration"), (parse_link_rate, "fast", "is not a link rate"),
    (parse_link_rate, "0mbit", "must be positive")])
def test_bad_values_are_named_with_the_forms_accepted(parse, text, says):
    with pytest.raises(ValueError, match=says):
        parse(text)


def test_a_rate_prints_as_one_event_per_interval():
    assert [format_rate(r) for r in (0, 1 / 1800, 1 / 60, 1 / 12, 2 / 86400)] == \
        ["none", "1/30min", "1/1min", "1/12s", "1/12h"]
