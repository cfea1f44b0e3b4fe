"""Unit tests of ResPipe's pure parts: fault specs, the cost model, ULFM detection.

The round's decision (patience, going on) and its messages have their own files:
tests/test_respipe_decide.py and tests/test_respipe_messages.py.
"""

from __future__ import annotations

import pytest
import torch

from mpipipe.core.mpi import faults as inject
from mpipipe.core.mpi import ft
from mpipipe.cost import format_table
from mpipipe.respipe import costmodel
from mpipipe.respipe.costmodel import StageShape

# -- fault specs ------------------------------------------------------------------------------

def test_parse_each_kind():
    assert inject.parse("kill:stage=1:step=20") == inject.Fault("kill", stage=1, step=20)
    s = inject.parse("stall:stage=2:step=5:seconds=3")
    assert (s.kind, s.stage, s.step, s.seconds) == ("stall", 2, 5, 3.0)
    assert inject.parse("stall:stage=0:step=1").seconds == inject.DEFAULT_STALL_S
    d = inject.parse("delay:stage=1:p=0.1:seconds=0.5")
    assert (d.p, d.seconds, d.step) == (0.1, 0.5, 0)
    w = inject.parse(" SLOW : rank=3 : step=2 : factor=2.5 ")
    assert (w.kind, w.rank, w.stage, w.factor) == ("slow", 3, None, 2.5)


def test_str_round_trips():
    for spec in ("kill:stage=1:step=20", "stall:stage=2:step=5:seconds=3",
                 "delay:stage=1:p=0.1:seconds=0.5", "slow:rank=3:step=2:factor=2.5"):
        f = inject.parse(spec)
        assert inject.parse(str(f)) == f


@pytest.mark.parametrize("spec, words", [
    ("", "empty"),
    ("explode:stage=1", "unknown fault kind"),
    ("kill:stage=1", "missing step"),
    ("kill:step=3", "exactly one target"),
    ("kill:stage=1:rank=2:step=3", "exactly one target"),
    ("kill:stage=one:step=3", "not an integer"),
    ("kill:stage=1:step=3:colour=red", "unknown key 'colour'"),
    ("kill:stage=1:step=3:step=4", "given twice"),
    ("kill:stage=1:step", "not key=value"),
    ("delay:stage=1:p=1.5:seconds=1", "probability"),
    ("delay:stage=1:p=0.5:seconds=-1", "seconds must be >= 0"),
    ("slow:rank=1:factor=0.5", "factor must be >= 1"),
    ("kill:stage=-1:step=2", "stage must be >= 0"),
])
def test_bad_specs_say_what_and_show_an_example(spec, words):
    with pytest.raises(inject.FaultError) as e:
        inject.parse(spec)
    assert words in str(e.value)
    assert "e.g." in str(e.value)


def test_plan_fires_once_and_only_for_its_target():
    slept, fired, killed = [], [], []
    faults = inject.parse_all(["stall:stage=1:step=2:seconds=4", "kill:stage=2:step=3"])
    plan = inject.FaultPlan(faults, seed=0, stage=1, rank=1, sleep=slept.append,
                            on_fire=lambda f, s, d: fired.append((f.kind, s)),
                            kill=lambda: killed.append(1))
    for step in range(5):
        plan.at_step(step)
    plan.at_step(2)  # a replayed step does not stall again
    assert slept == [4.0] and fired == [("stall", 2)] and not killed
    other = inject.FaultPlan(faults, seed=0, stage=2, rank=2, sleep=slept.append,
                             kill=lambda: killed.append(1))
    other.at_step(3)
    assert killed == [1]


def test_delays_are_seeded_and_repeatable():
    faults = [inject.parse("delay:stage=0:p=0.3:seconds=1")]

    def draws(seed):
        out = []
        plan = inject.FaultPlan(faults, seed=seed, stage=0, rank=0, sleep=out.append)
        return [plan.at_step(s) for s in range(200)]

    a, b, c = draws(1), draws(1), draws(2)
    assert a == b and a != c
    assert 30 <= sum(1 for x in a if x) <= 90  # about p * 200
    slept = []
    plan = inject.FaultPlan(faults, seed=1, stage=0, rank=0, sleep=slept.append)
    delayed = next(s for s in range(200) if plan.at_step(s))
    assert plan.at_step(delayed) == 0.0  # a replayed step does not straggle again


