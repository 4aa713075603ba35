"""The training maths through the real launcher: torchrun, gloo DDP on CPU, the real worker, the tiny model.

Each test compares runs rather than checking that something ran: the same effective batch on 1 and 2
processes gives the same weights; stopped-then-resumed (even on another process count) and killed-then-resumed
give the weights of an uninterrupted run; sampling does not change training.
"""

import signal

import pytest
import torch

from tests.engine_helpers import assert_same_weights, engine_config, final_weights, launch, log_of, progress
from trainer.core.events import read_events
from trainer.core.resume import resume_run
from trainer.core.hardware import CPU_ONLY
from trainer.engine.faults import SLOW_INPUT_S

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
    run_dir, final = launch(runs, config, fault="slow_rank=1")  # rank 1's input is 0.25 s late every micro-step
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
    # Per-rank telemetry, the step before's (trainer.engine.telemetry): the slow rank is named, its wait shown.
    assert "ranks" not in two[0]
    for event in two[1:]:
        assert event["ranks_step"] == event["step"] - 1 and [r["rank"] for r in event["ranks"]] == [0, 1]
        slow, fast = event["ranks"][1], event["ranks"][0]
        assert slow["data_s"] >= 2 * SLOW_INPUT_S > fast["data_s"] and event["data_s"] == slow["data_s"]
        assert event["slowest_rank"] == 1
        assert all(r["step_s"] > 0 and r["cpu_s"] > 0 and r["rss_mb"] > 100 for r in event["ranks"])


def test_stopped_then_resumed_on_another_process_count_matches(reference, runs, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "batch.per_device=2", "name=stopped")
    run_dir, final = launch(runs, config, fault="stop_at_step=2")  # the STOP file, found during step 2
    assert final["type"] == "stopped", log_of(run_dir)
    assert final["step"] == 2 and final["checkpoint"] == "checkpoints/step-000002"

    # ... in input worker processes this time: the same micro-batches (trainer.engine.input)
    resumed = resume_run(run_dir, ["devices=cpu:2", "data.workers=2"], hw=CPU_ONLY)
    final = resumed.wait(timeout=300)
    assert final["type"] == "done", log_of(run_dir)
    steps = [e["step"] for e in progress(run_dir)]
    assert steps == list(range(1, 5)), "the resumed run continues at the step it stopped, no step repeated"
    assert_same_weights(final_weights(reference), final_weights(run_dir))


def test_killed_rank_fails_the_run_and_resume_recovers(reference, runs, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:2", "batch.per_device=2", "name=killed",
                           "checkpoint.every=1")
    # rank 1 SIGKILLs itself as step 2 ends, before step 2's checkpoint: the run fails with step 1's left
    run_dir, final = launch(runs, config, fault="kill_rank=1,at_step=2")
    assert final["type"] == "failed", log_of(run_dir)
    assert "rank 1" in final["reason"] and final["rank"] == 1 and final["exitcode"] == -signal.SIGKILL
    assert len([e for e in read_events(run_dir) if e["type"] in ("done", "stopped", "failed")]) == 1
    assert [e["step"] for e in read_events(run_dir) if e["type"] == "checkpoint"] == [1]

    final = resume_run(run_dir, hw=CPU_ONLY).wait(timeout=300)
    assert final["type"] == "done", log_of(run_dir)
    assert [e["step"] for e in read_events(run_dir) if e["type"] == "resumed"] == [1]
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
    if precision == "bf16":  # a finished run can be extended: resume with more steps
        final = resume_run(run_dir, ["train.steps=3"], hw=CPU_ONLY).wait(timeout=300)
        assert final["type"] == "done", log_of(run_dir)
        assert [e["step"] for e in progress(run_dir)] == [1, 2, 3]
        resumed = [e for e in read_events(run_dir) if e["type"] == "resumed"][0]
        assert resumed["step"] == 2 and resumed["changes"]["train.steps"] == [2, 3]


def test_the_trained_lora_loads_in_diffusers_and_changes_the_output(reference, tiny_sd_path):
    from diffusers import StableDiffusionPipeline

    def render(pipe):
        gen = torch.Generator().manual_seed(0)
        return pipe("a photo of a red circle", num_inference_steps=2, generator=gen, output_type="pt").images

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd_path)
    pipe.set_progress_bar_config(disable=True)
    base = render(pipe)
    pipe.load_lora_weights(reference / "output")
    with_lora = render(pipe)
    assert (with_lora - base).abs().max() > 1e-3

    kohya = next((reference / "output").glob("*_kohya.safetensors"))
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd_path)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(kohya))  # through diffusers' own kohya/A1111 conversion
    torch.testing.assert_close(render(pipe), with_lora, rtol=0, atol=1e-5)


def test_non_finite_losses_fail_the_run_and_keep_the_last_good_checkpoint(runs, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "batch.per_device=4", "name=nan",
                           "train.lr=1e30", "train.max_grad_norm=0", "train.scheduler=constant",
                           "train.warmup_steps=0", "train.steps=8", "train.max_nonfinite_steps=2",
                           "checkpoint.every=1")
    run_dir, final = launch(runs, config)
    assert final["type"] == "failed", log_of(run_dir)
    assert "NaN or infinite for 2 optimizer steps in a row" in final["reason"] and "train.lr=" in final["reason"]
    warnings = [e for e in read_events(run_dir) if e["type"] == "warning" and "NaN/inf" in e["message"]]
    assert len(warnings) == 2
    assert all(e["loss"] is None or e["loss"] == e["loss"] for e in progress(run_dir))  # no NaN in the JSON
    weights = final_weights(run_dir)  # the newest checkpoint holds finite weights
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_unusable_files_are_skipped_with_warnings_naming_them(runs, tiny_sd_path, demo_data_path, tmp_path):
    import shutil

    from PIL import Image

    data = tmp_path / "data"
    shutil.copytree(demo_data_path, data)
    (data / "broken.png").write_bytes(b"not a png at all")
    Image.new("RGB", (40, 40), "red").save(data / "small.png")
    (data / "small.txt").write_text("a photo of a small red square")
    Image.new("RGB", (64, 64), "blue").save(data / "uncaptioned.png")
    config = engine_config(tiny_sd_path, data, "devices=cpu:1", "batch.per_device=2", "train.steps=1",
                           "name=messy")
    run_dir, final = launch(runs, config)
    assert final["type"] == "done", log_of(run_dir)
    warnings = " ".join(e["message"] for e in read_events(run_dir) if e["type"] == "warning")
    assert "broken.png" in warnings and "uncaptioned.png" in warnings and "small.png: 40x40" in warnings


def test_two_nodes_on_loopback_match_one_process(reference, runs, tiny_sd_path, demo_data_path):
    """Two torchrun "nodes" (1 process each) on 127.0.0.1: the multi-node path trains the same weights."""
    import socket

    from trainer.core.launcher import prepare_run, start_run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = {}
    for node_rank in (1, 0):
        config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "batch.per_device=1", "name=nodes",
                               "distributed.nodes=2", f"distributed.node_rank={node_rank}",
                               f"distributed.master_port={port}")
        run_dir, plan = prepare_run(config, runs / f"node{node_rank}", hw=CPU_ONLY)
        assert (plan.world_size, plan.accumulation) == (2, 2)
        started[node_rank] = (run_dir, start_run(run_dir, plan, config))
    finals = {rank: proc.wait(timeout=400) for rank, (_, proc) in started.items()}
    node0 = started[0][0]
    assert finals[0]["type"] == "done", log_of(node0)
    assert finals[1]["type"] == "done", log_of(started[1][0])
    assert_same_weights(final_weights(reference), final_weights(node0))
