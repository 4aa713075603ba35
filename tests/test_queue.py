"""The run queue through the command line: `--preset ... --queue` validates and queues (in the runs folder),
`--queue-worker` starts the queued runs one after another; a run whose config no longer validates at its start is
reported and the queue goes on; a cancelled run never starts."""

from __future__ import annotations

import pytest

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from trainer.core import queue
from trainer.core.assets import demo_assets
from trainer.core.events import final_event, read_events

ROOT = Path(__file__).resolve().parents[1]
# sample.every=0 still draws at the start and the end (schema: "0: only at the start and the end"); the demo's
# 2 prompts x 4 images x 20 denoising steps cost ~4 s a draw on one core, so one image at 2 steps each.
QUICK = ["train.steps=2", "sample.every=0", "sample.steps=2", "sample.images_per_prompt=1", "checkpoint.every=0",
         "batch.total=2", "batch.per_device=2"]


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


@functools.lru_cache(maxsize=1)
def _demo_yaml() -> str:
    from trainer.core.config import load_config, to_yaml

    return to_yaml(load_config(ROOT / "presets" / "demo.yaml", check_paths=False))


def _queue(runs: Path, name: str, devices) -> None:
    """What queue.add writes (a resolved config in runs/.queue/, named in queue order), for the demo on `devices`."""
    import json

    text = _demo_yaml().replace("name: demo\n", f"name: {name}\n").replace("devices: auto\n",
                                                                          f"devices: {json.dumps(devices)}\n")
    root = queue.queue_dir(runs)
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{len(list(root.glob('*.yaml'))) + 10**18:019d}-{name}.yaml").write_text(text)


def _live_run(runs: Path, name: str, devices) -> None:
    """A run folder whose process is alive (this test's own) and whose plan holds `devices`."""
    import json

    from trainer.core.runlock import identity

    run = runs / name
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"devices": devices}))
    (run / "launcher.pid").write_text(identity(os.getpid()))


def test_queued_runs_move_earlier_and_later(tmp_path):
    for name in ("a", "b", "c"):
        _queue(tmp_path, name, "cpu")
    names = lambda: [q.name for q in queue.entries(tmp_path)]  # noqa: E731
    c = queue.entries(tmp_path)[2]
    moved = queue.move(tmp_path, c.id, -1)
    assert names() == ["a", "c", "b"] and moved is not None
    assert queue.move(tmp_path, moved, -1) is not None and names() == ["c", "a", "b"]
    assert queue.move(tmp_path, queue.entries(tmp_path)[0].id, -1) is None  # already first
    assert queue.move(tmp_path, queue.entries(tmp_path)[0].id, 1) is not None and names() == ["a", "c", "b"]
    assert queue.move(tmp_path, "0000000000000000001-gone", 1) is None


def test_a_queued_run_waits_only_for_the_runs_on_its_devices(tmp_path):
    """Fake device sets: a run on GPUs 0,1 is alive. A queued run on GPUs 2,3 starts beside it; one on GPU 1, or on
    every GPU (auto), waits; a later run on GPU 3 does not jump the earlier one waiting for GPUs 2,3."""
    _live_run(tmp_path, "training", [0, 1])
    _queue(tmp_path, "on-1", [1])
    _queue(tmp_path, "on-2-3", [2, 3])
    _queue(tmp_path, "on-3", [3])
    started: list[str] = []

    def launch(config):
        started.append(config.name)
        _live_run(tmp_path, config.name, list(config.devices))
        return config.name

    entry, _ = queue.start_next(tmp_path, launch)
    assert entry.name == "on-2-3" and started == ["on-2-3"]
    assert queue.start_next(tmp_path, launch) == "busy"  # on-1 waits for GPU 1, on-3 for GPU 3 (on-2-3 holds it)
    assert queue.must_wait(tmp_path, queue.config_devices([4])) is False
    assert queue.must_wait(tmp_path, queue.config_devices("auto")) and queue.must_wait(tmp_path, frozenset({"gpu:1"}))
    assert queue.busy_runs(tmp_path, frozenset({"gpu:0"})) == ["training"]
    assert queue.busy_runs(tmp_path, None) == ["on-2-3", "training"]


def test_the_command_line_lists_and_moves_queued_runs(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    import launch

    for name in ("a", "b"):
        _queue(tmp_path, name, "cpu")
    assert launch.main(["--queue-move", "b", "up", "--runs-dir", str(tmp_path)]) == 0
    assert [q.name for q in queue.entries(tmp_path)] == ["b", "a"]
    assert "#1  b" in capsys.readouterr().out
    assert launch.main(["--queue-move", "#2", "sideways", "--runs-dir", str(tmp_path)]) == 2
    assert "the direction is `up` (earlier) or `down` (later)" in capsys.readouterr().err
    assert launch.main(["--queue-move", "zzz", "down", "--runs-dir", str(tmp_path)]) == 2
