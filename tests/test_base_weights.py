"""`model.base_weights`: a LoRA run keeps the frozen UNet / transformer in float8 (`fp8`, half of bf16's memory,
upcast layer by layer for each forward), in 4-bit NormalFloat (`nf4`, torchao's NF4Tensor, dequantized inside
each matmul) or in int8 (`int8`, torchao's weight-only int8), and still learns; the adapter stays fp32. In process
on the tiny offline SDXL and FLUX models (CPU; diffusers' layerwise casting and torchao's NF4 and int8 work the same
there), and NF4 through the real launcher on 1 and 2 processes."""

import pytest
import torch

from tests.test_bucketing_families import make_family, mixed_data, models  # noqa: F401 (fixtures)
from trainer.core.config import load_config
from trainer.errors import ConfigError

FP8 = ["model.base_weights=fp8", "train.gradient_checkpointing=true"]


def _network(family):
    return family.flow.transformer if family.name == "flux" else family.unet


def _losses(family, stream, steps=4):
    params = [p for g in family.param_groups() for p in g["params"]]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0)
    batch = [(p, *stream.item(p)) for p in stream.positions(0, 0, 0)]  # one fixed batch: the loss must go down
    losses = []
    for _ in range(steps):
        loss = family.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_fp8_base_weights_store_the_network_in_float8_and_the_lora_still_learns(tmp_path, models, mixed_data, name):
    family, stream = make_family(tmp_path / "fp8", name, models[name], mixed_data, *FP8)
    network = _network(family)
    lora_layers = {id(m) for name, m in network.named_modules() if "lora_" in name}
    linear = [m for m in network.modules() if isinstance(m, torch.nn.Linear) and id(m) not in lora_layers]
    base = [m.base_layer for m in network.modules() if hasattr(m, "base_layer")]
    stored = [m for m in linear if m.weight.dtype == torch.float8_e4m3fn]  # diffusers skips embeddings and norms
    assert base and all(m.weight.dtype == torch.float8_e4m3fn for m in base)  # every adapted layer
    assert len(stored) > 0.8 * len(linear), (len(stored), len(linear))  # and most of the others
    convs = [m for m in network.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(m.weight.dtype == torch.float32 for m in convs)  # kept: see trainer.families.components.base_weights.place_frozen_network
    trained = [p for p in network.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)

    reference, ref_stream = make_family(tmp_path / "default", name, models[name], mixed_data,
                                        "train.gradient_checkpointing=true")
    frozen_bytes = lambda net: sum(p.numel() * p.element_size() for p in net.parameters() if not p.requires_grad)  # noqa: E731
    linear_bytes = sum(p.numel() for m in stored for p in m.parameters(recurse=False))  # 1 byte each in fp8
    assert frozen_bytes(network) == frozen_bytes(_network(reference)) - 3 * linear_bytes  # fp32 -> fp8 here
    if name == "flux":  # a transformer is mostly Linear (the tiny one has relatively big embeddings: 45%)
        assert frozen_bytes(network) < 0.5 * frozen_bytes(_network(reference))

    losses, ref_losses = _losses(family, stream), _losses(reference, ref_stream)
    assert losses[-1] < losses[0], losses
    # the same draws through weights rounded to float8: close to the full-precision loss, not identical
    assert losses[0] == pytest.approx(ref_losses[0], rel=0.05) and losses[0] != ref_losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_nf4_base_weights_store_every_linear_in_4_bits_and_the_lora_still_learns(tmp_path, models, mixed_data, name):
    from torchao.quantization import NF4Tensor

    family, stream = make_family(tmp_path / "nf4", name, models[name], mixed_data, "model.base_weights=nf4",
                                 "sample.prompts=[a red circle]", "sample.steps=2", "sample.size=64")
    network = _network(family)
    lora_layers = {id(m) for name, m in network.named_modules() if "lora_" in name}
    linear = [m for m in network.modules() if isinstance(m, torch.nn.Linear) and id(m) not in lora_layers]
    base = [m.base_layer for m in network.modules() if hasattr(m, "base_layer")]
    assert base and linear and all(isinstance(m.weight, NF4Tensor) for m in linear)  # adapted layers included
    trained = [p for p in network.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 and not isinstance(p, NF4Tensor) for p in trained)

    reference, ref_stream = make_family(tmp_path / "default", name, models[name], mixed_data)
    # 4 bits per weight plus the scales: a block of 64 weights keeps one int8 scale, 256 of those one fp32 factor
    nf4_bytes = sum(m.weight.quantized_data.nbytes + m.weight.quantized_scalers.nbytes
                    + m.weight.quantization_factor.nbytes for m in linear)
    full_bytes = sum(m.weight.numel() * 4 for m in linear)  # fp32 on the CPU
    assert nf4_bytes < 0.15 * full_bytes, (nf4_bytes, full_bytes)

    losses, ref_losses = _losses(family, stream), _losses(reference, ref_stream)
    assert losses[-1] < losses[0], losses
    # the same draws through weights rounded to 4 bits: near the full-precision loss, not identical
    assert losses[0] == pytest.approx(ref_losses[0], rel=0.1) and losses[0] != ref_losses[0]
    [(prompt, [image])] = family.render_samples(step=4)  # the sampling pipeline runs on the 4-bit network too
    assert prompt == "a red circle" and image.size == (64, 64)


@pytest.mark.slow
def test_int8_base_weights_store_every_linear_in_8_bits_the_lora_learns_and_block_swap_is_exact(
        tmp_path, models, mixed_data):
    """torchao's weight-only int8 (a scale per output row) on every frozen Linear layer, on the CPU as on CUDA; with
    model.block_swap the copied int8 blocks train exactly the same LoRA."""
    from torchao.quantization import Int8Tensor

    family, stream = make_family(tmp_path / "int8", "flux", models["flux"], mixed_data, "model.base_weights=int8")
    network = _network(family)
    lora_layers = {id(m) for name, m in network.named_modules() if "lora_" in name}
    linear = [m for m in network.modules() if isinstance(m, torch.nn.Linear) and id(m) not in lora_layers]
    base = [m.base_layer for m in network.modules() if hasattr(m, "base_layer")]
    assert base and linear and all(isinstance(m.weight, Int8Tensor) for m in linear)  # adapted layers included
    assert all(m.weight.qdata.dtype == torch.int8 for m in linear)
    trained = [p for p in network.parameters() if p.requires_grad]
    assert trained and all(type(p.data) is torch.Tensor and p.dtype == torch.float32 for p in trained)

    losses = _losses(family, stream)
    assert losses[-1] < losses[0], losses
    reference, ref_stream = make_family(tmp_path / "default", "flux", models["flux"], mixed_data)
    ref_losses = _losses(reference, ref_stream)
    # the same draws through weights rounded to 8 bits per row: near the full-precision loss, not identical
    assert losses[0] == pytest.approx(ref_losses[0], rel=0.01) and losses[0] != ref_losses[0]
    swapped, swap_stream = make_family(tmp_path / "swap", "flux", models["flux"], mixed_data, "model.base_weights=int8",
                                       "train.gradient_checkpointing=true", "model.block_swap=2")
    assert _losses(swapped, swap_stream) == losses


@pytest.mark.slow
def test_nf4_lora_on_two_processes_matches_one_and_loads_in_diffusers(tmp_path, models, mixed_data):
    """Through the real launcher (torchrun, gloo DDP): DDP leaves the 4-bit frozen weights alone and averages the
    adapter's gradients, so 2 processes x 1 train the same LoRA as 1 x 2; the LoRA file loads onto the plain
    (unquantized) FLUX pipeline, which is how it is used for inference."""
    from diffusers import FluxPipeline

    from tests.engine_helpers import assert_lora_loaded, assert_same_weights, final_weights, launch, log_of

    base = [f"model.path={models['flux']}", "model.family=flux", f"data.path={mixed_data}", "precision=fp32",
            "model.base_weights=nf4", "batch.total=2", "train.steps=2", "train.optimizer=sgd", "train.lr=0.5",
            "sample.every=0", "checkpoint.every=0", "data.resolution=64", "data.flip=false", "lora.rank=4",
            "lora.alpha=8", "flow.max_sequence_length=16", "sample.prompts=[]"]
    one_dir, final = launch(tmp_path, load_config(None, [*base, "devices=cpu:1", "batch.per_device=2", "name=one"]))
    assert final["type"] == "done", log_of(one_dir)
    two_dir, final = launch(tmp_path, load_config(None, [*base, "devices=cpu:2", "batch.per_device=1", "name=two"]))
    assert final["type"] == "done", log_of(two_dir)
    trained = final_weights(one_dir)
    assert_same_weights(trained, final_weights(two_dir))

    pipe = FluxPipeline.from_pretrained(models["flux"])
    pipe.load_lora_weights(two_dir / "output")
    assert_lora_loaded(pipe, trained)


def test_fp8_base_weights_are_refused_where_they_cannot_help():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.base_weights=fp8", "train.gradient_checkpointing=false"], check_paths=False)
    assert "train.gradient_checkpointing=true" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.base_weights=fp8", "method=full", "train.gradient_checkpointing=true"],
                    check_paths=False)
    assert "is for LoRA" in str(err.value)


