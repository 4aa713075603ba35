"""The plan: devices, effective batch, precision and attention on many machines, as a pure function."""

import pytest

from trainer.core.config import load_config
from trainer.errors import ConfigError
from trainer.core.hardware import Hardware
from trainer.core.plan import make_plan, resolve_batch

CPU = Hardware(cpu_count=2)
AMPERE_X4 = Hardware(gpu_count=4, gpu_names=("A100",) * 4, bf16=True)
TURING_X2 = Hardware(gpu_count=2, gpu_names=("T4",) * 2, bf16=False)
XFORMERS = Hardware(gpu_count=1, bf16=True, xformers=True)


def plan(hw, **keys):
    overrides = [f"{k.replace('__', '.')}={v}" for k, v in keys.items()]
    return make_plan(load_config(None, overrides, check_paths=False), hw)


@pytest.mark.parametrize(
    "hw, devices, total, per_device, expect",
    [
        (CPU, "auto", 4, 1, ("cpu", 1, 1, 4)),
        (CPU, "cpu:2", 4, 1, ("cpu", 2, 1, 2)),
        (CPU, "cpu:2", 4, 2, ("cpu", 2, 2, 1)),
        (AMPERE_X4, "auto", 16, 2, ("cuda", 4, 2, 2)),
        (AMPERE_X4, 2, 16, 2, ("cuda", 2, 2, 4)),
        (AMPERE_X4, "[1,3]", 8, 4, ("cuda", 2, 4, 1)),
        (AMPERE_X4, 1, 16, 2, ("cuda", 1, 2, 8)),
        (TURING_X2, "auto", 32, 4, ("cuda", 2, 4, 4)),
    ],
)
def test_accumulation_keeps_the_effective_batch(hw, devices, total, per_device, expect):
    p = plan(hw, devices=devices, batch__total=total, batch__per_device=per_device)
    device, procs, per, acc = expect
    assert (p.device, p.world_size, p.per_device, p.accumulation) == expect
    assert p.per_device * p.world_size * p.accumulation == p.total == total
    assert p.notes == ()


def test_steps_and_schedule_do_not_depend_on_the_number_of_processes():
    one = plan(AMPERE_X4, devices=1, batch__total=16, train__steps=500)
    four = plan(AMPERE_X4, devices=4, batch__total=16, train__steps=500)
    assert one.steps == four.steps == 500 and one.total == four.total


def test_precision_auto_and_explicit():
    assert plan(CPU).precision == "fp32"
    assert plan(AMPERE_X4).precision == "bf16"
    assert plan(TURING_X2).precision == "fp16"
    assert plan(CPU, precision="bf16").precision == "bf16"  # CPU autocast supports bf16
    with pytest.raises(ConfigError, match="bf16 is not supported by these GPUs"):
        plan(TURING_X2, precision="bf16")


def test_attention_backend():
    assert plan(CPU).attention == "sdpa"
    assert plan(AMPERE_X4).attention == "sdpa"
    assert plan(XFORMERS).attention == "xformers"
    with pytest.raises(ConfigError, match="xformers is not usable here"):
        plan(CPU, attention="xformers")


def test_undividable_batches_are_resolved_and_explained():
    p = plan(CPU, devices="cpu:2", batch__total=6, batch__per_device=2)
    assert (p.per_device, p.accumulation, p.total) == (1, 3, 6)
    assert "per_device lowered from 2 to 1" in p.notes[0]
    p = plan(AMPERE_X4, devices=4, batch__total=10, batch__per_device=1)
    assert p.total == 8 and "not a multiple of 4 processes; using batch 8" in p.notes[0]
    assert resolve_batch(12, 8, 1)[:3] == (12, 6, 2)


def test_a_plan_that_cannot_be_met_says_why():
    with pytest.raises(ConfigError) as err:
        plan(AMPERE_X4, devices=4, batch__total=2, precision="fp16", train__optimizer="adamw8bit")
    text = str(err.value)
    assert "batch.total: 2 is smaller than the 4 processes" in text
    assert "adamw8bit needs bitsandbytes" in text
    with pytest.raises(ConfigError, match="asks for 3 GPUs but this machine has 2"):
        plan(TURING_X2, devices=3)
    with pytest.raises(ConfigError, match=r"GPU ids \[5\] do not exist"):
        plan(AMPERE_X4, devices="[0,5]")


def test_plan_line_and_event():
    p = plan(AMPERE_X4, devices=2, batch__total=16, batch__per_device=2)
    assert p.line() == "2 processes x 2 per device x accumulation 4 = batch 16 · bf16 · sdpa · gpu 0,1"
    event = p.event()
    for key in ("world_size", "per_device", "accumulation", "total", "precision", "attention", "devices"):
        assert key in event
    assert event["devices"] == [0, 1] and event["world_size"] == 2
    multi = plan(AMPERE_X4, devices=4, batch__total=16, distributed__nodes=2)
    assert multi.world_size == 8 and multi.line().startswith("2 nodes x 4 processes x 1 per device x accumulation 2")


