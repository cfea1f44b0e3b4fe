"""The shared core: configuration loader, launch plan, world-size check, run log."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from mpipipe.core.logs.runlog import LogError, RunLog, open_log
from mpipipe.core.mpi.roles import LaunchPlan, PlanError, Role, check_world_size
from mpipipe.core.run.configfile import ConfigError, load_config
from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
from mpipipe.pipeline.plan import pipeline_plan


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_file_and_overrides_merge(tmp_path):
    p = write(tmp_path, "[pipeline]\nstages = 2\nchunks = 8\n[optim]\nlr = 1\n")
    cfg = load_config(p, ["pipeline.schedule=gpipe", "run.steps=7", "resilience.backups.1=1"], PIPELINE_DEFAULTS)
    assert cfg["pipeline"] == {**PIPELINE_DEFAULTS["pipeline"], "stages": 2, "chunks": 8, "schedule": "gpipe"}
    assert cfg["optim"]["lr"] == 1.0 and isinstance(cfg["optim"]["lr"], float)
    assert cfg["run"]["steps"] == 7
    assert cfg["resilience"]["backups"] == {"1": 1}
    # the defaults themselves are never mutated
    assert PIPELINE_DEFAULTS["pipeline"]["stages"] == 3
    assert PIPELINE_DEFAULTS["resilience"]["backups"] == {}


@pytest.mark.parametrize("text,overrides,message", [
    ("[pipeline]\nchunkz = 4\n", [], "unknown key 'pipeline.chunkz'"),
    ("[pipline]\n", [], "unknown section [pipline]"),
    ("[pipeline]\nstages = 'three'\n", [], "'pipeline.stages' must be an integer"),
    ("[data]\nshuffle = 1\n", [], "'data.shuffle' must be true/false"),
    ("[pipeline\n", [], "is not valid TOML"),
    ("", ["pipeline.stages"], "expected section.key=value"),
    ("", ["stages=3"], "must look like section.key"),
    ("", ["pipeline.schedule=zigzag"], "choose one of gpipe, 1f1b, interleaved-1f1b"),
    ("", ["optim.schedule=step"], "choose one of constant, cosine"),
    ("", ["run.nope=1"], "unknown key 'run.nope'"),
])
def test_bad_config_names_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides, PIPELINE_DEFAULTS, PIPELINE_CHOICES)
    assert message in str(err.value)


@pytest.mark.parametrize("text,overrides,defaults,message", [
    ("[pipeline]\nchunkz = 4\n", [], None, "unknown key 'pipeline.chunkz': did you mean 'pipeline.chunks'?"),
    ("", ["pipeline.chunkz=4"], None, "unknown key 'pipeline.chunkz': did you mean 'pipeline.chunks'?"),
    ("[optimizer]\nlr = 1\n", [], None, "unknown section [optimizer]: did you mean [optim]?"),
    ("", ["pipelin.chunks=4"], None, "unknown section [pipelin]: did you mean [pipeline]?"),
    # the right key in the wrong section
    ("[run]\nbatch_size = 8\n", [], None, "unknown key 'run.batch_size': did you mean 'data.batch_size'?"),
    ("", ["run.drop_last=false"], None, "did you mean 'data.drop_last'?"),
    # Stannis's own keys
    ("", ["stannis.injct=[]"], "stannis", "unknown key 'stannis.injct': did you mean 'stannis.inject'?"),
    ("", ["run.epochs=2"], "stannis", "unknown key 'run.epochs' (known in [run]:"),  # no epochs in Stannis
])
def test_unknown_names_suggest_the_nearest_known_one(tmp_path, text, overrides, defaults, message):
    from stannis.config import STANNIS_DEFAULTS

    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides, STANNIS_DEFAULTS if defaults else PIPELINE_DEFAULTS)
    assert message in str(err.value)


@pytest.mark.parametrize("name", ["run.nope", "zzz.q", "data.xyzzy"])
def test_nothing_is_suggested_when_nothing_is_near(name):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{name}=1"], PIPELINE_DEFAULTS)
    assert "did you mean" not in str(err.value) and "unknown" in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", (), PIPELINE_DEFAULTS)


def cfg_with(**sections):
    cfg = load_config(None, (), PIPELINE_DEFAULTS)
    for section, values in sections.items():
        cfg[section].update(values)
    return cfg


def test_automatic_pipeline_plan_places_backups_after_stages():
    cfg = cfg_with(pipeline={"stages": 3}, resilience={"backups": {"1": 1, "2": 1}})
    plan = pipeline_plan(cfg, 5)
    assert [str(r) for r in plan.roles] == ["stage 0", "stage 1", "stage 2", "backup 1", "backup 2"]
    assert plan.ranks_of("backup", 2) == [4]
    assert pipeline_plan(cfg_with(resilience={"backups": "all"}), 6).ranks_of("backup") == [3, 4, 5]
    every = load_config(None, ["resilience.backups=all"], PIPELINE_DEFAULTS)
    assert pipeline_plan(every, 6).ranks_of("backup") == [3, 4, 5]
    with pytest.raises(PlanError, match='a table like'):
        pipeline_plan(load_config(None, ["resilience.backups=some"], PIPELINE_DEFAULTS), 6)


@pytest.mark.parametrize("sections,world,message", [
    ({"pipeline": {"stages": 3}}, 4, "needs 3 ranks (3 stages) but the MPI world has 4"),
    ({"resilience": {"backups": {"1": 1}}}, 3, "needs 4 ranks (3 stages + 1 backups)"),
    ({"resilience": {"backups": {"7": 1}}}, 4, "stage 7 does not exist"),
    ({"plan": {"stage 0": 0, "stage 1": 0, "stage 2": 1}}, 2, "rank 0 has two roles"),
    ({"plan": {"stage 0": 0, "stage 2": 1}}, 2, "stage 1 has no rank"),
    ({"plan": {"stage 0": 0, "stage 1": 1}}, 3, "ranks [2] have no role"),
    ({"plan": {"stage 0": 0, "stage 1": 1, "stage 2": 5}}, 3, "no such rank"),
    ({"plan": {"stage 0": 0, "stage 1": 1, "chef 2": 2}}, 3, "unknown role 'chef 2'"),
    # a kind of another system is unknown here, whether or not that system is imported
    ({"plan": {"stage 0": 0, "stage 1": 1, "host": 2}}, 3,
     "unknown role 'host': a pipeline job has only stages and backups (and spares after them) "
     "(write 'stage K', 'backup K' or 'spare K')"),
])
def test_bad_launch_plans(sections, world, message):
    with pytest.raises(PlanError) as err:
        pipeline_plan(cfg_with(**sections), world)
    assert message in str(err.value)


def test_role_parse_and_str():
    assert Role.parse("backup 2") == Role("backup", 2)
    assert str(Role.parse(" host ")) == "host"
    with pytest.raises(PlanError, match="needs an index"):
        Role.parse("stage")
    plan = LaunchPlan.from_table({"host": 0, "csd 1": 1}, 2)
    assert plan.describe() == "0=host, 1=csd 1"


def test_world_size_check_catches_singletons():
    check_world_size(4, {"SLURM_NTASKS": "4"})
    check_world_size(1, {})
    with pytest.raises(PlanError, match="SLURM_NTASKS=4 but the MPI world has 1"):
        check_world_size(1, {"SLURM_NTASKS": "4"})
    # A rank on another node of a Slurm job under mpirun: the daemons' srun step had 2 tasks.
    check_world_size(4, {"SLURM_NTASKS": "2", "OMPI_COMM_WORLD_SIZE": "4"})


def test_runlog_round_trip(tmp_path):
    path = tmp_path / "run.h5"
    with RunLog(path, system="mpipipe", config={"a": {"b": 1}}, comm_size=2) as log:
        for s in range(1, 4):
            log.step(s, loss=1.0 / s, samples=32, samples_per_s=100.0,
                     ranks={0: {"compute_s": 0.1, "wait_s": 0.0, "bytes_sent": 10, "bytes_recv": 0},
                            1: {"compute_s": 0.2, "wait_s": 0.1, "bytes_sent": 0, "bytes_recv": 10,
                                **({"batch_size": 8} if s > 1 else {})}})
        log.eval(3, accuracy=0.5)
        log.event("takeover", step=2, rank=3, detected_after_s=0.5, recovery_s=np.float64(1.5))
    run = open_log(path)
    assert run.attrs["status"] == "completed" and run.system == "mpipipe"
    assert run.config == {"a": {"b": 1}}
    assert list(run.steps["step"]) == [1, 2, 3]
    assert run.ranks[1]["bytes_recv"].tolist() == [10, 10, 10]
    assert run.ranks[1]["batch_size"].tolist() == [-1, 8, 8]  # back-filled
    assert run.eval["accuracy"].tolist() == [0.5] and math.isnan(run.eval["loss"][0])
    assert run.events == [{"step": 2, "time": run.events[0]["time"], "kind": "takeover", "rank": 3,
                           "detail": {"detected_after_s": 0.5, "recovery_s": 1.5}}]


def test_runlog_writes_several_steps_at_once_like_one_by_one(tmp_path):
    rows = [{"step": i, "time": 0.1 * i, "loss": 1.0 / i, "samples": 8, "samples_per_s": 80.0,
             "ranks": {0: {"compute_s": 0.1, "wait_s": 0.0, "bytes_sent": i, "bytes_recv": 0},
                       **({1: {"compute_s": 0.2, "ctrl_bytes_sent": 5}} if i != 2 else {})}}
            for i in (1, 2, 3)]
    for name, write in [("batch", lambda log: log.steps(rows)),
                        ("single", lambda log: [log.step(r["step"], **{k: v for k, v in r.items()
                                                                         if k != "step"}) for r in rows])]:
        with RunLog(tmp_path / f"{name}.h5", system="mpipipe", config={}, comm_size=2) as log:
            write(log)
    batch, single = open_log(tmp_path / "batch.h5"), open_log(tmp_path / "single.h5")
    for key in ("step", "time", "loss"):
        np.testing.assert_array_equal(batch.steps[key], single.steps[key])
    for rank in (0, 1):
        for key, column in single.ranks[rank].items():
            np.testing.assert_array_equal(batch.ranks[rank][key], column)
    assert list(batch.ranks[1]["step"]) == [1, 3]
    assert list(batch.ranks[0]["bytes_sent"]) == [1, 2, 3]


def test_runlog_failure_status_and_null(tmp_path):
    path = tmp_path / "run.h5"
    with pytest.raises(RuntimeError):
        with RunLog(path, system="stannis", config={}, comm_size=1):
            raise RuntimeError("boom")
    assert open_log(path).attrs["status"] == "failed: boom"
    RunLog.null().step(1, loss=0, samples=0, samples_per_s=0)  # writes nothing, no error


def test_a_survivor_takes_the_log_over_where_the_dead_writer_left_it(tmp_path):
    path = tmp_path / "run.h5"
    writer = RunLog(path, system="mpipipe", config={}, comm_size=2)
    for s in (1, 2, 3):
        writer.step(s, loss=float(s), samples=4, samples_per_s=1.0)
    writer.release()  # as a killed writer leaves it: flushed, status still "running"
    assert open_log(path).attrs["status"] == "running"
    survivor = RunLog.null(path, writer.start)
    assert not survivor.active
    survivor.take_over()
    assert survivor.active
    # step 3 was rebuilt from the survivor's own figures: the file's row is kept once
    survivor.step(3, loss=math.nan, samples=4, samples_per_s=1.0)
    survivor.step(4, loss=4.0, samples=4, samples_per_s=1.0)
    survivor.event("log_writer_moved", step=3, rank=1, previous=0)
    survivor.close("completed")
    run = open_log(path)
    assert list(run.steps["step"]) == [1, 2, 3, 4]
    assert list(run.steps["loss"]) == [1.0, 2.0, 3.0, 4.0]
    assert run.attrs["status"] == "completed"
    assert run.events_of("log_writer_moved")[0]["detail"] == {"previous": 0}
    assert run.steps["time"][3] >= run.steps["time"][2]  # one time axis: the run's start


_HOLD = """
import sys, h5py
f = h5py.File(sys.argv[1], "a")
print("holding", flush=True)
sys.stdin.readline()  # until the test lets go (closes our stdin), or is gone
"""


def _hold(path):
    """Another process that keeps the log open (a replaced writer, still alive) until
    its stdin is closed: the hand-off follows the test's order, not a sleep's length."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


