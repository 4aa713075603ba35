"""Every shipped SDXL and FLUX preset runs through the real launcher on its tiny offline counterpart (64 px, a
few steps, fp32 on the CPU; everything else as the preset says: LoRA on the text encoders, fp8 / NF4 base
weights, buckets, gradient checkpointing, sampler settings), and its outputs load back through diffusers with
exactly the weights the run trained. (flux-dev-lora-24gb and sd35-lora run in test_flux_sd3.)"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine_helpers import BASE, assert_lora_loaded, final_weights, launch, log_of
from trainer.core.config import load_config
from trainer.core.events import read_events

pytestmark = pytest.mark.slow

PRESETS = Path(__file__).parent.parent / "presets"
TINY = {  # preset -> tiny model
    "sdxl-lora-16gb": "sdxl", "sdxl-lora-24gb": "sdxl", "sdxl-full-80gb": "sdxl",
    "flux-schnell-lora-16gb": "flux-schnell", "flux-dev-lora-12gb": "flux-dev", "flux-dev-full-fsdp": "flux-dev",
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_sdxl_path, tiny_flux_path):
    from trainer.families.sd.demo import make_demo_dataset
    from trainer.families.flow.demo import make_tiny_flux

    root = tmp_path_factory.mktemp("preset-assets")
    return {"sdxl": tiny_sdxl_path, "flux-dev": tiny_flux_path,
            "flux-schnell": make_tiny_flux(root / "flux-schnell", guidance_embeds=False),
            "data": make_demo_dataset(root / "data", count=4)}


def _pipeline(model: str, path: Path):
    from diffusers import FluxPipeline, StableDiffusionXLPipeline

    return (StableDiffusionXLPipeline if model == "sdxl" else FluxPipeline).from_pretrained(path)


@pytest.mark.parametrize("preset", sorted(TINY))
def test_shipped_preset_runs_on_its_tiny_model_and_its_outputs_load(tmp_path, assets, preset):
    model = TINY[preset]
    flow = ["flow.max_sequence_length=16"] if model != "sdxl" else []
    config = load_config(PRESETS / f"{preset}.yaml", [
        f"model.path={assets[model]}", f"data.path={assets['data']}", *BASE, *flow, "devices=cpu:1",
        "train.steps=2", "train.warmup_steps=0", "sample.every=2", "sample.steps=2", "sample.size=64",
        "checkpoint.every=0", "name=tiny"])
    run_dir, final = launch(tmp_path, config)
    assert final["type"] == "done", log_of(run_dir)
    prompts = len(config.sample.prompts)
    assert [e["step"] for e in read_events(run_dir) if e["type"] == "sample"] == [0] * prompts + [2] * prompts

    trained = final_weights(run_dir)  # "<component>.<parameter>", what the run optimized
    components = {name.split(".")[0] for name in trained}
    if config.method == "full":
        pipe = _pipeline(model, run_dir / "output" / "diffusers")
        for component in components:
            state = getattr(pipe, component).state_dict()
            for name, value in trained.items():
                if name.startswith(component + "."):
                    torch.testing.assert_close(state[name.removeprefix(component + ".")], value)
        assert (run_dir / "output" / "tiny.safetensors").is_file()  # the single file (SGM / BFL layout)
    else:
        pipe = _pipeline(model, assets[model])
        pipe.load_lora_weights(run_dir / "output")  # the diffusers/peft file, through the pipeline's own loader
        assert_lora_loaded(pipe, trained)
        kohya = list((run_dir / "output").glob("*_kohya.safetensors"))  # the ComfyUI / Forge file
        assert len(kohya) == 1 and load_file(str(kohya[0]))
    if preset == "sdxl-lora-24gb":  # LoRA on both text encoders too
        assert {"unet", "text_encoder", "text_encoder_2"} <= components