# ---- FSDP: chosen when a full fine-tune's weights + gradients + optimizer state would not fit ------------------

GPUS_24GB_X4 = Hardware(gpu_count=4, gpu_names=("RTX 4090",) * 4, gpu_memory_gb=(24.0,) * 4, bf16=True)
GPUS_80GB_X2 = Hardware(gpu_count=2, gpu_names=("H100",) * 2, gpu_memory_gb=(80.0,) * 2, bf16=True)


def sized_plan(hw, parameters, *overrides):
    return make_plan(load_config(None, list(overrides), check_paths=False), hw, parameters)


def test_auto_sharding_uses_fsdp_only_for_full_finetunes_that_do_not_fit():
    sdxl, sd15 = 2.57e9, 0.86e9  # x 16 bytes (fp32 weight + gradient + AdamW): 41 GB and 14 GB
    big = sized_plan(GPUS_24GB_X4, int(sdxl), "model.family=sdxl", "method=full", "batch.total=4")
    assert big.sharding == "fsdp" and big.line().endswith("· bf16 · sdpa · fsdp · gpu 0,1,2,3")
    assert any("about 38 GB" in note and "4 processes" in note for note in big.notes), big.notes
    assert sized_plan(GPUS_24GB_X4, int(sd15), "method=full", "batch.total=4").sharding == "ddp"  # fits
    assert sized_plan(GPUS_80GB_X2, int(sdxl), "model.family=sdxl", "method=full").sharding == "ddp"
    assert sized_plan(GPUS_24GB_X4, int(sdxl), "model.family=sdxl", "method=lora").sharding == "ddp"
    one = sized_plan(GPUS_24GB_X4, int(sdxl), "model.family=sdxl", "method=full", "devices=1")
    assert one.sharding == "ddp" and any("expect out-of-memory" in note for note in one.notes)
    assert "fsdp" not in one.line()


def test_fsdp_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError) as err:
        sized_plan(CPU, None, "devices=cpu:2", "method=lora", "distributed.sharding=fsdp", "batch.total=2")
    assert "fsdp is for full fine-tunes" in str(err.value)
    with pytest.raises(ConfigError) as err:
        sized_plan(CPU, None, "devices=cpu:2", "method=full", "full.ema=true", "distributed.sharding=fsdp",
                   "batch.total=2")
    assert "full.ema" in str(err.value)
    with pytest.raises(ConfigError) as err:
        sized_plan(CPU, None, "devices=cpu:2", "model.family=detection", "model.path=fcos_tiny",
                   "detection.weights=none", "method=full", "distributed.sharding=fsdp",
                   "batch.total=2")
    assert "fsdp is not available for detection" in str(err.value)
    assert sized_plan(CPU, None, "devices=cpu:2", "method=full", "distributed.sharding=fsdp",
                      "batch.total=2").sharding == "fsdp"


def test_model_size_is_read_from_the_safetensors_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    from trainer.core.model_size import trained_parameters
    from trainer.families.flow.spec import FLUX

    (tmp_path / "transformer").mkdir()
    save_file({"a.weight": torch.zeros(3, 5), "b.bias": torch.zeros(7)}, str(tmp_path / "transformer" / "x.safetensors"))
    save_file({"c.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(tmp_path / "transformer" / "y.safetensors"))
    assert trained_parameters("flux", str(tmp_path)) == 15 + 7 + 4
    assert trained_parameters("flux", "black-forest-labs/FLUX.1-dev") == FLUX.published_parameters
    assert trained_parameters("sd3", "stabilityai/stable-diffusion-3.5-large") == 8.06e9
    single = tmp_path / "model.safetensors"
    save_file({"model.diffusion_model.x": torch.zeros(10), "first_stage_model.y": torch.zeros(99)}, str(single))
    assert trained_parameters("sd", str(single)) == 10
    assert trained_parameters("detection", str(tmp_path)) is None


def test_attention_xformers_is_planned_only_where_it_is_applied():
    gpu = Hardware(gpu_count=1, gpu_memory_gb=(80.0,), bf16=True, xformers=True)
    assert make_plan(load_config(None, ["devices=1"], check_paths=False), gpu).attention == "xformers"
    for family in ("flux", "sd3"):
        auto = make_plan(load_config(None, ["devices=1", f"model.family={family}"], check_paths=False), gpu)
        asked = make_plan(load_config(None, ["devices=1", f"model.family={family}", "attention=xformers"],
                                      check_paths=False), gpu)
        assert auto.attention == asked.attention == "sdpa" and "sdpa" in asked.line()
        assert any("xformers applies to the UNet families only" in note for note in asked.notes)
