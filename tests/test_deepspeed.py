"""`distributed.sharding: deepspeed`: DeepSpeed ZeRO through accelerate, on 2 CPU processes (DeepSpeed's CPU
accelerator, gloo) through the real launcher, against the same run on 1 process without it. ZeRO-2 with
accumulation trains the same weights as 1 process; a run stopped under ZeRO resumes, under ZeRO or without it,
to the weights of an uninterrupted run (the checkpoint holds the full optimizer state in the trainer's format,
gathered from DeepSpeed's partitions and scattered back); what DeepSpeed cannot run is refused up front."""

import shutil

import pytest

from tests.engine_helpers import (
    assert_same_weights,
    engine_config,
    final_weights,
    launch,
    log_of,
    progress,
)
from trainer.errors import ConfigError
from trainer.core.events import read_events
from trainer.core.hardware import CPU_ONLY
from trainer.core.resume import resume_run
from trainer.core.plan import make_plan

FULL = ["method=full", "train.lr=1e-4"]  # the tiny SD's whole UNet (DeepSpeed is for full fine-tunes)
ZERO = [*FULL, "devices=cpu:2", "batch.per_device=1", "distributed.sharding=deepspeed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("deepspeed-runs")


@pytest.fixture(scope="module")
def reference(runs, tiny_sd_path, demo_data_path):
    """One process x 4 per device, 4 AdamW steps with clipping, no DeepSpeed: the uninterrupted run."""
    run_dir, final = launch(runs, engine_config(tiny_sd_path, demo_data_path, *FULL, "devices=cpu:1",
                                                "batch.per_device=4", "name=reference"))
    assert final["type"] == "done", log_of(run_dir)
    return run_dir


@pytest.mark.slow
def test_zero2_on_two_processes_with_accumulation_matches_one_process(reference, runs, tiny_sd_path,
                                                                      demo_data_path):
    run_dir, final = launch(runs, engine_config(tiny_sd_path, demo_data_path, *ZERO, "name=zero2", "sample.every=2",
                                                "sample.prompts=[a photo of a red circle]", "sample.steps=2"),
                            timeout=600)
    assert final["type"] == "done", log_of(run_dir)
    plan = read_events(run_dir)[0]
    assert (plan["sharding"], plan["zero_stage"], plan["accumulation"]) == ("deepspeed", 2, 2)
    assert "· deepspeed zero-2 ·" in plan["line"]
    assert "deepspeed: ZeRO stage 2 across 2 processes" in log_of(run_dir)  # the engine really ran
    # same weights: accumulation, clipping and the update were DeepSpeed's, and drawing samples changed nothing
    assert_same_weights(final_weights(reference), final_weights(run_dir))
    assert [e["loss"] for e in progress(reference)] == pytest.approx([e["loss"] for e in progress(run_dir)], rel=1e-5)
    assert [e["step"] for e in read_events(run_dir) if e["type"] == "sample"] == [0, 2, 4]
    assert (run_dir / "output" / "diffusers" / "model_index.json").is_file()  # the full fine-tune's outputs


@pytest.mark.slow
def test_a_run_stopped_under_zero_resumes_with_or_without_it(reference, runs, tiny_sd_path, demo_data_path):
    config = engine_config(tiny_sd_path, demo_data_path, *ZERO, "distributed.zero_stage=1", "name=stopped")
    run_dir, final = launch(runs, config, fault="stop_at_step=2", timeout=600)  # the STOP file, during step 2
    assert final["type"] == "stopped", log_of(run_dir)
    assert final["step"] == 2 and final["checkpoint"] == "checkpoints/step-000002"
    copy = shutil.copytree(run_dir, runs / "stopped-copy")

    for folder, overrides in ((run_dir, []), (copy, ["devices=cpu:1", "distributed.sharding=ddp"])):
        resumed = resume_run(folder, overrides, hw=CPU_ONLY)
        final = resumed.wait(timeout=600)
        assert final["type"] == "done", log_of(folder)
        assert [e["step"] for e in progress(folder)] == [1, 2, 3, 4]
        # AdamW's moments and step count came through the checkpoint: not just the weights
        assert_same_weights(final_weights(reference), final_weights(folder))


@pytest.mark.slow
def test_zero_skips_the_update_of_a_non_finite_step_like_the_loop(runs, tiny_sd_path, demo_data_path):
    """DeepSpeed applies the update inside backward; a non-finite gradient norm makes it skip the update, so the
    weights after a NaN step are the ones before it, and the run fails after train.max_nonfinite_steps."""
    import torch
    from safetensors.torch import load_file

    config = engine_config(tiny_sd_path, demo_data_path, *ZERO, "name=nan", "train.lr=1e30", "train.max_grad_norm=0",
                           "train.scheduler=constant", "train.warmup_steps=0", "train.steps=8",
                           "train.max_nonfinite_steps=2", "checkpoint.every=1", "checkpoint.keep=4")
    run_dir, final = launch(runs, config, timeout=600)
    assert final["type"] == "failed", log_of(run_dir)
    assert "NaN or infinite for 2 optimizer steps in a row" in final["reason"]
    losses = [e["loss"] for e in progress(run_dir)]
    assert losses[0] is not None and losses[1:] == [None]  # step 1 blew the weights up; 2 and 3 were NaN
    after_step = {n: load_file(str(run_dir / "checkpoints" / f"step-{n:06d}" / "trainable.safetensors"))
                  for n in (1, 2)}
    assert all(torch.isfinite(t).all() for t in after_step[2].values())
    assert_same_weights(after_step[1], after_step[2], rtol=0, atol=0)  # step 2's update was skipped


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp16"], "precision bf16 or fp32"),
    (["full.train_text_encoder=true"], "trains one network per run"),
    (["method=lora"], "is for full fine-tunes"),
    (["train.optimizer=adamw8bit"], "adamw or sgd"),
    (["method=full", "full.ema=true"], "full.ema is not supported"),
])
def test_what_deepspeed_cannot_run_is_refused_before_anything_starts(tiny_sd_path, demo_data_path, overrides,
                                                                     message):
    config = engine_config(tiny_sd_path, demo_data_path, *ZERO, *overrides)
    with pytest.raises(ConfigError) as err:
        make_plan(config, CPU_ONLY)
    assert message in str(err.value) and "distributed.sharding" in str(err.value)


def test_zero_stage_3_points_to_fsdp(tiny_sd_path, demo_data_path):
    with pytest.raises(ConfigError) as err:
        engine_config(tiny_sd_path, demo_data_path, *ZERO, "distributed.zero_stage=3")
    assert "distributed.zero_stage" in str(err.value) and "fsdp" in str(err.value)
