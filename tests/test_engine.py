"""The training maths through the real launcher: torchrun, gloo DDP on CPU, the real worker, the tiny model.

Each test compares runs rather than checking that something ran: the same effective batch on 1 and 2
processes gives the same weights; stopped-then-resumed (even on another process count) and killed-then-resumed
give the weights of an uninterrupted run; sampling does not change training.
"""

import os
import signal

import psutil
import pytest
import torch

from tests.engine_helpers import assert_same_weights, engine_config, final_weights, launch, log_of, progress
from trainer.events import read_events
from trainer.launcher import resume_run
from trainer.hardware import CPU_ONLY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def reference(runs, tiny_sd_path, demo_data_path):
    """One process x 4 per device x accumulation 1, 4 steps, no samples: the uninterrupted run."""
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "batch.per_device=4", "name=reference")
    run_dir, final = launch(runs, config)
    assert final["type"] == "done", log_of(run_dir)
    return run_dir


def test_two_processes_with_accumulation_match_one_process(reference, runs, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:2", "batch.per_device=1", "name=ddp",
                           "sample.every=2", "sample.prompts=[a photo of a red circle]", "sample.steps=2")
    run_dir, final = launch(runs, config)
    assert final["type"] == "done", log_of(run_dir)
    plan = read_events(run_dir)[0]
    assert (plan["type"], plan["world_size"], plan["per_device"], plan["accumulation"]) == ("plan", 2, 1, 2)
    # same weights: DDP averaged the right gradients, each rank trained on its own part of the batch, and
    # drawing samples (here, not in the reference) changed nothing
    assert_same_weights(final_weights(reference), final_weights(run_dir))
    one, two = progress(reference), progress(run_dir)
    assert [e["step"] for e in one] == [e["step"] for e in two] == [1, 2, 3, 4]
    assert [e["lr"] for e in one] == pytest.approx([e["lr"] for e in two])
    assert [e["loss"] for e in one] == pytest.approx([e["loss"] for e in two], rel=1e-5)
    samples = [e for e in read_events(run_dir) if e["type"] == "sample"]
    assert [e["step"] for e in samples] == [0, 2, 4]
    assert all((run_dir / e["path"]).stat().st_size > 0 for e in samples)


def test_stopped_then_resumed_on_another_process_count_matches(reference, runs, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "batch.per_device=2", "name=stopped")
    stop_after_first_step = lambda events: any(e["type"] == "progress" for e in events)  # noqa: E731
    run_dir, final = launch(runs, config, until=stop_after_first_step, action=lambda p: p.request_stop())
    assert final["type"] == "stopped", log_of(run_dir)
    stopped_at = final["step"]
    assert 1 <= stopped_at < 4 and final["checkpoint"] == f"checkpoints/step-{stopped_at:06d}"

    resumed = resume_run(run_dir, ["devices=cpu:2"], hw=CPU_ONLY)
    final = resumed.wait(timeout=300)
    assert final["type"] == "done", log_of(run_dir)
    steps = [e["step"] for e in progress(run_dir)]
    assert steps == list(range(1, 5)), "the resumed run continues at the step it stopped, no step repeated"
    assert_same_weights(final_weights(reference), final_weights(run_dir))


def test_killed_rank_fails_the_run_and_resume_recovers(reference, runs, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:2", "batch.per_device=2", "name=killed",
                           "checkpoint.every=1")

    def kill_rank_1(proc):
        for child in psutil.Process(proc.pid).children(recursive=True):
            if child.environ().get("RANK") == "1":
                os.kill(child.pid, signal.SIGKILL)

    at_step_2 = lambda events: any(e["type"] == "checkpoint" and e["step"] >= 2 for e in events)  # noqa: E731
    run_dir, final = launch(runs, config, until=at_step_2, action=kill_rank_1)
    assert final["type"] == "failed", log_of(run_dir)
    assert "rank 1" in final["reason"]
    assert len([e for e in read_events(run_dir) if e["type"] in ("done", "stopped", "failed")]) == 1

    final = resume_run(run_dir, hw=CPU_ONLY).wait(timeout=300)
    assert final["type"] == "done", log_of(run_dir)
    assert_same_weights(final_weights(reference), final_weights(run_dir))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_fp32_trainable_weights(runs, tiny_sd_path, demo_data_path, precision):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "batch.per_device=2",
                           f"precision={precision}", "train.steps=2", f"name={precision}")
    run_dir, final = launch(runs, config)
    assert final["type"] == "done", log_of(run_dir)
    assert read_events(run_dir)[0]["precision"] == precision
    weights = final_weights(run_dir)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert all(e["loss"] == e["loss"] for e in progress(run_dir))  # not NaN
    assert final["overflow_steps"] >= 0 if precision == "fp16" else final["overflow_steps"] == 0