def test_slowdown():
    faults = inject.parse_all(["slow:stage=1:step=4:factor=3", "kill:stage=1:step=9"])
    plan = inject.FaultPlan(faults, seed=0, stage=1, rank=5, kill=lambda: None)
    assert plan.slowdown(3) == 1.0 and plan.slowdown(4) == 3.0
    assert inject.FaultPlan(faults, seed=0, stage=2, rank=5).slowdown(10) == 1.0


# -- cost model -------------------------------------------------------------------------------

STAGES = [StageShape(act_out=400, params=1000, state=1000),
          StageShape(act_out=100, params=4000, state=4000),
          StageShape(act_out=0, params=500, state=500)]


def test_plain_pipeline_bytes():
    c = costmodel.predict(STAGES, batch_size=8)
    assert c.pipeline == 2 * 8 * (400 + 100)
    assert c.total == c.plain and c.replica == c.shadow == 0 and c.lost_updates == 0
    assert costmodel.predict(STAGES, batch_size=8, label_bytes=8).labels == 64


def test_replica_bytes_scale_with_one_over_r():
    r1 = costmodel.predict(STAGES, batch_size=8, backups={1: 1}, replicate_every=1)
    r10 = costmodel.predict(STAGES, batch_size=8, backups={1: 1}, replicate_every=10)
    assert r1.replica == 8000 and r10.replica == 800
    assert (r1.lost_updates, r10.lost_updates) == (0, 9)
    two = costmodel.predict(STAGES, batch_size=8, backups={1: 2, 2: 1}, replicate_every=1)
    assert two.replica == 2 * 8000 + 1000


def test_hot_adds_the_relayed_streams_and_loses_nothing():
    hot = costmodel.predict(STAGES, batch_size=8, backups={1: 1}, replicate_every=10, mode="hot")
    assert hot.shadow == 8 * (400 + 100) and hot.lost_updates == 0
    first = costmodel.predict(STAGES, batch_size=8, backups={0: 1}, replicate_every=10, mode="hot")
    assert first.shadow == 8 * 400  # no input bytes given
    first = costmodel.predict(STAGES, batch_size=8, backups={0: 1}, mode="hot", input_bytes=256)
    assert first.shadow == 8 * (256 + 400)  # stage 0 relays the data it reads
    last = costmodel.predict(STAGES, batch_size=8, backups={2: 1}, replicate_every=10, mode="hot")
    assert last.shadow == 8 * 100  # the last stage's backup computes its own loss


@pytest.mark.parametrize("mode", ["cold", "hot", "neighbour"])
def test_link_bytes_put_each_payload_on_its_two_ends_and_add_up_to_predict(mode):
    kw = dict(batch_size=8, backups={0: 1, 1: 2, 2: 1}, replicate_every=10, mode=mode,
              label_bytes=8, input_bytes=256)
    cost = costmodel.predict(STAGES, **kw)
    links, total = cost.links, cost.total
    assert sum(sent for sent, _ in links.values()) == pytest.approx(total)
    assert sum(got for _, got in links.values()) == pytest.approx(total)
    # Stage 1 sends 8 x 100 forward and 8 x 400 of gradients back, plus its replicas.
    if mode == "neighbour":
        assert set(links) == {"stage 0", "stage 1", "stage 2"}
        # Stage 0 holds stage 1's replica, stage 1 those of stages 0 and 2.
        assert links["stage 1"] == (8 * 100 + 8 * 400 + 8000 / 10,
                                    8 * 400 + 8 * 100 + 2000 / 10 + 1000 / 10)
        assert links["stage 0"][1] == 8 * 400 + 8000 / 10
    else:
        assert set(links) == {"stage 0", "stage 1", "stage 2", "backup 0.0", "backup 1.0",
                              "backup 1.1", "backup 2.0"}
        shadow = 8 * (400 + 100) if mode == "hot" else 0
        assert links["backup 1.1"] == (0.0, 8000 / 10 + shadow)


