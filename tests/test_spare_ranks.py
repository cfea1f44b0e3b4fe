"""Spare ranks: a plain pipeline with the world size of a resilient one (its baseline).

The plan checks, then real `mpirun` jobs: 3 stages + 2 spares train and the spares
take no part (the log's per-rank figures name the 3 stages only), with and without
ULFM; a killed stage of such a job still ends the job, spares included.
"""

from __future__ import annotations

import pytest

from mpipipe.core.mpi.roles import PlanError, Role
from mpipipe.core.run.configfile import load_config
from mpipipe.pipeline.config import PIPELINE_DEFAULTS
from mpipipe.pipeline.plan import pipeline_plan
from mpipipe.tools.launch import ROOT, run_mpi
from stannis.config import STANNIS_DEFAULTS, stannis_plan

# make test-long (.ci/run runs it): spare ranks beside the plan.
pytestmark = pytest.mark.long

CONFIG = ROOT / "jobs" / "configs" / "respipe-digits.toml"
# As given on the command line: one --set per role ([plan] is a free-form table).
SPARES = ["plan.stage 0=0", "plan.stage 1=1", "plan.stage 2=2", "plan.spare 1=3", "plan.spare 2=4"]


def test_spares_come_last_and_leave_the_plan_of_the_working_ranks() -> None:
    cfg = load_config(None, ["resilience.backups={}", *SPARES], PIPELINE_DEFAULTS)
    plan = pipeline_plan(cfg, 5)
    assert plan.ranks_of("spare") == [3, 4] and Role.parse("spare 1") == Role("spare", 1)
    assert [str(r) for r in plan.without_spares().roles] == ["stage 0", "stage 1", "stage 2"]
    early = load_config(None, ["plan.stage 0=0", "plan.spare 1=1", "plan.stage 1=2",
                               "plan.stage 2=3"], PIPELINE_DEFAULTS)
    with pytest.raises(PlanError, match="rank 1 is 'spare 1' but rank 3 is not a spare"):
        pipeline_plan(early, 4)
    cfg = load_config(None, ["plan.host=0", "plan.csd 1=1", "plan.spare 1=2", "stannis.csds=1"],
                      STANNIS_DEFAULTS)
    with pytest.raises(PlanError, match="only a host and CSDs"):
        stannis_plan(cfg, 3)


def _train(digits, tmp_path, name: str, *extra: str, ulfm: bool):
    log = tmp_path / f"{name}.h5"
    cmd = ["-m", "mpipipe", "train", "--quiet", "--config", str(CONFIG),
           "--set", f'data.path="{digits}"', "--set", "run.steps=12", "--set", "run.eval_every=0",
           "--set", "resilience.backups={}", "--log", str(log), *extra]
    for setting in SPARES:
        cmd += ["--set", setting]
    return run_mpi(5, cmd, ulfm=ulfm, timeout=240), log


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ulfm", [False, True], ids=["plain", "ulfm"])
def test_a_plain_pipeline_with_spares_trains_on_its_stages_alone(digits, tmp_path, ulfm) -> None:
    from mpipipe.core.logs.runlog import open_log

    result, log = _train(digits, tmp_path, "spares", ulfm=ulfm)
    assert result.returncode == 0, result.stderr[-2000:]
    run = open_log(log)
    assert list(run.steps["step"]) == list(range(1, 13))
    assert sorted(run.ranks) == [0, 1, 2]  # the spares sent no figures: they did no work
    assert int(run.attrs["world_size"]) == 5
    assert "3=spare 1, 4=spare 2" in run.attrs["plan"]
    assert not run.events_of("takeover")


@pytest.mark.timeout(600)
def test_a_killed_stage_ends_the_job_with_its_spares(digits, tmp_path) -> None:
    # Under ULFM the plain pipeline stops, naming the lost stage; the spares must
    # not keep the job waiting (the run_mpi timeout would fail the test).
    result, _ = _train(digits, tmp_path, "kill", "--inject", "kill:stage=1:step=5", ulfm=True)
    assert result.returncode != 0
    assert "stage 1" in result.stderr and "no backup left" in result.stderr, result.stderr[-2000:]
