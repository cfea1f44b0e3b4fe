"""Which cores each testbed node runs on (no root needed: nothing is brought up here).
The pinning itself, inside real nodes, is checked in tests/cluster/test_testbed.py."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from mpipipe.tools import emulator
from mpipipe.tools.emulator import Node, Testbed, TestbedError

ROOT = Path(__file__).resolve().parents[1]
SUBNET = ipaddress.IPv4Network("10.213.0.0/24")


@pytest.fixture(autouse=True)
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulator.os, "cpu_count", lambda: 2)


def _file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "bed.toml"
    path.write_text('subnet = "10.213.0.0/24"\n' + body)
    return path


def test_equal_nodes_alternate_over_the_cores() -> None:
    bed = Testbed(tuple(Node(f"n{i}", 0.28, 100.0) for i in range(7)), SUBNET)
    assert [bed.cores()[f"n{i}"] for i in range(7)] == [(0,), (1,), (0,), (1,), (0,), (1,), (0,)]


def test_the_stannis_host_gets_a_core_and_the_csds_share_the_other() -> None:
    cores = emulator.load(ROOT / "jobs" / "testbed" / "stannis-csd.toml").cores()
    assert cores == {"host": (0,), "csd1": (1,), "csd2": (1,), "csd3": (1,), "csd4": (1,)}


def test_the_phone_testbed_fills_both_cores_exactly() -> None:
    bed = emulator.load(ROOT / "jobs" / "testbed" / "respipe-phones.toml")
    cores = bed.cores()
    share = {0: 0.0, 1: 0.0}
    for n in bed.nodes:
        share[cores[n.name][0]] += n.cpu
    assert share == {0: 1.0, 1: 1.0}


def test_a_node_of_more_than_a_core_gets_as_many_cores_as_it_needs() -> None:
    bed = Testbed((Node("big", 1.5, 100.0), Node("small", 0.25, 100.0)), SUBNET)
    assert bed.cores() == {"big": (0, 1), "small": (0,)}


def test_named_cores_are_kept_and_counted_before_the_others_are_placed(tmp_path: Path) -> None:
    bed = emulator.load(_file(tmp_path, "[nodes.a]\ncpu = 0.5\nlink_mbit = 100\ncores = [1]\n"
                                       "[nodes.b]\ncpu = 0.5\nlink_mbit = 100\n"
                                       "[nodes.c]\ncpu = 0.25\nlink_mbit = 100\n"))
    assert bed.nodes[0].cores == (1,)
    assert bed.cores() == {"a": (1,), "b": (0,), "c": (0,)}
    # what the state directory keeps compares equal to what the file gave
    assert Testbed.from_json(bed.to_json()) == bed


@pytest.mark.parametrize("cores, cpu, why", [
    ("[2]", 0.5, "distinct core numbers from 0 to 1"),
    ("[0, 0]", 0.5, "distinct core numbers"),
    ("[-1]", 0.5, "distinct core numbers"),
    ('"0"', 0.5, "must be a list"),
    ("[true]", 0.5, "must be a list"),
    ("[0]", 1.5, "cannot run on 1 core"),
])
def test_bad_cores_are_one_line_naming_the_node(tmp_path: Path, cores: str, cpu: float, why: str) -> None:
    path = _file(tmp_path, f"[nodes.a]\ncpu = {cpu}\nlink_mbit = 100\ncores = {cores}\n")
    with pytest.raises(TestbedError, match="nodes.a") as err:
        emulator.load(path)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_a_node_built_in_code_with_cores_the_machine_lacks_is_refused() -> None:
    bed = Testbed((Node("a", 0.5, 100.0, cores=(3,)),), SUBNET)  # the machine has 0 and 1
    with pytest.raises(TestbedError, match="node a") as err:
        bed.cores()
    assert "distinct core numbers from 0 to 1" in str(err.value)