def test_step_seconds_is_compute_plus_the_busiest_direction_at_the_link_rate():
    links = {"stage 0": (1e6, 2.5e6), "stage 1": (2e6, 0.5e6)}
    assert costmodel.step_seconds(links, link_mbit=20, compute_s=0.1) == pytest.approx(0.1 + 1.0)
    assert costmodel.step_seconds({}, link_mbit=20, compute_s=0.1) == 0.1
    # Overlapped: the exposed bytes add to compute; the rest counts once a link outlasts the step.
    assert costmodel.step_seconds(links, link_mbit=20, compute_s=0.1, exposed=0.25e6) == pytest.approx(1.0)
    assert costmodel.step_seconds(links, link_mbit=20, compute_s=1.5, exposed=0.25e6) == \
        pytest.approx(1.5 + 0.1)
    with pytest.raises(ValueError, match="link_mbit"):
        costmodel.step_seconds(links, link_mbit=0, compute_s=0.1)
    with pytest.raises(ValueError, match="exposed"):
        costmodel.step_seconds(links, link_mbit=20, compute_s=0.1, exposed=-1.0)


def test_a_step_waits_for_one_micro_batch_per_boundary_and_direction():
    # STAGES' boundaries carry act_out bytes per sample; 4 micro-batches of 8 samples
    per_boundary = [2 * 8 * s.act_out for s in STAGES[:-1]]
    assert costmodel.exposed_bytes(STAGES, batch_size=32, chunks=4) == pytest.approx(sum(per_boundary))
    # one micro-batch: the whole step's activations and gradients wait (the plain total)
    plain = costmodel.predict(STAGES, batch_size=32).plain
    assert costmodel.exposed_bytes(STAGES, batch_size=32, chunks=1) == pytest.approx(plain)
    with pytest.raises(ValueError, match="chunks"):
        costmodel.exposed_bytes(STAGES, batch_size=32, chunks=0)


def test_each_steps_exact_bytes_put_every_replica_on_the_multiples_of_r():
    c = costmodel.predict(STAGES, batch_size=8, backups={1: 2, 2: 1}, replicate_every=10,
                          mode="hot", label_bytes=8)
    base = 2 * 8 * (400 + 100) + 64 + c.shadow
    assert c.replica_round == 2 * 8000 + 1000
    assert [c.at_step(s) for s in (1, 9, 10, 11, 20)] == \
        [base, base, base + 17000, base, base + 17000]
    assert sum(c.at_step(s) for s in range(1, 21)) == 20 * c.total
    plain = costmodel.predict(STAGES, batch_size=8)
    assert {plain.at_step(s) for s in range(1, 4)} == {plain.total}


def test_neighbour_holds_one_replica_per_stage():
    n = costmodel.predict(STAGES, batch_size=8, backups={1: 3}, replicate_every=2, mode="neighbour")
    assert n.replica == 4000 and n.shadow == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode"):
        costmodel.predict(STAGES, batch_size=8, backups={1: 1}, mode="warm")
    with pytest.raises(ValueError, match="replicate_every"):
        costmodel.predict(STAGES, batch_size=8, backups={1: 1}, replicate_every=0)
    with pytest.raises(ValueError, match="stage 7"):
        costmodel.predict(STAGES, batch_size=8, backups={7: 1})


def test_a_replica_is_the_whole_state_byte_for_byte():
    # parameters 60 floats (2 tensors) + BatchNorm's mean, var (2 x 10 floats) and count
    # (int64); momentum one float per parameter; Adam two, and a float32 step per tensor
    from torch import nn

    from mpipipe.core.state.statecodec import state_nbytes

    m = nn.Sequential(nn.Linear(5, 10), nn.BatchNorm1d(10))
    params, bn = 4 * (50 + 10 + 10 + 10), 4 * 20 + 8
    assert state_nbytes(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) == 2 * params + bn
    assert state_nbytes(m, torch.optim.SGD(m.parameters(), lr=0.1)) == params + bn
    assert state_nbytes(m, torch.optim.Adam(m.parameters())) == 3 * params + 4 * 4 + bn


def test_trade_off_table_over_r():
    rows = costmodel.trade_off(STAGES, batch_size=8, backups={1: 1}, rs=(1, 10))
    assert [(r["mode"], r["R"]) for r in rows] == [("cold", 1), ("cold", 10), ("hot", 1), ("hot", 10)]
    assert rows[0]["overhead"] > rows[1]["overhead"]
    text = format_table(rows)
    assert "max lost updates" in text and len(text.splitlines()) == 5


# -- ULFM detection ---------------------------------------------------------------------------

def test_ulfm_enabled_reads_open_mpi_environment():
    assert ft.ulfm_enabled({"OMPI_MCA_mpi_ft_enable": "1"})
    assert not ft.ulfm_enabled({})
    assert "ULFM off" in ft.startup_note(False) and "ULFM on" in ft.startup_note(True)


