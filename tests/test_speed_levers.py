"""Small speed levers that must not change what trains: the optimizer's kernel (fused on CUDA, foreach
elsewhere), and `train.channels_last` (the UNet and VAE of a LoRA run stored NHWC on CUDA: the same outputs
within float rounding). Fused QKV projections are not used: see trainer.families.components.unet_training."""

from types import SimpleNamespace

import pytest
import torch

from trainer.core.config import load_config
from trainer.core.config.schema import TrainConfig
from trainer.core.hardware import Hardware
from trainer.core.plan import make_plan
from trainer.engine.optim import build_optimizer, describe, kernel_choice
from trainer.errors import ConfigError

GPU = Hardware(gpu_count=1, bf16=True, gpu_capability=(9.0,))


def _fake(device="cuda", dtype=torch.float32):
    return SimpleNamespace(device=torch.device(device), dtype=dtype)


def test_the_fused_kernel_only_when_every_trained_tensor_is_a_plain_floating_cuda_tensor(monkeypatch):
    assert kernel_choice([_fake(), _fake(dtype=torch.bfloat16)]) == "fused"
    assert kernel_choice([_fake(), _fake("cpu")]) == "foreach"  # one stray CPU tensor
    assert kernel_choice([_fake("cpu"), _fake("cpu")]) == "foreach"
    assert kernel_choice([_fake(dtype=torch.int64)]) == "foreach"
    assert kernel_choice([]) == "foreach"

    class Shard(SimpleNamespace):  # FSDP's sharded parameters (DTensor): isinstance is all the choice asks
        pass

    monkeypatch.setattr(torch.distributed.tensor, "DTensor", Shard)
    assert kernel_choice([_fake(), Shard(device=torch.device("cuda"), dtype=torch.float32)]) == "foreach"


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_choice_reaches_the_optimizer_and_the_log(name):
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = build_optimizer([{"params": [weight], "lr": 0.1}], TrainConfig(optimizer=name))
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]  # CPU tensors
    assert describe(optimizer) == f"{type(optimizer).__name__} (foreach)"
    weight.grad = torch.ones(4)
    optimizer.step()  # and it steps


def _plan(hw, *overrides):
    return make_plan(load_config(None, list(overrides), check_paths=False), hw)


def test_channels_last_auto_is_for_unet_loras_on_cuda():
    assert _plan(GPU).channels_last  # sd, lora
    assert _plan(GPU, "model.family=sdxl").channels_last
    assert not _plan(Hardware(cpu_count=2)).channels_last
    assert not _plan(GPU, "method=full").channels_last  # its saved UNet and VAE must be contiguous
    assert not _plan(GPU, "model.family=flux").channels_last  # a transformer: nothing to gain
    assert not _plan(GPU, "train.channels_last=off").channels_last
    assert _plan(Hardware(cpu_count=2), "train.channels_last=on").channels_last  # the tests' switch
    for refused in (["method=full"], ["model.family=flux"]):
        with pytest.raises(ConfigError, match="train.channels_last: on is for LoRA runs of the UNet families"):
            load_config(None, ["train.channels_last=on", *refused], check_paths=False)


def test_a_channels_last_unet_gives_the_contiguous_ones_output():
    """The shipped tiny SD's UNet, forward and backward, both layouts: equal within float rounding."""
    from diffusers import UNet2DConditionModel

    from trainer.families.sd.demo import SHIPPED_MODEL

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_pretrained(SHIPPED_MODEL, subfolder="unet").requires_grad_(False)
    sample = torch.randn(2, 4, 16, 16)
    hidden = torch.randn(2, 8, unet.config.cross_attention_dim)
    t = torch.tensor([10, 700])

    def run():
        x = sample.clone().requires_grad_(True)
        out = unet(x, t, hidden, return_dict=False)[0]
        out.pow(2).mean().backward()
        return out.detach(), x.grad

    out, grad = run()
    unet.to(memory_format=torch.channels_last)
    assert unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    nhwc_out, nhwc_grad = run()
    torch.testing.assert_close(nhwc_out, out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(nhwc_grad, grad, rtol=1e-4, atol=1e-6)


def test_setup_stores_the_unet_channels_last_and_the_lora_contiguous(tmp_path, tiny_sdxl_path):
    """Through the family's own setup (SDXL, in process): the frozen convolutions are NHWC, the adapter's weights
    (which go to files) are plain, and the loss is the standard layout's within float rounding."""
    from tests.test_bucketing_families import batch, make_family, mixed_data  # noqa: F401

    data = tmp_path / "data"
    data.mkdir()
    from PIL import Image

    for n in range(2):
        Image.new("RGB", (64, 64), (200, 40 * n, 40)).save(data / f"img{n}.png")
        (data / f"img{n}.txt").write_text("a red square")
    family, stream = make_family(tmp_path / "nhwc", "sdxl", tiny_sdxl_path, data, "train.channels_last=on",
                                 "data.bucketing=false")
    reference, ref_stream = make_family(tmp_path / "nchw", "sdxl", tiny_sdxl_path, data, "data.bucketing=false")
    assert family.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not reference.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert family.vae.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    trained = [p for p in family.unet.parameters() if p.requires_grad]
    assert trained and all(p.is_contiguous() for p in trained)
    loss, ref_loss = family.loss(batch(stream, 0)), reference.loss(batch(ref_stream, 0))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
