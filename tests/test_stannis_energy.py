"""Energy meters (RAPL with wrap-around, power model) and the CSD emulation."""

from pathlib import Path

import pytest

from stannis.csd import CsdProfile, Stretch, cpu_binding
from stannis.energy import EnergyError, PowerModel, Rapl, make_meter


def _fake_rapl(root: Path, uj: int, max_uj: int = 1_000_000) -> Path:
    d = root / "intel-rapl:0"
    d.mkdir(parents=True, exist_ok=True)
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    sub = root / "intel-rapl:0:0"  # a sub-domain (core), counted inside the package
    sub.mkdir(exist_ok=True)
    (sub / "energy_uj").write_text("5\n")
    (sub / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return d


def test_power_model_charges_idle_all_step_and_active_while_busy() -> None:
    m = PowerModel(idle_w=5.0, active_w=10.0)
    assert m.joules(wall_s=2.0, busy_s=0.5) == pytest.approx(5 * 2 + 5 * 0.5)
    assert m.joules(wall_s=1.0, busy_s=3.0) == pytest.approx(10.0)  # busy capped at wall
    with pytest.raises(EnergyError, match="idle_w"):
        PowerModel(10.0, 5.0)


def test_rapl_reads_packages_only_and_handles_wrap(tmp_path: Path) -> None:
    d = _fake_rapl(tmp_path, 999_000)
    rapl = Rapl.open(tmp_path)
    assert rapl is not None and rapl.domains == [d]
    before = rapl.read_uj()
    (d / "energy_uj").write_text("1000\n")  # wrapped past 1_000_000
    assert rapl.joules_between(before, rapl.read_uj()) == pytest.approx(0.002)


def test_meter_sources(tmp_path: Path) -> None:
    model = PowerModel(1.0, 2.0)
    assert make_meter(model, "auto", root=tmp_path).source == "model"  # nothing readable
    with pytest.raises(EnergyError, match="rapl"):
        make_meter(model, "rapl", root=tmp_path)
    with pytest.raises(EnergyError, match="choose one"):
        make_meter(model, "solar", root=tmp_path)
    d = _fake_rapl(tmp_path, 0)
    host = make_meter(model, "auto", root=tmp_path)
    assert host.source == "rapl"
    # An emulated CSD never reads the host package's counter.
    assert make_meter(model, "auto", emulated=True, root=tmp_path).source == "model"
    host.start()
    (d / "energy_uj").write_text("3000000\n")
    assert host.stop(busy_s=0.0) == pytest.approx(3.0)


class _Clock:
    """A perf_counter the test moves by hand, so the wall time of a step is known exactly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_model_meter_charges_idle_watts_for_the_wall_time_and_active_while_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import stannis.energy

    clock = _Clock()
    monkeypatch.setattr(stannis.energy, "time", clock)
    meter = make_meter(PowerModel(idle_w=5.0, active_w=12.0), "model")
    assert meter.source == "model"
    meter.start()
    clock.now += 2.0
    # 2 s at 5 W, plus 0.5 s busy at the extra 7 W
    assert meter.stop(busy_s=0.5) == pytest.approx(2.0 * 5.0 + 0.5 * 7.0)
    # the next step starts where the last one stopped: 3 s of wall time, busy all of it
    # (a busy time longer than the wall is capped at the wall)
    clock.now += 3.0
    assert meter.stop(busy_s=4.0) == pytest.approx(3.0 * 12.0)
    meter.start()
    clock.now += 0.25
    assert meter.stop(busy_s=0.0) == pytest.approx(0.25 * 5.0)


def test_stretch_sleeps_for_the_extra_time() -> None:
    slept = []
    s = Stretch(8.0, sleep=slept.append)
    assert s.apply(0.01) == pytest.approx(0.08)
    assert slept == [pytest.approx(0.07)]
    s.slow_by(2.0)
    assert s.factor == 16.0
    assert Stretch(1.0, sleep=slept.append).apply(0.5) == 0.5 and len(slept) == 1
    # Time spent waiting for a core counts towards the stretch, not on top of it.
    assert Stretch(4.0, sleep=slept.append).apply(0.01, wall_s=0.03) == pytest.approx(0.04)
    assert slept[-1] == pytest.approx(0.01)
    assert Stretch(2.0, sleep=slept.append).apply(0.01, wall_s=0.05) == pytest.approx(0.05)
    assert len(slept) == 2


def test_stretch_base_is_the_fastest_recent_step_per_sample_at_a_similar_batch() -> None:
    slept = []
    s = Stretch(8.0, sleep=slept.append)
    assert s.apply(0.010, batch=64) == pytest.approx(0.08)
    # Cache interference from a neighbour inflates CPU time; the factor does not multiply it.
    assert s.apply(0.015, wall_s=0.02, batch=64) == pytest.approx(0.08)
    # A batch twice as large is not similar: its own CPU time is the base.
    assert s.apply(0.020, batch=128) == pytest.approx(0.16)
    # A few more samples: the fastest per-sample time at 64 carries over (0.010 * 72 / 64).
    assert s.apply(0.0125, batch=72) == pytest.approx(8 * 0.01125)
    for _ in range(Stretch.MEMORY):
        s.apply(0.012, batch=64)
    assert s.apply(0.012, batch=64) == pytest.approx(0.096)  # the 0.010 step aged out


def test_cpu_binding_separates_csds_from_the_host_when_they_fit() -> None:
    eighth = [1 / 8] * 4
    assert cpu_binding(0, eighth, [0, 1]) == [0]
    assert [cpu_binding(k, eighth, [0, 1]) for k in range(1, 5)] == [[1]] * 4
    assert cpu_binding(0, eighth, range(8)) == [0, 1, 2, 3]
    assert [cpu_binding(k, eighth, range(8)) for k in range(1, 5)] == [[4], [5], [6], [7]]
    assert [cpu_binding(k, eighth, [0, 1, 2]) for k in range(1, 5)] == [[1], [2], [1], [2]]
    # Four CSDs at half speed need two cores of their own: not there, nobody is bound.
    assert cpu_binding(2, [1 / 2] * 4, [0, 1]) == [0, 1]
    assert cpu_binding(0, eighth, [3]) == [3]


def test_csd_profile_checks_and_describes_itself() -> None:
    p = CsdProfile(slowdown=8.0, threads=1, idle_w=5.0, active_w=10.0)
    assert p.describe() == {"slowdown": 8.0, "threads": 1, "idle_w": 5.0, "active_w": 10.0,
                            "emulated": True}
    assert p.power == PowerModel(5.0, 10.0)
    with pytest.raises(ValueError, match="slowdown"):
        CsdProfile(slowdown=0.5)


def _take_turns(path: str, log: str, who: int, barrier) -> None:
    import os as _os
    import time as _time

    from stannis.csd import CoreTurns

    turns = CoreTurns(path)
    barrier.wait()  # everyone has the file open
    if who == 0:
        turns.release_name()
    barrier.wait()
    for _ in range(5):
        with turns:
            fd = _os.open(log, _os.O_WRONLY | _os.O_APPEND)
            _os.write(fd, f"in {who}\n".encode())
            _time.sleep(0.002)  # a neighbour inside the lock now would interleave
            _os.write(fd, f"out {who}\n".encode())
            _os.close(fd)


def test_csds_sharing_a_core_take_turns_and_leave_no_file(tmp_path: Path) -> None:
    import multiprocessing as mp

    from stannis.csd import CoreTurns

    path = CoreTurns.name(f"test-{tmp_path.name}", [1])
    log = tmp_path / "turns.log"
    log.write_text("")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_take_turns, args=(path, str(log), i, barrier))
             for i in range(3)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:  # none left running (a non-daemon child would keep pytest from exiting)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    lines = log.read_text().split()
    events = [" ".join(lines[i:i + 2]) for i in range(0, len(lines), 2)]
    assert len(events) == 30
    for enter, leave in zip(events[0::2], events[1::2], strict=True):
        assert enter.startswith("in ") and leave == "out " + enter[3:]  # never interleaved
    assert not Path(path).exists()
    with CoreTurns(None):  # a rank with its own core: no lock at all
        pass