def test_error_class_of_non_mpi_errors_is_none():
    assert ft.error_class(ValueError("x")) is None
    assert not ft.is_proc_failed(ValueError("x")) and not ft.is_revoked(ValueError("x"))


def test_cost_command_prints_the_trade_off_over_r(capsys):
    import json
    from pathlib import Path

    from mpipipe.__main__ import main

    config = str(Path(__file__).resolve().parents[1] / "jobs" / "configs" / "respipe-digits.toml")
    assert main(["cost", "--config", config, "--in-shape", "1,8,8", "--r", "1,10",
                 "--modes", "cold,hot", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["mode"], r["R"]): r for r in out["rows"]}
    assert set(rows) == {("cold", 1), ("cold", 10), ("hot", 1), ("hot", 10)}
    assert rows[("cold", 10)]["lost_updates"] == 9 and rows[("hot", 10)]["lost_updates"] == 0
    assert rows[("cold", 1)]["respipe_bytes"] > rows[("cold", 10)]["respipe_bytes"]
    assert main(["cost", "--config", config, "--in-shape", "1,8,8", "--modes", "warm"]) == 2
    assert "--modes" in capsys.readouterr().err


_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("optim", sorted(_OPTIMIZERS))
def test_replica_round_trip_restores_the_whole_state(optim, dtype):
    # Any optimizer, BatchNorm's buffers (an int64 counter among them), any dtype: a copy
    # loaded from a replica continues bit for bit like the original, buffers included.
    from torch import nn

    from mpipipe.core.state.statecodec import pack_state, state_nbytes, unpack_state

    def model_and_opt(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2)).to(dtype)
        return m, _OPTIMIZERS[optim](m.parameters())

    def train(m, o, steps):
        for i in range(steps):
            torch.manual_seed(100 + i)
            o.zero_grad()
            m(torch.randn(5, 4, dtype=dtype)).float().square().sum().backward()
            o.step()

    src, src_opt = model_and_opt(0)
    train(src, src_opt, 3)
    flat = pack_state(src, src_opt)
    assert flat.dtype == torch.uint8 and flat.numel() == state_nbytes(src, src_opt)
    dst, dst_opt = model_and_opt(1)  # different weights, no state yet
    unpack_state(flat, dst, dst_opt, count=3)
    train(src, src_opt, 2)
    train(dst, dst_opt, 2)  # the copy continues exactly like the original
    want, got = src.state_dict(), dst.state_dict()
    assert list(want) == list(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    assert src.state_dict()["1.num_batches_tracked"].item() == 5


def test_a_replica_of_step_0_leaves_the_optimizer_without_state():
    from torch import nn

    from mpipipe.core.state.statecodec import StateError, pack_state, unpack_state

    m = nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    unpack_state(pack_state(m, opt), m, opt, count=0)
    assert not opt.state
    with pytest.raises(StateError, match="does not fit"):
        unpack_state(torch.zeros(3, dtype=torch.uint8), m, opt)
    with pytest.raises(StateError, match="closure"):
        pack_state(m, torch.optim.LBFGS(m.parameters()))


def test_batch_cache_jumps_to_a_far_step_and_matches_reading_through(digits) -> None:
    from mpipipe.core.run.batches import TrainBatches
    from mpipipe.respipe.command import BatchCache

    through = TrainBatches(digits, 32, seed=3)
    ahead = TrainBatches(digits, 32, seed=3)
    read = BatchCache(through.next)
    jump = BatchCache(ahead.next, seek=ahead.seek_batch)
    far = 2 * len(through) + 5  # two epochs and a bit: the shuffle of epoch 2
    for step in (far, far - 1, far - 2, far + 1):  # the kept batches serve replays
        (xa, ya), (xb, yb) = read(step), jump(step)
        assert (xa == xb).all() and (ya == yb).all(), step
    with pytest.raises(RuntimeError, match="older than"):
        jump(far - 3)


def test_kills_and_stalls_can_fall_inside_a_step() -> None:
    f = inject.parse("kill:stage=1:step=7:micro=2")
    assert (f.step, f.micro) == (7, 2) and inject.parse(str(f)) == f
    assert inject.parse("stall:stage=1:step=7").micro == -1
    fired: list[int] = []
    plan = inject.FaultPlan([f], seed=0, stage=1, rank=1, kill=lambda: fired.append(1))
    assert plan.at_step(7) == 0 and not fired  # not at the start of the step
    plan.at_step(7, 1)
    assert not fired
    plan.at_step(7, 2)
    plan.at_step(7, 2)  # a finished step is not finished twice, nor killed twice
    assert fired == [1]
    with pytest.raises(inject.FaultError, match="micro"):
        inject.parse("delay:stage=1:p=0.1:seconds=1:micro=0")
    with pytest.raises(inject.FaultError, match="micro must be >= 0"):
        inject.parse("kill:stage=1:step=3:micro=-1")


def test_kills_and_stalls_can_fall_inside_a_round_and_say_when_none_ran() -> None:
    f = inject.parse("kill:rank=3:step=7:round=1")
    assert f.round == 1 and inject.parse(str(f)) == f
    fired: list[int] = []
    slept: list[float] = []
    plan = inject.FaultPlan([f, inject.parse("stall:rank=3:step=9:round=1:seconds=2")],
                            seed=0, stage=None, rank=3, kill=lambda: fired.append(1),
                            sleep=slept.append)
    for step in range(12):
        assert plan.at_step(step) == 0  # never at a step
    assert len(plan.unfired_round_faults()) == 2
    assert plan.in_round(6) == 0 and not fired  # a round before its step
    plan.in_round(8)
    assert fired == [1] and plan.unfired_round_faults() == [plan.mine[1]]
    assert plan.in_round(9) == 2.0 and plan.in_round(10) == 0  # once
    assert slept == [2.0] and not plan.unfired_round_faults()
    with pytest.raises(inject.FaultError, match="round must be >= 1"):
        inject.parse("kill:stage=1:step=3:round=0")
    with pytest.raises(inject.FaultError, match="build=1 goes with round"):
        inject.parse("kill:stage=1:step=3:build=1")


def test_a_round_fault_may_wait_for_a_later_round_and_fire_at_the_build() -> None:
    # Issue 37: a member killed between READY and its build, twice in a row (the round
    # that runs again is the second from the step on).
    f = inject.parse("kill:rank=3:step=7:round=2:build=1")
    assert (f.round, f.build) == (2, True) and inject.parse(str(f)) == f
    fired: list[int] = []
    plan = inject.FaultPlan([f], seed=0, stage=None, rank=3, kill=lambda: fired.append(1))
    plan.in_round(7)  # the first round: counted at its decision ...
    plan.in_round(7, at_build=True)  # ... and not fired at its build
    assert not fired
    plan.in_round(7)  # the second: not yet at its decision
    assert not fired
    plan.in_round(7, at_build=True)
    assert fired == [1] and not plan.unfired_round_faults()
    with pytest.raises(inject.FaultError, match="not both"):
        inject.parse("kill:stage=1:step=3:round=1:micro=0")
    with pytest.raises(inject.FaultError, match="unknown key 'round' for delay"):
        inject.parse("delay:stage=1:p=0.1:seconds=1:round=1")


CHECK_PLAN = "0=stage 0, 1=stage 1, 2=stage 2, 3=backup 1"


def _check(*specs: str, steps: int | None = 20, chunks: int | None = 4,
           mode: str = "cold") -> None:
    import mpipipe.pipeline.plan  # noqa: F401 - declares the stage and backup roles
    from mpipipe.core.mpi.roles import LaunchPlan, Role

    plan = LaunchPlan(tuple(Role.parse(r.split("=")[1]) for r in CHECK_PLAN.split(", ")))
    inject.check_reachable(inject.parse_all(specs), plan, steps=steps, chunks=chunks, mode=mode)


@pytest.mark.parametrize("specs, why", [
    (["kill:stage=1:step=3:micro=4"], r"micro-batch 4 does not exist \(pipeline.chunks = 4"),
    (["kill:stage=1:step=20"], r"step 20, beyond the run \(run.steps = 20: steps 0..19\)"),
    (["slow:rank=2:step=25:factor=2"], "starts at step 25, beyond the run"),
    (["stall:rank=4:step=3"], r"no rank 4 \(the MPI world has ranks 0..3\)"),
    (["kill:stage=3:step=3"], r"stage 3 does not exist \(the plan has stages 0..2\)"),
    (["delay:stage=0:p=0:seconds=1"], "p=0"),
    (["slow:rank=1:step=2:factor=1"], "factor=1 slows nothing"),
    (["slow:rank=3:step=2:factor=2"], "rank 3 is a backup of stage 1, which computes nothing"),
    (["kill:rank=3:step=2:micro=1"], "in cold mode it runs no micro-batch"),
    (["kill:stage=1:step=5", "stall:rank=1:step=6"], "killed before, by kill:stage=1:step=5"),
    (["kill:rank=3:step=5:micro=1", "kill:rank=3:step=5:micro=2", "hot"], "killed before"),
    (["kill:rank=3:step=5:round=1", "stall:rank=3:step=9"], "in any round from step 5 on"),
])
def test_a_fault_that_can_never_fire_is_refused_naming_it(specs, why) -> None:
    mode = specs.pop() if specs[-1] == "hot" else "cold"
    with pytest.raises(inject.FaultError, match=why) as e:
        _check(*specs, mode=mode)
    assert str(e.value).startswith("fault ") and str(e.value).endswith("it would never fire")


def test_faults_that_can_fire_pass_the_check() -> None:
    _check("kill:stage=1:step=19:micro=3", "stall:rank=3:step=2", "delay:stage=0:p=0.1:seconds=1",
           "slow:rank=2:step=4:factor=2", "kill:rank=3:step=4:micro=1", mode="hot")
    _check("stall:stage=1:step=3", "kill:stage=1:step=5", "kill:rank=3:step=7")
    _check("stall:rank=3:step=2", "kill:rank=3:step=5:round=1")  # the stall comes first
    with pytest.raises(inject.FaultError, match="runs none"):
        _check("kill:stage=1:step=5:round=1", mode=None)  # not a ResPipe job: no rounds
    _check("kill:stage=2:step=500", steps=None)  # epochs of a data set not read yet


def test_what_a_rank_holds_decides_what_it_is_sent_again() -> None:
    from mpipipe.core.mpi.transport import ACT, EVAL, GRAD, LABEL, SHADOW
    from mpipipe.respipe.mirror import SHADOW_GRAD_MICRO, Have, _has

    h = Have(step=7, inputs=0b0101, grads=0b0010, labels=True)
    assert Have.decode(h.encode()) == h
    assert _has(h, ACT, 7, 0) and not _has(h, ACT, 7, 1) and _has(h, ACT, 7, 2)
    assert _has(h, GRAD, 7, 1) and not _has(h, GRAD, 7, 0)
    assert _has(h, SHADOW, 7, 2) and _has(h, SHADOW, 7, SHADOW_GRAD_MICRO + 1)
    assert not _has(h, SHADOW, 7, SHADOW_GRAD_MICRO)
    assert _has(h, LABEL, 7, 0) and not _has(Have(7, 0, 0, False), LABEL, 7, 0)
    assert _has(h, ACT, 6, 3) and not _has(h, ACT, 8, 0)  # all of before, none of after
    assert not _has(h, EVAL, 3, 0) and not _has(None, ACT, 0, 0)


def test_a_backup_fires_only_the_faults_aimed_at_its_rank() -> None:
    """A rank that played stage 1 and rejoined as a backup is not stage 1 any more."""
    from mpipipe.core.mpi.faults import FaultPlan, parse_all

    slept: list[float] = []
    plan = FaultPlan(parse_all(["delay:stage=1:p=1:seconds=2", "stall:rank=1:step=3:seconds=1"]),
                     seed=0, stage=1, rank=1, sleep=slept.append)
    for step in range(5):
        plan.at_step(step, by_rank=True)
    assert slept == [1.0]
    assert plan.at_step(5) == 2.0  # as the stage it was, the delay applies


# -- the control plane's one-probe look ----------------------------------------------------

def test_the_control_plane_is_quiet_until_a_message_waits() -> None:
    from mpi4py import MPI

    from mpipipe.respipe.control import _END, _STOP, _Control

    c = _Control(MPI.COMM_SELF.Dup())
    assert c.quiet() and c.quiet(_END)
    c.send(_END, 0, [1.0], seq=3)
    assert not c.quiet() and not c.quiet(_END, seq=3)
    assert c.quiet(_END) and c.quiet(_STOP, seq=3)  # another seq, another code
    assert c.poll(_END, 0, seq=3) is not None
    assert c.quiet() and c.quiet(_END, seq=3)
    c.comm.Free()
