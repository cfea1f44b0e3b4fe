"""node-kill and partition specs without a testbed: parsing, who fires them, the start-up
refusal off a testbed, and a dry plan (the Stannis host's log of other ranks' faults).
The faults themselves run on a real testbed in tests/cluster/test_node_faults.py."""

from __future__ import annotations

import pytest

from mpipipe.core.mpi import faults as inject
from mpipipe.core.mpi.faults import FaultError, FaultPlan, check_nodes, firing_rank, parse


@pytest.mark.parametrize("spec, text", [
    ("node-kill:node=b:step=5", "node-kill:node=b:step=5"),
    ("node-kill:node=mpt-b:step=5", "node-kill:node=b:step=5"),
    ("partition:node=c2:step=3", "partition:node=c2:step=3:seconds=10"),
    ("partition:node=c:step=3:seconds=2.5", "partition:node=c:step=3:seconds=2.5"),
])
def test_node_specs_parse_to_the_bare_node_name(spec: str, text: str) -> None:
    assert str(parse(spec)) == text
    assert str(parse(str(parse(spec)))) == text  # what the log shows parses back the same


@pytest.mark.parametrize("spec, why", [
    ("node-kill:step=5", "missing node"),
    ("node-kill:node=b", "missing step"),
    ("node-kill:node=b:stage=1:step=5", "unknown key 'stage' for node-kill (allowed: node, step)"),
    ("partition:node=b:rank=1:step=5", "unknown key 'rank' for partition (allowed: node, seconds, step)"),
    ("node-kill:node=b:step=5:seconds=1", "unknown key 'seconds' for node-kill"),
    ("node-kill:node=9b:step=5", "node='9b' is not a testbed node name"),
    ("partition:node=b:step=5:seconds=0", "seconds must be > 0"),
    ("kill:node=b:step=5", "unknown key 'node' for kill"),
])
def test_bad_node_specs_are_one_line_with_an_example(spec: str, why: str) -> None:
    with pytest.raises(FaultError) as e:
        parse(spec)
    assert why in str(e.value) and "(e.g. " in str(e.value) and "\n" not in str(e.value)


def test_the_lowest_rank_on_the_node_fires() -> None:
    hosts = ["mpt-a", "mpt-c", "mpt-b", "mpt-c"]
    assert firing_rank("c", hosts) == 1
    assert firing_rank("b", hosts) == 2
    assert firing_rank("d", hosts) is None
    f = parse("node-kill:node=c:step=2")
    mine = [r for r in range(4) if FaultPlan([f], seed=0, stage=None, rank=r, hosts=hosts).mine]
    assert mine == [1]


def test_a_node_fault_off_a_testbed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inject, "_hosts", None)
    with pytest.raises(FaultError, match=r"^fault node-kill:node=b:step=5: the ranks run on host1, "
                                         r"not on the nodes of a testbed that is up; .*it would never fire$"):
        check_nodes([parse("kill:stage=0:step=1"), parse("node-kill:node=b:step=5")], ["host1", "host1"])
    check_nodes([parse("kill:stage=0:step=1")], ["host1"])  # no node fault: nothing to check


def test_a_dry_plan_logs_a_node_fault_and_does_nothing() -> None:
    fired = []
    plan = FaultPlan([parse("node-kill:node=b:step=3"), parse("partition:node=b:step=4:seconds=9")],
                     seed=0, stage=None, rank=1, hosts=["mpt-a", "mpt-b"], dry=True,
                     on_fire=lambda f, step, detail: fired.append((str(f), step)),
                     sleep=lambda s: pytest.fail("a dry plan sleeps"),
                     kill=lambda: pytest.fail("a dry plan kills"))
    for step in range(6):
        assert plan.at_step(step) == 0.0
    assert fired == [("node-kill:node=b:step=3", 3), ("partition:node=b:step=4:seconds=9", 4)]


def test_a_node_fault_on_the_stannis_host_node_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import mpipipe.pipeline.plan  # noqa: F401 - declares the stage, backup and spare role kinds
    import stannis.config  # noqa: F401 - declares the host and csd role kinds
    from mpipipe.core.mpi import testbed_nodes
    from mpipipe.core.mpi.roles import LaunchPlan, Role

    monkeypatch.setattr(testbed_nodes, "node_hosts", lambda: frozenset("mpt-" + n for n in ("host", "csd1")))
    plan = LaunchPlan((Role("host"), Role("csd", 1)))
    hosts = ["mpt-host", "mpt-csd1"]
    with pytest.raises(FaultError, match=r"^fault node-kill:node=host:step=5: node mpt-host runs the "
                                         r"host \(rank 0\), which no run survives losing; aim it at a "
                                         r"node of CSD ranks only$"):
        check_nodes([parse("node-kill:node=host:step=5")], hosts, plan)
    check_nodes([parse("node-kill:node=csd1:step=5")], hosts, plan)  # a CSD's node: fine


def test_stannis_takes_a_node_kill_and_refuses_a_partition() -> None:
    from mpipipe.core.mpi.roles import PlanError
    from mpipipe.core.run.configfile import load_config
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    cfg = load_config(None, ['stannis.inject=["node-kill:node=csd1:step=5"]'], STANNIS_DEFAULTS)
    assert stannis_plan(cfg, 5).world_size == 5
    cfg = load_config(None, ['stannis.inject=["partition:node=csd1:step=5"]'], STANNIS_DEFAULTS)
    with pytest.raises(PlanError, match=r"^fault partition:node=csd1:step=5:seconds=10: Stannis finds a "
                                        r"lost CSD by ULFM only .*use node-kill:node=csd1:step=5$"):
        stannis_plan(cfg, 5)