@pytest.mark.timeout(60)
def test_a_new_writer_waits_for_a_replaced_one_and_keeps_each_records_time(tmp_path):

    path = tmp_path / "run.h5"
    writer = RunLog(path, system="mpipipe", config={}, comm_size=2)
    writer.step(1, loss=1.0, samples=4, samples_per_s=1.0)
    writer.release()
    holder = _hold(path)
    try:
        survivor = RunLog.null(path, writer.start)
        survivor.take_over()  # the file is locked: records wait
        made_from = survivor.elapsed()
        survivor.event("takeover", step=1, rank=1)
        survivor.step(2, loss=2.0, samples=4, samples_per_s=1.0)
        made_to = survivor.elapsed()
        assert survivor.writer is None  # still held: both records wait in memory
        holder.stdin.close()  # let go only now, so both are written after made_to
        survivor.close("completed", wait_s=20)  # waits for the holder to exit
        holder.wait(20)
        run = open_log(path)
        assert list(run.steps["step"]) == [1, 2] and run.attrs["status"] == "completed"
        # Each record's time is when it was made (between the two readings of the log's
        # clock, in order), not when it was written (later than made_to). The same clock
        # and float64 column on both sides: exact bounds, whatever the machine's load.
        made = run.events_of("takeover")[0]["time"]
        assert made_from <= made <= run.steps["time"][1] <= made_to, (made_from, made, made_to)
    finally:
        holder.kill()
        holder.wait()
    # a writer that stays locked out says so, and its records go to a side file
    holder = _hold(path)
    try:
        late = RunLog.null(path, writer.start)
        late.take_over()
        late.event("checkpoint", step=0)
        with pytest.raises(LogError, match=r"still held .* 1 waiting records are in .*run\.tail\.h5"):
            late.close("completed", wait_s=0.5)
    finally:
        holder.kill()
        holder.wait()
    assert open_log(path).attrs["status"] == "completed"  # untouched
    tail = open_log(tmp_path / "run.tail.h5")
    assert tail.attrs["status"] == "completed" and tail.attrs["continues"] == str(path)
    assert [e["kind"] for e in tail.events] == ["checkpoint"]


