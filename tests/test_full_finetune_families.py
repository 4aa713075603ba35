"""A full fine-tune (`method: full`) of each newer flow family, through the family's own loading, loss and
outputs: one optimizer step moves the transformer's weights (and only the transformer's: the text encoders and
VAE stay the base's), and the `output/diffusers/` folder loads back through diffusers' `DiffusionPipeline` with
exactly the trained weights; where the original release ships a single file, it is written beside the folder.
Under FSDP (`distributed.sharding: fsdp`, here one gloo process: every unit sharded as on a node of GPUs, its hooks
in the forward and backward) the same step gives the same weights, so nothing of a family's transformer escapes
the sharding; that shards across several processes equal one is test_fsdp's, on FLUX.1 and SD.
SD, SDXL, SD3 and FLUX.1 full fine-tunes run through the launcher in their own modules (test_sd/test_sdxl,
test_flux_sd3, test_presets_run's flux-dev-full-fsdp); in process here, as test_base_weights_families trains each
family's demo preset, because a launch per family would cost the suite ~20 s each in imports alone."""

import math

import pytest
import torch

from tests.test_base_weights_families import demo_config, one_image  # noqa: F401  (a fixture)
from tests.test_bucketing_families import _Accelerator
from trainer.core.data.stream import make_stream
from trainer.core.hardware import CPU_ONLY
from trainer.core.plan import make_plan
from trainer.families import get_family
from trainer.families.protocol import WorkerContext

pytestmark = pytest.mark.slow

# family -> whether its release ships a single file beside the diffusers folder (test_export_single_files)
FAMILIES = {"flux2": True, "flux2_klein": True, "chroma": True, "flux_kontext": True, "zimage": False,
            "qwenimage": False, "qwenimage_edit": False}


def _full_family(tmp_path, demo_asset, one_image, family_name):
    config = demo_config(family_name, demo_asset, one_image, "method=full")
    warnings: list[str] = []
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), warnings.append)
    family = get_family(family_name)(ctx)
    family.load()
    items = family.prepare_data()
    stream = make_stream(items, item_buckets=getattr(family, "item_buckets", None), total=1, per_device=1,
                         world_size=1, seed=config.seed)
    return family, [(p, *stream.item(p)) for p in stream.positions(0, 0, 0)], warnings


def _step(family, batch, optimizer=torch.optim.AdamW) -> float:
    params = [p for group in family.param_groups() for p in group["params"]]
    loss = family.loss(batch)
    loss.backward()
    optimizer(params, lr=1e-2).step()
    return float(loss.detach())


@pytest.fixture
def one_process_group():
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_a_sharded_full_fine_tune_takes_the_same_step(tmp_path, demo_asset, one_image, one_process_group,
                                                     family_name):
    from trainer.engine.parallel.fsdp import FSDP

    plain, batch, _ = _full_family(tmp_path / "plain", demo_asset, one_image, family_name)
    plain.set_prepared(plain.trainable_modules())
    # SGD: its step is linear in the gradient, which FSDP sums in another order (Adam's first step, g / (|g| + eps),
    # turns a last-bit difference in a near-zero gradient into ~1e-5 of its 1e-2 step)
    expected_loss = _step(plain, batch, torch.optim.SGD)
    sharded, batch, _ = _full_family(tmp_path / "fsdp", demo_asset, one_image, family_name)
    fsdp = FSDP(lambda module: module)
    fsdp.shard(sharded)
    assert type(sharded.flow.transformer).__name__.startswith("FSDP")  # fully_shard's class, with its hooks
    assert _step(sharded, batch, torch.optim.SGD) == pytest.approx(expected_loss, rel=1e-6)
    with fsdp.gathered():
        gathered = fsdp.unwrap(sharded.flow.transformer).state_dict()
    for name, weight in plain.flow.transformer.state_dict().items():
        torch.testing.assert_close(gathered[name], weight, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_a_full_fine_tune_trains_the_transformer_and_its_folder_loads_back(tmp_path, demo_asset, one_image,
                                                                         family_name):
    from diffusers import DiffusionPipeline

    family, batch, warnings = _full_family(tmp_path, demo_asset, one_image, family_name)
    family.set_prepared(family.trainable_modules())
    base = DiffusionPipeline.from_pretrained(family.cfg.model.path)
    params = [p for group in family.param_groups() for p in group["params"]]
    trained = dict(family.flow.transformer.named_parameters())
    assert sum(p.numel() for p in params) == sum(p.numel() for p in trained.values())  # the whole transformer
    assert math.isfinite(_step(family, batch))

    outputs = family.save_outputs(tmp_path / "output", step=1)
    assert outputs[0] == str(tmp_path / "output" / "diffusers")
    assert (len(outputs) == 2 and outputs[1].endswith(".safetensors")) is FAMILIES[family_name], (outputs, warnings)
    loaded = DiffusionPipeline.from_pretrained(outputs[0])
    assert type(loaded) is type(base)
    moved = 0
    for name, weight in loaded.transformer.state_dict().items():
        assert torch.equal(weight, trained[name].detach()) if name in trained else True, name
        moved += not torch.equal(weight, base.transformer.state_dict()[name])
    assert moved > 0.5 * len(trained)  # the step reached most of the transformer
    for part in ("vae", "text_encoder"):  # frozen in a full fine-tune of these families: the base's, exactly
        for name, weight in getattr(loaded, part).state_dict().items():
            assert torch.equal(weight, getattr(base, part).state_dict()[name]), f"{part}.{name}"
