"""The progress watchdog, in a process of its own: it fires only without progress, writes
the stack and one line naming the wait, closes the log as stuck and ends the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# make test-long (.ci/run runs it): the watchdog ending stuck jobs (it waits out its own limits).
pytestmark = pytest.mark.long

SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    from pathlib import Path
    from mpipipe.core.mpi import watchdog
    out = Path(sys.argv[1])
    beats = float(sys.argv[2])
    dog = watchdog.install(watchdog.Watchdog(
        rank=0, seconds=1.0, stacks=out / "run.h5.stacks", prog="mpipipe train",
        holds_log=lambda: True, close_log=lambda s: (out / "status").write_text(s),
        abort=os._exit))
    end = time.monotonic() + beats
    step = 0
    while time.monotonic() < end:  # progress: a step every 0.1 s
        watchdog.beat(step)
        step += 1
        time.sleep(0.1)
    print("beats over", flush=True)
    watchdog.waiting((3, "ACT", 4, 1))
    time.sleep(60)  # stuck
""")


@pytest.mark.timeout(120)
def test_a_rank_without_progress_says_where_it_waits_and_closes_the_log(tmp_path):
    # 3 s of steady progress (3 x the limit) first: a rank that progresses never fires.
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), "3"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["beats over"]  # it did not fire while beating
    lines = [ln for ln in proc.stderr.splitlines() if "error: stuck" in ln]
    assert len(lines) == 1, proc.stderr
    assert "rank 0 made no progress for" in lines[0]
    assert "waiting for rank 3 (ACT of step 5, micro-batch 1)" in lines[0]
    assert (tmp_path / "status").read_text().startswith("failed: stuck: rank 0")
    stack = (tmp_path / "run.h5.stacks" / "rank-0.txt").read_text()
    assert "time.sleep" in stack or "<module>" in stack


def test_the_limit_is_a_minute_or_twenty_median_steps_after_five_minutes_of_start_up():
    from mpipipe.core.mpi.watchdog import Watchdog

    dog = Watchdog(rank=0, seconds=0, stacks=Path("."), prog="x", holds_log=lambda: False,
                   close_log=lambda s: None, abort=lambda c: None)
    assert dog.limit() == 300.0  # before the first step: start-up (torch, data checks)
    dog.beat(0)
    assert dog.limit() == 60.0
    dog.step_times.extend([5.0] * 5)
    assert dog.limit() == 100.0
    with pytest.raises(ValueError, match="watchdog_s"):
        Watchdog(rank=0, seconds=-1, stacks=Path("."), prog="x", holds_log=lambda: False,
                 close_log=lambda s: None, abort=lambda c: None)


OTHER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from mpipipe.core.mpi import watchdog
    out = Path(sys.argv[1])
    watchdog.install(watchdog.Watchdog(
        rank=3, seconds=3.0, stacks=out / "run.h5.stacks", prog="stannis train",
        holds_log=lambda: False, close_log=lambda s: (out / "status").write_text(s),
        abort=os._exit))
    watchdog.beat(0)
    time.sleep(4)  # past the limit, not twice it: a warning, no abort (the writer may be busy)
    for step in range(1, 20):  # progress again
        watchdog.beat(step)
        time.sleep(0.1)
    print("went on", flush=True)
    time.sleep(60)  # stuck for good: aborts after twice the limit
""")


@pytest.mark.timeout(120)
def test_a_rank_without_the_log_warns_goes_on_with_progress_and_aborts_without(tmp_path):
    proc = subprocess.run([sys.executable, "-c", OTHER, str(tmp_path)], capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["went on"]
    # Each spell warns once; the first may pass unseen if the watchdog's thread is held
    # up a second under load, the last always warns before it aborts.
    warnings = [ln for ln in proc.stderr.splitlines() if "rank 3: no progress for" in ln]
    assert 1 <= len(warnings) <= 2, proc.stderr
    assert not (tmp_path / "status").exists()  # only the log's holder closes the log
    assert (tmp_path / "run.h5.stacks" / "rank-3.txt").exists()


MARKED = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from mpipipe.core.mpi import watchdog
    out = Path(sys.argv[1])
    holds = sys.argv[2] == "writer"
    watchdog.install(watchdog.Watchdog(
        rank=0 if holds else 2, seconds=1.0 if holds else 600.0, stacks=out / "run.h5.stacks",
        prog="mpipipe train", holds_log=lambda: holds,
        close_log=lambda s: (out / "status").write_text(s),
        abort=lambda code: time.sleep(600)))  # an MPI_Abort that never ends the process
    watchdog.beat(0)
    print("waiting", flush=True)
    time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_an_abort_cannot_outlive_itself_and_the_writers_mark_ends_every_rank(tmp_path):
    env = {**os.environ, "PMIX_NAMESPACE": "prterun-vm-1234@1"}
    # The writer: stuck, its MPI_Abort blocks; it leaves the mark and ends itself.
    writer = subprocess.run([sys.executable, "-c", MARKED, str(tmp_path), "writer"], env=env,
                            capture_output=True, text=True, timeout=100)
    assert writer.returncode == 3, writer.stderr
    mark = tmp_path / "run.h5.stacks" / "abort-prterun-vm-1234-1"
    assert mark.read_text().startswith("rank 0 made no progress")
    # Another rank of the same job, far from its own limit, ends when it sees the mark.
    other = subprocess.run([sys.executable, "-c", MARKED, str(tmp_path), "other"], env=env,
                           capture_output=True, text=True, timeout=100)
    assert other.returncode == 3, other.stderr
    assert (tmp_path / "run.h5.stacks" / "rank-2.txt").exists()
    # A later job in the same place is not misled by the old job's mark.
    later = subprocess.Popen([sys.executable, "-c", MARKED, str(tmp_path), "other"],
                             env={**env, "PMIX_NAMESPACE": "prterun-vm-999@1"},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert later.stdout.readline() == "waiting\n"
        with pytest.raises(subprocess.TimeoutExpired):
            later.wait(timeout=3)  # three looks at the marks, and it lives on
    finally:
        later.kill()
        later.wait()
