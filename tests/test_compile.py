"""`train.compile`: the trained network's repeated blocks compiled in place (trainer.engine.compile).

Compiled training computes what eager training does (in process, on the demo's tiny SD model), through the real
launcher under DDP with gradient checkpointing and samples; each compile is reported and left out of samples/s;
what cannot compile is refused before anything starts, with the reason; the plan lists the shapes it compiles for.

Compiling on the CPU is slow the first time (gcc builds every kernel: about a minute for the tiny UNet's graphs on
2 busy cores) and fast afterwards (inductor's on-disk cache, shared by the processes of a session): the tests use
the same shapes (64 px, micro-batch 1) so that the later ones find the graphs the first one compiled.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import assert_same_weights, engine_config, final_weights, launch, log_of, progress
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.core.hardware import CPU_ONLY, Hardware
from trainer.core.plan import make_plan
from trainer.engine.loop import Throughput
from trainer.errors import ConfigError
from trainer.families.protocol import Sample

GPUS = Hardware(gpu_count=2, gpu_names=("H100", "H100"), gpu_memory_gb=(80.0, 80.0), bf16=True, cpu_count=16)


# ---- in process: compiled training computes what eager training does --------------------------------------------
def _sd_family(tmp_path, model, data, *overrides):
    from tests.test_caption_augment import _context
    from trainer.families import get_family

    config = load_config(None, [f"model.path={model}", f"data.path={data}", "precision=fp32", "devices=cpu:1",
                                "batch.total=1", "data.resolution=64", "lora.rank=4", "lora.alpha=8", *overrides])
    ctx, warnings = _context(tmp_path, config)
    family = get_family("sd")(ctx)
    family.load()
    family.prepare_data()
    family.set_prepared(family.trainable_modules())
    return family, warnings


def _train(family, steps: int) -> list[float]:
    """`steps` AdamW steps of one sample each, as the loop takes them (its seed per step, the family's loss)."""
    params = [p for group in family.param_groups() for p in group["params"]]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        loss = family.loss([Sample(step, 0, step)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_compiled_training_matches_eager_and_samples_still_draw(tmp_path, tiny_sd_path, demo_data_path):
    """Three AdamW steps of the test's tiny SD UNet with its LoRA, eager and with its 4 transformer blocks
    compiled: the same losses and weights within float32 rounding. Inductor fuses and reorders the blocks' float32
    maths, which may move results in their last bits; AdamW divides each gradient by its own running size, so a
    last-bit difference in a near-zero gradient can move a weight by a visible fraction of lr (1e-3). Measured:
    the three losses equal to the bit, the weights at most 6e-6 apart. Tolerances: 1e-4 relative on the losses,
    1e-4 on the weights (17 times the measured gap, a tenth of what one step moves a weight)."""
    from trainer.engine.compile import compile_network

    eager, _ = _sd_family(tmp_path / "eager", tiny_sd_path, demo_data_path)
    compiled, warnings = _sd_family(tmp_path / "compiled", tiny_sd_path, demo_data_path)
    compiler = compile_network(compiled, compiled.ctx.plan, warnings.append, main=False)
    blocks = [m for m in compiled.unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    assert compiler.blocks == len(blocks) == 4 and all(m._compiled_call_impl is not None for m in blocks)
    # past dynamo's default of 8 graphs per function it would run the blocks eagerly without a word: 4 blocks x
    # (3 shapes for the one training shape + the samples' + a spare) x 2
    assert torch._dynamo.config.recompile_limit >= 4 * 5 * 2
    lora_in_blocks = [n for n, _ in compiled.unet.named_parameters() if "lora_A" in n and "transformer_blocks" in n]
    assert lora_in_blocks, "the adapters sit inside the compiled blocks"

    expected, got = _train(eager, 3), _train(compiled, 3)
    assert got == pytest.approx(expected, rel=1e-4)
    assert_same_weights(eager.trainable_state(), compiled.trainable_state(), rtol=1e-4, atol=1e-4)
    # the heartbeat's phase while a new shape compiles: not `step N`, which the stall watch would count
    assert compiler.phase("step 3") == "compiling for input 1x4x16x16 at step 3"
    assert compiler.compiled(3) and not compiler.compiled(4) and compiler.phase("step 5") == "step 5"
    assert len(warnings) == 1 and warnings[0].startswith(
        "train.compile: compiled the 4 blocks (4 BasicTransformerBlock) of the UNet2DConditionModel for input "
        "1x4x16x16 in ")

    # Samples run the same blocks without gradients (and with classifier-free guidance's doubled batch): they
    # compile again, once, and draw.
    images = compiled.sample(["a red circle"], [0], size=64, steps=2)
    assert images[0].size == (64, 64)
    assert compiler.compiled(5) and "for input 2x4x16x16 without gradients in " in warnings[-1]


# ---- through the launcher: DDP, gradient checkpointing, samples, events ------------------------------------------
@pytest.mark.slow
def test_two_processes_train_compiled_with_checkpointing_and_samples_and_report_each_compile(tmp_path, tiny_sd_path,
                                                                                           demo_data_path):
    """2 gloo processes x 1 per device, gradient checkpointing, samples at the start and every 2 steps: the run
    trains compiled to `done`, every compile is a `warning` event, and the steps that compiled have no samples/s
    of their own. (That DDP's compiled weights are eager's is what the in-process test shows for one process; the
    same launch without train.compile, compared by hand, ended 9e-8 away, at the price of another 30 s launch.)"""
    config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:2", "batch.total=2", "batch.per_device=1",
                           "train.steps=3", "sample.every=2", "sample.prompts=[a red circle]", "sample.steps=2",
                           "train.gradient_checkpointing=true", "train.compile=true", "name=compiled")
    compiled_dir, final = launch(tmp_path, config, timeout=540)  # a cold inductor cache: minutes of gcc
    assert final["type"] == "done", log_of(compiled_dir)
    trained = final_weights(compiled_dir)
    assert all(torch.isfinite(w).all() for w in trained.values())
    assert max(w.abs().max().item() for name, w in trained.items() if "lora_B" in name) > 1e-4  # it learnt

    events = read_events(compiled_dir)
    plan = events[0]
    assert any(n.startswith("train.compile: the network's repeated blocks are compiled") for n in plan["notes"])
    reports = [e["message"] for e in events if e["type"] == "warning" and e["message"].startswith("train.compile")]
    # step 1 compiled the training graphs and, before it, the start's samples (rank 0 draws them)
    assert "for input 2x4x16x16 without gradients, input 1x4x16x16 in " in reports[0] and "by step 1;" in reports[0]
    compiled_steps = {int(m.split("by step ")[1].split(";")[0]) for m in reports}
    for event in progress(compiled_dir):
        assert (event["samples_per_s"] is None) == (event["step"] in compiled_steps or event["step"] == 1), event
    assert "train.compile: 4 blocks (4 BasicTransformerBlock) of the UNet2DConditionModel compiled in place" \
        in log_of(compiled_dir)
    assert [e["step"] for e in events if e["type"] == "sample"] == [0, 2, 3]


# ---- the loop's throughput -----------------------------------------------------------------------------------
def test_a_step_that_compiled_is_left_out_of_samples_per_second(monkeypatch):
    clock = iter([0.0, 1.0, 31.0, 32.0, 33.0])  # step 2 compiled for 30 s; the others take 1 s
    monkeypatch.setattr("trainer.engine.loop.time.perf_counter", lambda: next(clock))
    throughput = Throughput()
    rates = []
    for compiled in (False, False, True, False, False):
        throughput.tick(4, counted=not compiled)
        rates.append(throughput.rate())
    assert rates == [None, 4.0, None, 4.0, 4.0]


# ---- refused before anything starts, with the reason -------------------------------------------------------------
def _refusal(*overrides, hw=CPU_ONLY, parameters=None) -> str:
    with pytest.raises(ConfigError) as err:
        make_plan(load_config(None, ["model.path=x", "train.compile=true", *overrides], check_paths=False), hw,
                  parameters)
    return str(err.value)


def test_what_cannot_compile_is_refused_with_the_reason():
    detection = _refusal("model.family=detection", "model.path=fcos_tiny", "detection.weights=none")
    assert "train.compile: not for detection" in detection and "Set train.compile=false" in detection
    fp8 = _refusal("model.base_weights=fp8", "train.gradient_checkpointing=true")
    assert "train.compile: does not work with model.base_weights=fp8" in fp8 and "nf4" in fp8
    fsdp = _refusal("devices=cpu:2", "method=full", "distributed.sharding=fsdp", "batch.total=2")
    assert "train.compile: not supported with distributed.sharding=fsdp: FSDP2" in fsdp
    chosen = _refusal("model.family=sdxl", "method=full", "devices=2", hw=GPUS, parameters=int(6e9))
    assert "sharding=fsdp (chosen by distributed.sharding=auto" in chosen
    deepspeed = _refusal("devices=cpu:2", "method=full", "distributed.sharding=deepspeed", "batch.total=2")
    assert "train.compile: not supported with distributed.sharding=deepspeed" in deepspeed
    assert make_plan(load_config(None, ["model.path=x", "train.compile=true", "model.base_weights=nf4"],
                                 check_paths=False), CPU_ONLY)  # nf4 compiles


# ---- the plan's note -----------------------------------------------------------------------------------------
def test_the_plan_lists_the_shapes_the_blocks_compile_for(tmp_path):
    from tests.test_buckets import _images
    from trainer.core.family_spec import check_captioned_images

    def plan(*overrides):
        config = load_config(None, ["model.path=x", "devices=cpu:1", "batch.total=2", *overrides], check_paths=False)
        made = make_plan(config, CPU_ONLY)
        return made, [n for n in made.notes if n.startswith("train.compile")], config

    assert plan()[1] == []
    _, notes, _ = plan("train.compile=true", "data.resolution=64", "batch.per_device=2", "sample.prompts=[a cat]",
                       "data.val_split=0.25")
    assert notes == ["train.compile: the network's repeated blocks are compiled (regional, static shapes), once per "
                     "input shape: training at 64x64 (micro-batch 2); without gradients, samples at 64x64 and the "
                     "validation loss; a step that compiles is left out of samples/s and a warning event gives its "
                     "compile time"]
    data = _images(tmp_path / "data", [(64, 64), (64, 64), (96, 48), (48, 96)])
    made, notes, config = plan("train.compile=true", f"data.path={data}", "data.resolution=64",
                               "data.bucketing=true", "data.bucket_step=16", "sample.size=32")
    assert "training at each aspect-ratio bucket of about 64x64 (micro-batch 1)" in notes[0]
    bucketed = made.with_buckets(config, check_captioned_images(config))
    compile_notes = [n for n in bucketed.notes if n.startswith("train.compile")]
    assert len(compile_notes) == 1 and "training at 64x64, 48x80, 80x48 (micro-batch 1)" in compile_notes[0]
    assert "samples at" not in compile_notes[0]  # sample.size alone draws nothing: no sample prompts


def test_a_machine_without_a_compiler_is_told_before_anything_starts(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "needs a C++ compiler (g++, or CXX), which was not found" in _refusal()
    assert "needs a C compiler for Triton" in _refusal("devices=1", hw=GPUS)
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}" if name == "clang" else None)
    assert make_plan(load_config(None, ["model.path=x", "train.compile=true", "devices=1"], check_paths=False), GPUS)