def test_nf4_base_weights_are_for_lora_only():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.base_weights=nf4", "method=full"], check_paths=False)
    assert "nf4 is for LoRA" in str(err.value)
    config = load_config(None, ["model.base_weights=nf4", "train.gradient_checkpointing=false"], check_paths=False)
    assert config.model.base_weights == "nf4"  # the backward keeps the 4-bit weight: no checkpointing needed


def test_bf16_is_the_unquantized_mode_and_default_its_old_name():
    """`bf16` stores the frozen network unquantized in the plan's precision (fp32 on this CPU); `default`, the name
    before, is read as bf16, so a preset or a run folder written with it loads (and resumes) unchanged."""
    assert load_config(None, [], check_paths=False).model.base_weights == "bf16"
    assert load_config({"model": {"base_weights": "default"}}, check_paths=False).model.base_weights == "bf16"
    assert load_config(None, ["model.base_weights=default"], check_paths=False).model.base_weights == "bf16"
    with pytest.raises(ConfigError, match=r"model.base_weights: 'fp16' is not one of bf16, fp8, nf4, int8"):
        load_config(None, ["model.base_weights=fp16"], check_paths=False)


def test_a_cpu_plan_takes_every_base_weight_mode():
    """Every mode has a CPU path (tests/test_base_weights_families.py trains each on every diffusion family's demo),
    so neither the config's checks nor the plan refuse one on the CPU (bf16 here: fp32, the CPU's default, is what
    that test trains)."""
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import make_plan

    for mode in ("fp8", "int8", "nf4"):
        config = load_config(None, ["model.path=x", "data.path=y", "model.family=flux", "devices=cpu:1",
                                    f"model.base_weights={mode}", "precision=bf16",
                                    "train.gradient_checkpointing=true"], check_paths=False)
        plan = make_plan(config, CPU_ONLY)
        assert plan.device == "cpu" and plan.precision == "bf16"