_WAITING_WRITER = """
import sys, time
from mpipipe.core.logs.runlog import RunLog
log = RunLog.null(sys.argv[1], float(sys.argv[2]))
log.take_over(order=1)  # the file is held: its records wait
log.event("log_writer_moved", step=2, rank=1, previous=0)
for s in (2, 3):
    log.step(s, loss=float(s), samples=4, samples_per_s=1.0, ranks={1: {"compute_s": 0.5}})
assert log.writer is None
print("waiting", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_records_of_a_new_writer_killed_while_it_waited_for_the_file_are_not_lost(tmp_path):
    # Chaos seed 2 #9: the writer stalled and was replaced alive (it held the file); its
    # successor queued rows, and was killed before the file freed up: the rows were lost.
    import signal
    import subprocess
    import sys

    path = tmp_path / "run.h5"
    writer = RunLog(path, system="mpipipe", config={}, comm_size=3)
    writer.step(1, loss=1.0, samples=4, samples_per_s=1.0)
    writer.release()
    holder = _hold(path)  # the stalled first writer
    try:
        waiting = subprocess.Popen([sys.executable, "-c", _WAITING_WRITER, str(path), repr(writer.start)],
                                   stdout=subprocess.PIPE, text=True)
        assert waiting.stdout.readline().strip() == "waiting"
        waiting.send_signal(signal.SIGKILL)  # a real kill: no release, no spill
        waiting.wait(20)
        third = RunLog.null(path, writer.start)
        third.take_over(order=2)
        third.step(3, loss=3.0, samples=4, samples_per_s=1.0)  # rebuilt: also in the journal
        third.step(4, loss=4.0, samples=4, samples_per_s=1.0)
        holder.stdin.close()
        assert third.close("completed", wait_s=20) == "completed"
    finally:
        holder.kill()
        holder.wait()
    run = open_log(path)
    assert list(run.steps["step"]) == [1, 2, 3, 4]
    assert list(run.steps["loss"]) == [1.0, 2.0, 3.0, 4.0]
    assert run.ranks[1]["compute_s"].tolist() == [0.5, 0.5]
    assert run.events_of("log_writer_moved")[0]["detail"] == {"previous": 0}
    assert not list(tmp_path.glob("*.jsonl"))  # written, then removed


def test_a_journal_of_another_run_or_cut_by_a_kill_is_read_safely(tmp_path):
    path = tmp_path / "run.h5"
    writer = RunLog(path, system="mpipipe", config={}, comm_size=2)
    writer.release()
    foreign = tmp_path / "run.queue-000001-x-1.jsonl"
    foreign.write_text('{"start_unix": 1.0}\n{"m": "_event", "a": ["checkpoint"], "k": {"step": 0}}\n')
    cut = tmp_path / "run.queue-000002-x-2.jsonl"
    cut.write_text(json.dumps({"start_unix": writer.start}) + '\n{"m": "_event", "a": ["resume"], '
                   '"k": {"step": 1}}\n{"m": "_ev')
    survivor = RunLog.null(path, writer.start)
    survivor.take_over()
    survivor.close("completed")
    assert [e["kind"] for e in open_log(path).events] == ["resume"]
    assert foreign.exists() and not cut.exists()  # another run's journal is not ours to remove


def test_the_last_rank_alive_closes_an_abandoned_log_and_never_a_finished_one(tmp_path):
    # Chaos seed 10 #25: a replaced writer woke to find every other rank dead; the log
    # said 'running' and the dead successor's rows were in its journal.
    path = tmp_path / "run.h5"
    writer = RunLog(path, system="mpipipe", config={}, comm_size=3)
    writer.step(1, loss=1.0, samples=4, samples_per_s=1.0)
    writer.release()  # the replaced writer let go
    successor = RunLog.null(path, writer.start)
    successor.take_over(lambda: False, order=1)  # still waiting for the file when killed
    successor.step(2, loss=2.0, samples=4, samples_per_s=1.0)
    successor._takeover._drop_journal(keep=True)  # as a kill leaves it: the journal stays
    last = RunLog.null(path, writer.start)
    assert last.close_abandoned("failed: stage 1 lost") is True
    run = open_log(path)
    assert run.attrs["status"] == "failed: stage 1 lost"
    assert list(run.steps["step"]) == [1, 2]
    assert not list(tmp_path.glob("*.jsonl"))
    # A log whose run is over is never rewritten (ranks that exited look dead to ULFM).
    assert RunLog.null(path, writer.start).close_abandoned("failed: again") is False
    assert open_log(path).attrs["status"] == "failed: stage 1 lost"
    assert RunLog.null(tmp_path / "none.h5", writer.start).close_abandoned("failed: x") is False


def test_a_new_writer_opens_only_once_the_old_one_says_it_let_go(tmp_path):
    # HDF5's lock is off on many parallel file systems: the hand-off must not need it.
    path = tmp_path / "run.h5"
    writer = RunLog(path, system="mpipipe", config={}, comm_size=2)
    writer.release()
    let_go = [False]
    survivor = RunLog.null(path, writer.start)
    survivor.take_over(lambda: let_go[0])
    survivor.event("resume", step=1)
    assert survivor.writer is None  # not opened while the old writer may still write
    let_go[0] = True
    survivor.close("completed")
    run = open_log(path)
    assert [e["kind"] for e in run.events] == ["resume"] and run.attrs["status"] == "completed"


def test_taking_over_cuts_a_row_the_killed_writer_left_half_written(tmp_path):
    path = tmp_path / "run.h5"
    writer = RunLog(path, system="mpipipe", config={}, comm_size=2)
    for s in (1, 2):
        writer.step(s, loss=float(s), samples=4, samples_per_s=1.0)
    writer.release()
    with h5py.File(path, "a") as f:  # killed after the step column grew, before the rest
        f["steps/step"].resize((3,))
        f["steps/step"][2] = 3
    survivor = RunLog.null(path, writer.start)
    survivor.take_over()
    survivor.step(3, loss=3.0, samples=4, samples_per_s=1.0)
    survivor.close()
    run = open_log(path)
    assert list(run.steps["step"]) == [1, 2, 3] and list(run.steps["loss"]) == [1.0, 2.0, 3.0]
    assert list(run.steps["samples"]) == [4, 4, 4]


def test_taking_over_a_foreign_file_or_without_a_path_is_refused(tmp_path):
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = [1]
    with pytest.raises(LogError, match="not an mpipipe run log"):
        RunLog.null(tmp_path / "foreign.h5", 0.0).take_over()
    with pytest.raises(LogError, match="does not know the run's file"):
        RunLog.null().take_over()
    with pytest.raises(LogError, match="cannot open it"):  # gone: not created anew
        RunLog.null(tmp_path / "gone.h5", 0.0).take_over()
    assert not (tmp_path / "gone.h5").exists()


def test_open_log_rejects_foreign_and_damaged_files(tmp_path):
    with pytest.raises(LogError, match="no such file"):
        open_log(tmp_path / "missing.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(LogError, match="not a readable HDF5 file"):
        open_log(tmp_path / "text.h5")
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = [1, 2]
    with pytest.raises(LogError, match="not an mpipipe run log"):
        open_log(tmp_path / "foreign.h5")
    RunLog(tmp_path / "cut.h5", system="mpipipe", config={}, comm_size=1).close()
    with h5py.File(tmp_path / "cut.h5", "a") as f:
        del f["events"]
    with pytest.raises(LogError, match="group /events is missing"):
        open_log(tmp_path / "cut.h5")


def test_open_log_reads_a_log_cut_mid_row(tmp_path):
    path = tmp_path / "cut.h5"
    log = RunLog(path, system="mpipipe", config={}, comm_size=1)
    for s in (1, 2):
        log.step(s, loss=0.5, samples=4, samples_per_s=1.0)
    log.writer.file["steps"]["step"].resize((3,))  # a kill between two column writes
    log.writer.file.flush()
    run = open_log(path)
    assert run.attrs["status"] == "running"
    assert len(run.steps["step"]) == len(run.steps["loss"]) == 2


def test_dump_toml_round_trips_the_defaults(tmp_path):
    from mpipipe.core.run.configfile import dump_toml

    p = write(tmp_path, dump_toml(PIPELINE_DEFAULTS))
    assert load_config(p, (), PIPELINE_DEFAULTS) == load_config(None, (), PIPELINE_DEFAULTS)
    cfg = load_config(None, ["plan.stage 0=0", "resilience.backups.1=2"], PIPELINE_DEFAULTS)
    assert load_config(write(tmp_path, dump_toml(cfg), "d.toml"), (), PIPELINE_DEFAULTS) == cfg


def test_cosine_rate_follows_torch_cosine_annealing():
    import torch

    from mpipipe.core.run.lr import decay, rate_at, set_lr

    total, base = 12, 0.05
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=0.0)
    ours = torch.optim.SGD([p], lr=base)
    for step in range(total):
        set_lr(ours, rate_at({"lr": base, "schedule": "cosine"}, step, total))
        assert ours.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
        opt.step()
        reference.step()
    assert rate_at({"lr": base}, 7, total) == base  # no schedule key: constant
    assert decay(total, total, "cosine") == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="choose one of constant, cosine"):
        decay(0, total, "step")


# ---- packaging: console scripts and --version ----------------------------------------


def test_console_scripts_point_at_the_module_entry_points_and_print_the_version(capsys):
    """[project.scripts] mpipipe and stannis load (as pip's wrapper would) and `--version` prints
    the package's version; pyproject.toml reads that version from mpipipe.__version__."""
    import tomllib
    from importlib.metadata import EntryPoint

    from setuptools.config.pyprojecttoml import read_configuration

    import mpipipe
    from mpipipe.core import version
    from mpipipe.tools.launch import ROOT

    # one number: stannis (which may import mpipipe.core only) prints the core's
    assert version.__version__ == mpipipe.__version__ and version.package_version() == mpipipe.package_version()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"mpipipe", "stannis"}
    assert read_configuration(ROOT / "pyproject.toml")["project"]["version"] == mpipipe.__version__
    for name, target in scripts.items():
        main = EntryPoint(name, target, "console_scripts").load()
        assert main.__module__ == f"{name}.__main__"
        with pytest.raises(SystemExit) as done:
            main(["--version"])
        assert done.value.code == 0
        assert capsys.readouterr().out == f"{name} {mpipipe.package_version()}\n"


