"""`model.base_weights: fp8`: a LoRA run keeps the frozen UNet / transformer in float8 (half of bf16's memory),
upcast layer by layer for each forward, and still learns; the adapter stays fp32. In process, on the tiny
offline SDXL and FLUX models (CPU; diffusers' layerwise casting works the same there)."""

import pytest
import torch

from tests.test_bucketing_families import make_family, mixed_data, models  # noqa: F401 (fixtures)
from trainer.config import load_config
from trainer.errors import ConfigError

pytestmark = pytest.mark.slow

FP8 = ["model.base_weights=fp8", "train.gradient_checkpointing=true"]


def _network(family):
    return family.transformer if family.name == "flux" else family.unet


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
    assert all(m.weight.dtype == torch.float32 for m in convs)  # kept: see trainer.precision.store_base_weights
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


def test_fp8_base_weights_are_refused_where_they_cannot_help():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.base_weights=fp8", "train.gradient_checkpointing=false"], check_paths=False)
    assert "train.gradient_checkpointing=true" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.base_weights=fp8", "method=full", "train.gradient_checkpointing=true"],
                    check_paths=False)
    assert "is for LoRA" in str(err.value)
