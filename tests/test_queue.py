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

from trainer.core import claims, queue
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


def _end(runs: Path, name: str) -> None:
    """The live run's process ends (its pid file no longer names a live process)."""
    (runs / name / "launcher.pid").unlink()


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


def test_the_worker_starts_runs_on_free_gpus_beside_a_live_one_and_goes_on_after_a_failure(tmp_path):
    """queue.drain, as `launch.py --queue-worker` runs it, on fake device sets: with a run alive on GPUs 0,1, the
    queued run on GPUs 2,3 starts at once and the one on GPU 0 waits, the message naming only the run on its GPUs;
    the run on GPUs 2,3 fails, the next queued run on GPU 2 starts in its place, and the queue goes on to the end."""
    _live_run(tmp_path, "training", [0, 1])
    _queue(tmp_path, "on-0", [0])
    _queue(tmp_path, "on-2-3", [2, 3])
    _queue(tmp_path, "on-2", [2])
    said: list[str] = []
    exits = {"on-2-3": None, "on-2": None, "on-0": 0}  # None: still running

    def launch(config):
        _live_run(tmp_path, config.name, list(config.devices))
        return config.name

    def poll(name):
        if exits[name] is not None:
            _end(tmp_path, name)
        return exits[name]

    def say(line):
        said.append(line)
        if line == "waiting for training to end before queued run on-0" and exits["on-2-3"] is None:
            exits["on-2-3"] = 1  # it fails
        if line == "started queued run on-2":
            exits["on-2"] = 0
        if line == "run on-2 ended":
            _end(tmp_path, "training")

    assert queue.drain(tmp_path, launch, poll, say, poll_s=0) == 1
    assert said == ["started queued run on-2-3", "waiting for training to end before queued run on-0",
                    "run on-2-3 failed (exit code 1)", "started queued run on-2", "run on-2 ended",
                    "started queued run on-0", "run on-0 ended"]
    assert queue.entries(tmp_path) == []


def _child() -> subprocess.Popen:
    """A process that runs until its stdin closes: what a claim's job or a live run's process stands for."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def test_a_claim_waits_only_for_what_holds_its_devices_and_goes_before_queued_runs(tmp_path):
    """A Generate's claim on fake devices: on GPU 2 it starts beside a run on GPUs 0,1 and then holds GPU 2 (a
    queued run on it waits); on GPU 1 it waits for that run, saying so, and while it waits a queued run on GPU 1
    does not take the GPU the run frees; a claim whose process ended holds nothing."""
    _live_run(tmp_path, "training", [0, 1])
    first, second = _child(), _child()
    try:
        claims.take_turn(tmp_path, frozenset({"gpu:2"}), "generation for run a", lambda: first.pid, poll_s=0)
        assert queue.busy_runs(tmp_path, frozenset({"gpu:2"})) == ["generation for run a"]
        _queue(tmp_path, "on-2", [2])
        _queue(tmp_path, "on-1", [1])
        launch = lambda config: pytest.fail(f"{config.name} started")  # noqa: E731
        assert queue.start_next(tmp_path, launch) == "busy"
        said: list[str] = []

        def say(line):
            said.append(line)
            _end(tmp_path, "training")
            assert queue.start_next(tmp_path, launch) == "busy"  # on-1 lets the waiting claim go first

        claims.take_turn(tmp_path, frozenset({"gpu:1"}), "generation for run b", lambda: second.pid, say=say,
                         poll_s=0)
        assert said == ["queued: waiting for training to end"]
        assert [(c.what, c.running) for c in claims.claims(tmp_path)] == [("generation for run a", True),
                                                                         ("generation for run b", True)]
    finally:
        for child in (first, second):
            child.stdin.close()  # type: ignore[union-attr]
            child.wait()
    assert claims.claims(tmp_path) == [] and queue.busy_runs(tmp_path) == []


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
