"""`model.base_weights` on every diffusion family: each mode that has a CPU path (all of them: diffusers' layerwise
casting upcasts float8 on the CPU, torchao's int8 weight-only and NF4 tensors dequantize there) trains each
family's demo preset in process, through the family's own loading and loss: the frozen denoiser is stored
quantized, the loss is finite and one optimizer step moves the LoRA. The losses' closeness to full precision and
the SD / FLUX specifics are in tests/test_base_weights.py; the effect on the loss over many steps in
bench/fp8_loss.md."""

import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_bucketing_families import _Accelerator
from trainer.core.config import load_config
from trainer.core.data.stream import make_stream
from trainer.core.hardware import CPU_ONLY
from trainer.core.plan import make_plan
from trainer.families import SPECS, get_family
from trainer.families.components.base_weights import nf4_scaler_block
from trainer.families.protocol import WorkerContext

PRESETS = Path(__file__).resolve().parents[1] / "presets"
FAMILIES = [name for name, spec in SPECS.items() if spec.demo_preset and spec.section != "detection"]
MODES = ["fp8", "int8", "nf4"]  # `bf16` (unquantized) is every other test's storage
# The smallest run a demo preset makes: one image a step at 32 px (a multiple of every family's bucket side), no
# samples; fp8 needs checkpointing (the config's rule), which every family has.
SMALL = ["devices=cpu:1", "batch.total=1", "batch.per_device=1", "data.resolution=32", "sample.prompts=[]",
         "sample.every=0", "train.gradient_checkpointing=true"]
DATA_KEYS = ("path", "control_path")  # a paired dataset's two folders pair by file name


@pytest.fixture(scope="module")
def one_image(demo_asset, tmp_path_factory):
    """`one_image("demo-data")`: a folder with the first image of that demo dataset and its caption (the caches
    the families build before training then encode one image, not the demo's 16)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            source, folder = demo_asset(name), tmp_path_factory.mktemp(name)
            first = min(p for p in source.iterdir() if p.suffix == ".png")
            for path in source.glob(first.stem + ".*"):
                shutil.copy(path, folder / path.name)
            made[name] = folder
        return made[name]

    return get


def demo_config(family: str, demo_asset, one_image, *overrides: str):
    """The family's demo preset made small, its `demo://` model built by the session's `demo_asset`."""
    config = load_config(PRESETS / SPECS[family].demo_preset, [*SMALL, *overrides], check_paths=False)
    config.model.path = str(demo_asset(config.model.path.removeprefix("demo://")))
    for key in DATA_KEYS:
        value = getattr(config.data, key)
        if value:
            setattr(config.data, key, str(one_image(value.removeprefix("demo://"))))
    return config


STORED = {"fp8": lambda w: w.dtype == torch.float8_e4m3fn,
          "int8": lambda w: type(w).__name__ == "Int8Tensor",  # torchao's weight-only int8
          "nf4": lambda w: type(w).__name__ == "NF4Tensor"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family_name", FAMILIES)
def test_every_base_weight_mode_trains_every_family_demo_on_the_cpu(tmp_path, demo_asset, one_image, family_name,
                                                                    mode):
    from diffusers import ModelMixin

    config = demo_config(family_name, demo_asset, one_image, f"model.base_weights={mode}")
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), lambda message: None)
    family = get_family(family_name)(ctx)
    family.load()
    items = family.prepare_data()
    family.set_prepared(family.trainable_modules())

    # the denoiser, a diffusers model (a text encoder the SD demo also adapts keeps full precision); NF4 leaves a
    # weight whose size is no multiple of its 64-weight blocks as it is (the tiny Z-Image's 85-wide feed-forward)
    [network] = [m for m in family.trainable_modules() if isinstance(m, ModelMixin)]
    adapted = [m.base_layer.weight for m in network.modules() if hasattr(m, "base_layer")]
    storable = [w for w in adapted if mode != "nf4" or nf4_scaler_block(w.numel())]
    assert len(storable) > 0.5 * len(adapted) and all(STORED[mode](w) for w in storable), family_name

    params = [p for group in family.param_groups() for p in group["params"]]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0)
    stream = make_stream(items, item_buckets=getattr(family, "item_buckets", None), total=1, per_device=1,
                         world_size=1, seed=config.seed)
    loss = family.loss([(p, *stream.item(p)) for p in stream.positions(0, 0, 0)])
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    optimizer.step()
    assert all(p.dtype == torch.float32 for p in params)  # the adapter trains in fp32
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params))  # and one step moved it
