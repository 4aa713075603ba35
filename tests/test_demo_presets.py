"""Every family ships an offline demo preset (its spec's `demo_preset`) on its own tiny model: the preset names
the family and only demo assets the registry builds, and the diffusion demos run through the real launcher to
`done` with samples and outputs that load back through diffusers with the trained weights. (The detection
demo's run and its mAP are checked in test_detection.py.)"""

from pathlib import Path

import pytest
import yaml

from tests.engine_helpers import assert_lora_loaded, final_weights, launch, log_of
from trainer.core.config import load_config
from trainer.core.config.validate import DEMO_SCHEME
from trainer.core.events import read_events
from trainer.families import SPECS, demo_builders
from trainer.families.components.trained_weights import sample_prompts
from trainer.families.sd.demo import SHIPPED_MODEL

PRESETS = Path(__file__).resolve().parents[1] / "presets"
PIPELINES = {"sd": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
             "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_family_ships_a_demo_preset_of_demo_assets(family):
    spec = SPECS[family]
    raw = yaml.safe_load((PRESETS / spec.demo_preset).read_text())
    assert raw["model"]["family"] == family
    paths = [raw["model"]["path"], raw["data"]["path"]]
    demo = [p[len(DEMO_SCHEME):] for p in paths if p.startswith(DEMO_SCHEME)]
    assert raw["data"]["path"].startswith(DEMO_SCHEME) and set(demo) <= set(demo_builders())
    assert set(spec.demo_assets) <= set(demo_builders())
    load_config(PRESETS / spec.demo_preset, ["devices=cpu:1"], check_paths=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(PIPELINES))
def test_the_demo_preset_trains_to_done_and_its_lora_loads(tmp_path, family):
    import diffusers

    spec = SPECS[family]
    # The preset as shipped, shortened: the wiring is what is tested here; the runs folder's .demo/ is built
    # through the registry like a user's first run.
    config = load_config(PRESETS / spec.demo_preset, ["devices=cpu:1", "precision=fp32", "train.steps=4",
                                                      "sample.every=2", "sample.steps=2"])
    run_dir, final = launch(tmp_path, config)
    assert final["type"] == "done", log_of(run_dir)
    samples = [e["step"] for e in read_events(run_dir) if e["type"] == "sample"]
    prompts = len(sample_prompts(config.sample))
    assert samples == [0] * prompts + [2] * prompts + [4] * prompts
    assert all((run_dir / e["path"]).is_file() for e in read_events(run_dir) if e["type"] == "sample")
    model = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"])
    if family == "sd":  # the pretrained base ships with the package
        assert model == SHIPPED_MODEL
    else:
        assert model.parent.name == ".demo"  # built once under the runs folder, shared by later runs
    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(model)
    pipe.load_lora_weights(run_dir / "output")
    assert_lora_loaded(pipe, final_weights(run_dir))
    kohya = list((run_dir / "output").glob("*_kohya.safetensors"))  # ComfyUI reads SD3's diffusers file as is
    assert len(kohya) == (0 if family == "sd3" else 1)