def test_a_spare_rank_never_fires_a_node_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    import mpipipe.pipeline.plan  # noqa: F401 - declares the stage, backup and spare role kinds
    from mpipipe.core.mpi import testbed_nodes
    from mpipipe.core.mpi.roles import LaunchPlan, Role

    monkeypatch.setattr(testbed_nodes, "node_hosts", lambda: frozenset("mpt-" + n for n in ("a", "b")))
    plan = LaunchPlan((Role("stage", 0), Role("stage", 1), Role("spare", 0)))
    check_nodes([parse("node-kill:node=a:step=5")], ["mpt-a", "mpt-b", "mpt-a"], plan)
    assert firing_rank("a") == 0
    with pytest.raises(FaultError, match=r"^fault node-kill:node=b:step=5: no rank but spare ones runs on "
                                         r"node mpt-b \(the ranks run on mpt-a, mpt-b\); it would never fire$"):
        check_nodes([parse("node-kill:node=b:step=5")], ["mpt-a", "mpt-a", "mpt-b"], plan)


def test_a_relaunch_can_be_kept_to_some_testbed_nodes_in_order() -> None:
    """run_mpi(nodes=...): mpirun's --host picks the nodes (a spare for a dead one), with their slots."""
    import ipaddress

    from mpipipe.tools.emulator import Node, Testbed, TestbedError
    from mpipipe.tools.launch import mpirun_command

    bed = Testbed((Node("a", 0.5, 100), Node("b", 0.5, 100), Node("c", 0.5, 100, slots=2)),
                  ipaddress.IPv4Network("10.213.0.0/24"))
    cmd = mpirun_command(3, "-m", "x", testbed=bed, nodes=["c", "mpt-a"])
    assert cmd[cmd.index("--host") + 1] == "mpt-c:2,mpt-a:1"
    assert "--hostfile" in cmd and "--oversubscribe" not in cmd
    assert "--host" not in mpirun_command(3, "-m", "x", testbed=bed)
    with pytest.raises(TestbedError, match="no node 'd'"):
        mpirun_command(3, "-m", "x", testbed=bed, nodes=["d"])
    with pytest.raises(TestbedError, match="give the testbed"):
        mpirun_command(3, "-m", "x", nodes=["a"])


def test_a_node_quota_runs_in_short_slices_unless_under_the_kernel_minimum() -> None:
    """10 ms periods (a node at 0.28 core stalled up to 72 ms at a time with 100 ms ones);
    under 0.1 core a 10 ms period would need a quota under the kernel's 1 ms."""
    from mpipipe.tools.emulator import period_us

    assert period_us(0.5) == period_us(0.125) == period_us(0.1) == 10_000
    assert period_us(0.05) == period_us(0.01) == 100_000
    assert all(period_us(c) * c >= 1000 for c in (0.01, 0.05, 0.099, 0.1, 0.125, 1.0, 2.0))


def test_a_link_bucket_holds_a_millisecond_of_traffic_and_two_frames() -> None:
    """Whatever fits in the token bucket crosses the link at once, so it stays small."""
    from mpipipe.tools.emulator import FRAME_BYTES, burst_bytes

    assert burst_bytes(1000) == 125_000 and burst_bytes(100) == 12_500
    assert burst_bytes(20) == burst_bytes(1) == 2 * FRAME_BYTES


@pytest.mark.parametrize("specs, why", [
    # a rank's fault after its node was killed
    (["node-kill:node=a:step=2", "kill:stage=0:step=19"], "its rank 0 is ended before, by "
                                                          "node-kill:node=a:step=2"),
    # a second node fault on a node already ended (by a kill or a partition)
    (["node-kill:node=a:step=9", "node-kill:node=a:step=11"], "ended before, by node-kill:node=a"),
    (["partition:node=b:step=3:seconds=2", "stall:stage=1:step=8"], "its rank 1 is ended before"),
    # a node fault whose firing rank (the node's lowest) was killed before
    (["kill:stage=0:step=4", "partition:node=a:step=6"], "its rank 0 is ended before, by "
                                                         "kill:stage=0:step=4"),
    (["kill:rank=1:step=4:round=1", "node-kill:node=b:step=9"], "its rank 1 is ended before"),
])
def test_a_fault_a_node_fault_ends_first_is_refused(monkeypatch: pytest.MonkeyPatch, specs, why) -> None:
    import mpipipe.pipeline.plan  # noqa: F401 - declares the stage, backup and spare role kinds
    from mpipipe.core.mpi import testbed_nodes
    from mpipipe.core.mpi.roles import LaunchPlan, Role

    monkeypatch.setattr(testbed_nodes, "node_hosts", lambda: frozenset("mpt-" + n for n in ("a", "b")))
    # ranks 0, 3 on a; 1, 2 on b (node b's lowest rank, 1, fires its faults)
    plan = LaunchPlan((Role("stage", 0), Role("stage", 1), Role("backup", 1), Role("backup", 0)))
    hosts = ["mpt-a", "mpt-b", "mpt-b", "mpt-a"]
    with pytest.raises(FaultError, match=why):
        check_nodes([parse(s) for s in specs], hosts, plan)
    # faults in an order where each can fire pass (rank 3 is not the one that fires a's)
    check_nodes([parse("kill:rank=3:step=19"), parse("node-kill:node=a:step=20")], hosts, plan)
    check_nodes([parse("stall:stage=1:step=2"), parse("partition:node=b:step=3")], hosts, plan)
