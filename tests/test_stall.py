"""A stalled rank is caught: the node's launcher reads each rank's heartbeat (trainer.engine.heartbeat,
trainer.core.stall), warns after distributed.stall_warning_s without a step, naming the rank that froze and the
ranks waiting for it, and ends the run `failed` after distributed.stall_timeout_s, naming them and the checkpoint
to resume from."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine_helpers import engine_config
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.core.hardware import CPU_ONLY
from trainer.core.launcher import kill_run, prepare_run, start_run
from trainer.core.stall import StallWatch, read_beats
from trainer.errors import ConfigError


def beat(run_dir, rank, *, step, alive, stepped, phase=None):
    folder = run_dir / "heartbeats"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.json").write_text(json.dumps({
        "rank": rank, "pid": 100 + rank, "step": step, "phase": phase or f"step {step + 1}", "alive": alive,
        "stepped": stepped}))


def test_the_frozen_rank_is_named_once_then_the_run_is_ended(tmp_path):
    watch = StallWatch(tmp_path, (0, 1), warning_s=30, timeout_s=120, since=900.0)
    assert watch.check(1000.0) == (None, None)  # no heartbeat yet: still loading
    beat(tmp_path, 0, step=7, alive=1000.0, stepped=1000.0)
    beat(tmp_path, 1, step=7, alive=1000.0, stepped=1000.0)
    assert watch.check(1010.0) == (None, None)
    # Rank 1 freezes at step 7; rank 0 keeps its heartbeat alive, waiting in the all-reduce of step 8.
    beat(tmp_path, 0, step=7, alive=1040.0, stepped=1000.0)
    warning, reason = watch.check(1040.0)
    assert reason is None and "frozen" in warning and "rank 1 (pid 101, at step 8, last step 7" in warning
    assert "waiting for them: rank 0" in warning and "stall_timeout_s=120" in warning
    assert watch.check(1045.0) == (None, None)  # said once
    beat(tmp_path, 0, step=7, alive=1130.0, stepped=1000.0)
    _, reason = watch.check(1130.0)
    assert "rank 1" in reason and "ended the run" in reason


def test_a_resumed_launch_ignores_the_beats_of_the_last_one(tmp_path):
    for rank in (0, 1):  # the launch that stopped an hour ago
        beat(tmp_path, rank, step=7, alive=1000.0, stepped=1000.0)
    watch = StallWatch(tmp_path, (0, 1), warning_s=30, timeout_s=120, since=4600.0)
    assert watch.check(4700.0) == (None, None)  # the resumed workers are still loading
    beat(tmp_path, 0, step=7, alive=4710.0, stepped=4710.0)
    warning, _ = watch.check(4750.0)
    assert "never reported a step: rank 1" in warning


def test_busy_phases_are_not_stalls_and_a_moving_run_clears_the_warning(tmp_path):
    watch = StallWatch(tmp_path, (0, 1), warning_s=30, timeout_s=0, since=0.0)
    for rank in (0, 1):  # ten minutes of samples: both alive, neither stepping, neither training
        beat(tmp_path, rank, step=5, alive=1600.0, stepped=1000.0, phase="rank 0 drawing samples at step 5")
    assert watch.check(1600.0) == (None, None)
    for rank in (0, 1):  # alive, in a step, none moving: a deadlock
        beat(tmp_path, rank, step=5, alive=1700.0, stepped=1600.0)
    warning, reason = watch.check(1700.0)
    assert "alive but finishing no step" in warning and reason is None  # timeout 0: never ended
    for rank in (0, 1):
        beat(tmp_path, rank, step=6, alive=1701.0, stepped=1701.0)
    assert watch.check(1701.0) == (None, None) and not watch.warned


def test_the_default_warning_follows_the_measured_step_time(tmp_path):
    watch = StallWatch(tmp_path, (0,), warning_s=None, since=0.0)
    assert watch.warning_after() == 60  # nothing measured yet
    for step in range(1, 6):
        beat(tmp_path, 0, step=step, alive=step * 10.0, stepped=step * 10.0)
        watch.check(step * 10.0)
    assert watch.warning_after() == 20 * 10.0
    assert read_beats(tmp_path)[0].step == 5


def test_bad_stall_settings_are_refused():
    with pytest.raises(ConfigError, match="distributed.stall_timeout_s: 10 ends the run before the warning"):
        load_config(None, ["distributed.stall_warning_s=60", "distributed.stall_timeout_s=10"], check_paths=False)


@pytest.mark.slow
def test_a_frozen_rank_is_warned_about_then_the_run_fails_naming_it(tmp_path, tiny_sd_path, demo_data_path):
    """Two real CPU ranks; rank 1 is SIGSTOPped after a checkpoint: a warning names it, then the run is `failed`
    naming it and the checkpoint, long before the 1800 s collective timeout."""
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:2", "batch.total=2", "train.steps=100000",
                           "checkpoint.every=2", "distributed.stall_warning_s=12", "distributed.stall_timeout_s=16")
    run_dir, plan = prepare_run(config, tmp_path / "runs", hw=CPU_ONLY)
    proc = start_run(run_dir, plan, config)
    try:
        deadline = time.monotonic() + 240
        while not any(e["type"] == "progress" and e["step"] >= 3 for e in read_events(run_dir)):  # past a checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, (run_dir / "train.log").read_text()
            time.sleep(0.5)  # polling the events file, not waiting out a race
        rank1 = read_beats(run_dir)[1]
        os.kill(rank1.pid, signal.SIGSTOP)
        final = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill(grace_s=1)
    events = read_events(run_dir)
    warnings = [e["message"] for e in events if e["type"] == "warning" and "No step for" in e["message"]]
    assert warnings and "frozen" in warnings[0] and f"rank 1 (pid {rank1.pid}" in warnings[0]
    assert final["type"] == "failed" and f"rank 1 (pid {rank1.pid}" in final["reason"]
    assert "checkpoints/" in final["reason"] and "--resume" in final["reason"]


@pytest.mark.slow
def test_a_headless_launch_watches_for_a_frozen_rank(tmp_path):
    """The real command line (launch.py follows by polling, not through RunProcess.wait()): with rank 1 SIGSTOPped,
    launch.py writes the `warning` naming it, then ends the run `failed` and exits 1. Before the watch ran in its
    own thread, launch.py polled forever and neither event came."""
    from PIL import Image

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    Image.new("RGB", (64, 64), "red").save(tmp_path / "data" / "red.png")
    (tmp_path / "data" / "red.txt").write_text("a red square")
    preset = tmp_path / "preset.yaml"
    preset.write_text(json.dumps({"name": "cli", "model": {"path": str(tmp_path / "model")},
                                  "data": {"path": str(tmp_path / "data")}}))
    cmd = [sys.executable, str(repo / "launch.py"), "--preset", str(preset), "--runs-dir", "runs",
           "--worker-module", "tests.fake_worker", "devices=cpu:2", "train.steps=100000", "checkpoint.every=2",
           # as the test above: the warning once the frozen rank's heartbeat is 10 s old (trainer.core.stall), the end
           # two 2-s polls later, so that a late poll cannot skip the warning
           "distributed.stall_warning_s=12", "distributed.stall_timeout_s=16"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "FAKE_WORKER_STEP_S": "0.2"})
    run_dir, rank1 = tmp_path / "runs" / "cli", None
    try:
        deadline = time.monotonic() + 120
        while not any(e["type"] == "progress" and e["step"] >= 3 for e in read_events(run_dir)):  # past a checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)  # polling the events file, not waiting out a race
        rank1 = json.loads((run_dir / "fake_ranks" / "1.json").read_text())["pid"]
        os.kill(rank1, signal.SIGSTOP)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
            kill_run(run_dir, grace_s=1)  # torchrun runs in its own session: killing launch.py leaves it
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGKILL)  # normally gone already: the launcher killed its tree
            except ProcessLookupError:
                pass
    events = read_events(run_dir)
    warnings = [e["message"] for e in events if e["type"] == "warning" and "No step for" in e["message"]]
    assert warnings and f"rank 1 (pid {rank1}" in warnings[0], events
    assert events[-1]["type"] == "failed" and f"rank 1 (pid {rank1}" in events[-1]["reason"]
    assert "checkpoints/" in events[-1]["reason"] and "--resume" in events[-1]["reason"]
    assert proc.returncode == 1 and "warning: No step for" in out and "failed: No step for" in err, (out, err)
