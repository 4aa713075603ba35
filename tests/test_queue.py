"""The run queue through the command line: `--preset ... --queue` validates and queues (in the runs folder),
`--queue-worker` starts the queued runs one after another; a run whose config no longer validates at its start is
reported and the queue goes on; a cancelled run never starts."""

from __future__ import annotations

import pytest

import os
import shutil
import subprocess
import sys
from pathlib import Path

from trainer.core import queue
from trainer.core.assets import demo_assets
from trainer.core.events import final_event, read_events

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["train.steps=2", "sample.every=0", "checkpoint.every=0", "batch.total=2", "batch.per_device=2"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "IMAGETUNE_FAULT"}
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=ROOT)


@pytest.mark.slow
def test_queued_runs_start_in_order_a_broken_one_is_skipped_a_cancelled_one_never_starts(tmp_path):
    runs = tmp_path / "runs"
    data = tmp_path / "data"
    shutil.copytree(demo_assets(tmp_path / "assets", ["demo-data"])["demo-data"], data)
    for name, extra in (("first", [f"data.path={data}"]), ("second", []), ("third", [])):
        out = cli("--preset", "demo", "--runs-dir", str(runs), f"name={name}", *QUICK, *extra, "--queue")
        assert out.returncode == 0 and f"queued {name} at position" in out.stdout, out.stdout + out.stderr
    assert [q.name for q in queue.entries(runs)] == ["first", "second", "third"]
    assert queue.cancel(runs, queue.entries(runs)[2].id)
    shutil.rmtree(data)  # valid when queued, not when it starts: validated again then
    worker = cli("--queue-worker", "--runs-dir", str(runs))
    assert worker.returncode == 1, worker.stdout + worker.stderr  # one run did not start
    assert "queue: queued run first was not started:" in worker.stdout and str(data) in worker.stdout
    assert worker.stdout.index("queued run first was not started") < worker.stdout.index("started queued run second")
    assert final_event(read_events(runs / "second"))["type"] == "done"
    assert not (runs / "first").exists() and not (runs / "third").exists()
    assert queue.entries(runs) == [] and "queue: empty" in worker.stdout


def test_a_config_that_does_not_validate_is_not_queued(tmp_path):
    out = cli("--preset", "demo", "--runs-dir", str(tmp_path), "train.steps=-1", "--queue")
    assert out.returncode == 2 and "train.steps" in out.stderr and "Traceback" not in out.stderr
    assert queue.entries(tmp_path) == []
    out = cli("--queue", "--runs-dir", str(tmp_path))
    assert out.returncode == 2 and "--queue goes with --preset" in out.stderr
    out = cli("--queue-worker", "--preset", "demo", "--runs-dir", str(tmp_path))
    assert out.returncode == 2 and "--queue-worker takes only --runs-dir" in out.stderr