@pytest.mark.timeout(120)
def test_version_in_a_real_process_installed_or_not():
    """What the console script runs (`sys.exit(main())`), in a process; and without
    site-packages (a source tree never installed) the fallback to __version__."""
    import subprocess
    import sys

    import mpipipe
    from mpipipe.tools.launch import ROOT

    for name in ("mpipipe", "stannis"):
        p = subprocess.run([sys.executable, "-c", f"import sys; from {name}.__main__ import main; sys.exit(main())",
                            "--version"], capture_output=True, text=True, timeout=100, cwd=ROOT)
        assert (p.returncode, p.stdout, p.stderr) == (0, f"{name} {mpipipe.package_version()}\n", "")
    p = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "import importlib.metadata as m, mpipipe\n"
                        "try:\n    m.version('mpipipe'); print('installed')\n"
                        "except m.PackageNotFoundError:\n    print(mpipipe.package_version())", str(ROOT)],
                       capture_output=True, text=True, timeout=100)
    assert (p.returncode, p.stdout.strip()) == (0, mpipipe.__version__), p.stderr


def test_the_writer_refuses_an_unknown_event_kind_or_column_on_every_rank(tmp_path):
    """A misspelt kind or figure fails where it is made (a null log too), and nothing reaches the file."""
    from mpipipe.core.logs.logschema import EventKind, SchemaError

    path = tmp_path / "run.h5"
    with RunLog(path, system="mpipipe", config={}, comm_size=2) as log:
        for writer in (log, RunLog.null()):
            with pytest.raises(SchemaError, match=r"^unknown event kind 'take_over': a run log records only "
                                                  r"cost_model, .*takeover, .*EventKind in "
                                                  r"mpipipe/core/logs/logschema"):
                writer.event("take_over", step=1, rank=1)
            with pytest.raises(SchemaError, match=r"^unknown column 'bytes_snt' for /ranks \(rank 1, step 1\): "
                                                  r"the schema has step, compute_s, wait_s, bytes_sent"):
                writer.step(1, loss=1.0, samples=4, samples_per_s=1.0, ranks={1: {"bytes_snt": 3}})
            with pytest.raises(SchemaError, match=r"^unknown column 'los' for /steps \(step 2\)"):
                writer.steps([{"step": 2, "los": 1.0}])
        log.event(EventKind.TAKEOVER, step=1, rank=1)  # the enum and its string are the same kind
        log.event("takeover", step=2, rank=1)
    run = open_log(path)
    assert [e["kind"] for e in run.events] == ["takeover", "takeover"]
    assert len(run.events_of(EventKind.TAKEOVER)) == 2 and not run.steps
    assert EventKind.TAKEOVER == "takeover" and f"{EventKind.TAKEOVER}" == "takeover"


