"""A full fine-tune (`method: full`) of each newer flow family, through the family's own loading, loss and
outputs: one optimizer step moves the transformer's weights (and only the transformer's: the text encoders and
VAE stay the base's), and the `output/diffusers/` folder loads back through diffusers' `DiffusionPipeline` with
exactly the trained weights; where the original release ships a single file, it is written beside the folder.
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


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_a_full_fine_tune_trains_the_transformer_and_its_folder_loads_back(tmp_path, demo_asset, one_image,
                                                                         family_name):
    from diffusers import DiffusionPipeline

    config = demo_config(family_name, demo_asset, one_image, "method=full")
    warnings: list[str] = []
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), warnings.append)
    family = get_family(family_name)(ctx)
    family.load()
    items = family.prepare_data()
    family.set_prepared(family.trainable_modules())
    base = DiffusionPipeline.from_pretrained(config.model.path)

    params = [p for group in family.param_groups() for p in group["params"]]
    trained = dict(family.flow.transformer.named_parameters())
    assert sum(p.numel() for p in params) == sum(p.numel() for p in trained.values())  # the whole transformer
    stream = make_stream(items, item_buckets=getattr(family, "item_buckets", None), total=1, per_device=1,
                         world_size=1, seed=config.seed)
    loss = family.loss([(p, *stream.item(p)) for p in stream.positions(0, 0, 0)])
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    torch.optim.AdamW(params, lr=1e-2, weight_decay=0).step()

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