def test_a_rank_column_absent_from_later_rows_stays_aligned(tmp_path):
    """An extra figure that a rank stops sending is filled with the missing value, not left short."""
    path = tmp_path / "run.h5"
    with RunLog(path, system="stannis", config={}, comm_size=1) as log:
        log.step(1, loss=1.0, samples=4, samples_per_s=1.0, ranks={0: {"compute_s": 0.1, "batch_size": 4}})
        log.step(2, loss=1.0, samples=4, samples_per_s=1.0, ranks={0: {"compute_s": 0.1}})
    cols = open_log(path).ranks[0]
    assert cols["step"].tolist() == [1, 2] and cols["batch_size"].tolist() == [4, -1]


def test_role_kinds_are_declared_by_each_system_not_known_to_the_core(monkeypatch):
    """The core parses any declared kind; the pipeline declares stage/backup/spare, Stannis host/csd."""
    import ast
    from pathlib import Path

    import mpipipe.pipeline.plan  # noqa: F401 - declares stage, backup and spare
    from mpipipe.core.mpi import roles

    monkeypatch.setattr(roles, "_KINDS", dict(roles._KINDS))
    import stannis.config  # noqa: F401 - declares host and csd

    kinds = roles.role_kinds()
    assert {k: v.system for k, v in kinds.items()}.items() >= {
        "stage": "the pipeline", "backup": "ResPipe", "spare": "the pipeline", "host": "Stannis",
        "csd": "Stannis"}.items()
    roles.register_role_kind(roles.RoleKind("reader", "a test", indexed=False, writes_log=True))
    roles.register_role_kind(roles.RoleKind("reader", "a test", indexed=False, writes_log=True))  # same: fine
    with pytest.raises(ValueError, match="role kind 'reader' is declared twice, differently: by a test"):
        roles.register_role_kind(roles.RoleKind("reader", "another test"))
    plan = LaunchPlan((Role("stage", 0), Role.parse("reader"), Role("spare", 0)))
    assert str(plan.roles[1]) == "reader" and plan.without_spares().world_size == 2 and plan.log_rank == 0
    # (the kinds in the order they were declared, which depends on what was imported first)
    with pytest.raises(PlanError, match=r"^unknown role 'chef 2': expected .*'stage K', .* or 'reader'$"):
        Role.parse("chef 2")
    with pytest.raises(PlanError, match="unknown role kind 'chef'.*register_role_kind"):
        Role("chef", 2)
    # the core's roles.py names no kind (the pipeline's live in mpipipe/pipeline/plan.py)
    source = Path(roles.__file__).read_text()
    literals = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)}
    assert not literals & set(kinds), literals & set(kinds)


def test_every_package_directory_is_installed():
    """pyproject.toml lists packages by name, so a new subpackage (mpipipe/core, ...) left
    out of the list would be missing from a wheel while an editable install still works."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for top in ("native", "mpipipe", "stannis") for p in (root / top).rglob("__init__.py")}
    assert found == listed, f"pyproject.toml [tool.setuptools] packages: add {found - listed}, drop {listed - found}"
