"""FLUX.1 and SD3 LoRA through the real launcher on tiny random models (built offline as diffusers folders):
the training loss on fixed draws goes down, the diffusers LoRA file loads back through FluxPipeline /
StableDiffusion3Pipeline and reproduces the trained transformer, the FLUX kohya/ComfyUI file carries the expected
keys and metadata and loads through diffusers' kohya conversion; an SD3 full fine-tune's single file holds the
trained weights."""

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.engine_helpers import BASE, final_weights, launch, log_of, progress
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.families.components import flow_matching as fm

pytestmark = pytest.mark.slow

FLOW = ["devices=cpu:1", "batch.per_device=4", "train.steps=8", "train.lr=5e-3", "train.warmup_steps=0",
        "train.scheduler=constant", "flow.max_sequence_length=16", "data.flip=false", "sample.every=0",
        "checkpoint.every=0"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_flux_path, tiny_sd3_path):
    from trainer.families.sd.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("flow-assets")
    return {"flux": tiny_flux_path, "sd3": tiny_sd3_path,
            "data": make_demo_dataset(root / "data", count=4)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("flow-runs")


PRESETS = Path(__file__).parent.parent / "presets"


def _run(runs, assets, family, preset, *extra):
    """The shipped preset, on the tiny model and data (64 px, 8 steps, fp32 on the CPU)."""
    config = load_config(PRESETS / preset, [f"model.path={assets[family]}", f"data.path={assets['data']}", *BASE,
                                            f"name={family}", *FLOW, "sample.size=64", "sample.steps=2", *extra])
    assert config.model.family == family
    run_dir, final = launch(runs, config)
    assert final["type"] == "done", log_of(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def flux_run(runs, assets):
    return _run(runs, assets, "flux", "flux-dev-lora-24gb.yaml")


@pytest.fixture(scope="module")
def sd3_run(runs, assets):
    return _run(runs, assets, "sd3", "sd35-lora.yaml", "sample.prompts=[]")


def _pipe(family, path):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = FluxPipeline if family == "flux" else StableDiffusion3Pipeline
    pipe = cls.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _predict(family, transformer, noisy, sigmas, embeds, pooled):
    if family == "sd3":
        return transformer(hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=embeds,
                           pooled_projections=pooled, return_dict=False)[0]
    b, _, h, w = noisy.shape
    out = transformer(hidden_states=fm.pack_latents(noisy), timestep=sigmas, guidance=torch.ones(b),
                      pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=torch.zeros(embeds.shape[1], 3),
                      img_ids=fm.latent_image_ids(h, w), return_dict=False)[0]
    return fm.unpack_latents(out, h, w)


@torch.no_grad()
def _fixed_batch(family, pipe, data):
    """The training images' latents and captions with fixed noise and sigmas (16 draws)."""
    from trainer.families.components.captioned import load_image_tensor

    images = sorted(data.glob("*.png"))
    pixels = torch.stack([load_image_tensor(str(p), 64, crop="center") for p in images])
    vae = pipe.vae.config
    x0 = (pipe.vae.encode(pixels).latent_dist.mean - vae.shift_factor) * vae.scaling_factor
    captions = [p.with_suffix(".txt").read_text().strip() for p in images]
    if family == "flux":
        embeds, pooled, _ = pipe.encode_prompt(captions, max_sequence_length=16)
    else:
        embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=16)
    gen = torch.Generator().manual_seed(123)
    x0, embeds, pooled = x0.repeat(4, 1, 1, 1), embeds.repeat(4, 1, 1), pooled.repeat(4, 1)
    noise = torch.randn(x0.shape, generator=gen)
    sigmas = fm.shift_sigma(torch.sigmoid(torch.randn(len(x0), generator=gen)), 3.0)
    return x0, noise, sigmas, embeds, pooled


@torch.no_grad()
def _flow_loss(family, transformer, batch):
    x0, noise, sigmas, embeds, pooled = batch
    noisy, target = fm.noisy_and_target(x0, noise, sigmas)
    return fm.per_sample_loss(_predict(family, transformer, noisy, sigmas, embeds, pooled), target, sigmas).mean()


def _trained_transformer(family, path, run_dir, keep=lambda path: True):
    """A fresh transformer with the run's final LoRA weights (from its checkpoint, peft names) injected, for the
    module paths that `keep` accepts."""
    from peft import LoraConfig

    pipe = _pipe(family, path)
    weights = {k: v for k, v in final_weights(run_dir).items()
               if keep(k.removeprefix("transformer.").split(".lora_")[0])}
    paths = sorted({k.removeprefix("transformer.").split(".lora_")[0] for k in weights})
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=paths))
    state = {k.removeprefix("transformer."): v for k, v in weights.items()}
    missing = set(state) - set(dict(pipe.transformer.named_parameters()))
    assert not missing
    pipe.transformer.load_state_dict(state, strict=False)
    return pipe.transformer, paths


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_lora_trains_and_loads_back_through_diffusers(family, assets, request):
    run_dir = request.getfixturevalue(f"{family}_run")
    losses = [e["loss"] for e in progress(run_dir)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    output = run_dir / "output"
    pipe = _pipe(family, assets[family])
    batch = _fixed_batch(family, pipe, assets["data"])
    before = _flow_loss(family, pipe.transformer, batch)
    pipe.load_lora_weights(output)  # the diffusers/peft file, through the pipeline's own loader
    after = _flow_loss(family, pipe.transformer, batch)
    assert after < before * 0.98, (before, after)  # the training objective on fixed draws went down

    trained, paths = _trained_transformer(family, assets[family], run_dir)
    x0, noise, sigmas, embeds, pooled = batch
    noisy = fm.noisy_and_target(x0[:2], noise[:2], sigmas[:2])[0]
    with torch.no_grad():
        expected = _predict(family, trained, noisy, sigmas[:2], embeds[:2], pooled[:2])
        loaded = _predict(family, pipe.transformer, noisy, sigmas[:2], embeds[:2], pooled[:2])
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)
    if family == "flux":  # default targets: both kinds of blocks
        assert any(p.startswith("single_transformer_blocks.") for p in paths)
        assert any(p.startswith("transformer_blocks.") and "add_q_proj" in p for p in paths)
        samples = [e for e in read_events(run_dir) if e["type"] == "sample"]
        assert [e["step"] for e in samples] == [0, 0, 8, 8]  # the preset's two prompts
    else:
        assert all(p.startswith("transformer_blocks.") for p in paths) and any("add_k_proj" in p for p in paths)


def test_flux_kohya_file_has_comfyui_keys_metadata_and_loads_through_diffusers(flux_run, assets, tmp_path):
    kohya_path = flux_run / "output" / "flux_kohya.safetensors"
    kohya = load_file(str(kohya_path))
    modules = {k.split(".")[0] for k in kohya}
    assert all(k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for k in modules)
    for kind in ("img_attn_qkv", "txt_attn_qkv", "img_attn_proj", "txt_attn_proj", "img_mlp_0", "img_mlp_2",
                 "txt_mlp_0", "txt_mlp_2"):
        assert {f"lora_unet_double_blocks_{i}_{kind}" for i in (0, 1)} <= modules
    assert {f"lora_unet_single_blocks_{i}_{k}" for i in (0, 1) for k in ("linear1", "linear2")} <= modules
    assert all(f"{m}.alpha" in kohya for m in modules)
    assert kohya["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 24.0  # 3 fused parts x alpha 8
    assert kohya["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 12  # 3 x rank 4
    with safe_open(str(kohya_path), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "flux1" and meta["ss_network_dim"] == "4"
    assert meta["ss_network_alpha"] == "8.0" and meta["ss_steps"] == "8"
    assert meta["modelspec.architecture"] == "flux-1-dev/lora" and meta["ss_sd_model_name"] == str(assets["flux"])

    # diffusers 0.42 converts single-block linear1 with FLUX.1's full-size widths hard-coded (3072/12288), which
    # a tiny model cannot have: load the double blocks + linear2 through FluxPipeline.load_lora_weights (kohya
    # path) and compare with the same modules of the trained transformer. linear1 is checked by hand in
    # test_flow_matching.py.
    subset = {k: v for k, v in kohya.items() if "_linear1." not in k}
    save_file(subset, str(tmp_path / "kohya_subset.safetensors"))
    via_kohya = _pipe("flux", assets["flux"])
    via_kohya.load_lora_weights(str(tmp_path / "kohya_subset.safetensors"))
    in_linear1 = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
    trained, _ = _trained_transformer("flux", assets["flux"], flux_run, keep=lambda p: not (
        p.startswith("single_transformer_blocks.") and p.split(".", 2)[2] in in_linear1))
    batch = _fixed_batch("flux", via_kohya, assets["data"])
    x0, noise, sigmas, embeds, pooled = batch
    noisy = fm.noisy_and_target(x0[:2], noise[:2], sigmas[:2])[0]
    with torch.no_grad():
        a = _predict("flux", via_kohya.transformer, noisy, sigmas[:2], embeds[:2], pooled[:2])
        b = _predict("flux", trained, noisy, sigmas[:2], embeds[:2], pooled[:2])
        base = _predict("flux", _pipe("flux", assets["flux"]).transformer, noisy, sigmas[:2], embeds[:2], pooled[:2])
    assert (a - base).abs().max() > 1e-4
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sd3_full_fine_tune_writes_a_single_file_with_the_trained_weights(runs, assets):
    """method=full on the SD 3.5 preset: the diffusers folder and Stability's single-file layout both hold what
    the run trained (the file in bf16), and the file loads through StableDiffusion3Pipeline.from_single_file."""
    from diffusers import StableDiffusion3Pipeline

    run_dir = _run(runs, assets, "sd3", "sd35-lora.yaml", "method=full", "train.lr=1e-4", "train.steps=2",
                   "sample.prompts=[]")
    trained = {k.removeprefix("transformer."): v for k, v in final_weights(run_dir).items()}
    output = run_dir / "output"
    single = StableDiffusion3Pipeline.from_single_file(str(output / "sd3.safetensors"), config=str(output / "diffusers"),
                                                       local_files_only=True)
    state = single.transformer.state_dict()
    base_model = StableDiffusion3Pipeline.from_pretrained(assets["sd3"]).transformer
    assert trained.keys() == {name for name, _ in base_model.named_parameters()}  # the whole MMDiT was trained
    base = base_model.state_dict()
    changed = 0
    for name, value in trained.items():
        torch.testing.assert_close(state[name].float(), value.to(torch.bfloat16).float())
        changed += not torch.equal(value, base[name])
    assert changed > len(trained) // 2


def test_the_run_log_is_free_of_library_loading_chatter(flux_run):
    """train.log is what the UI's log box shows: no loading bars or optional packages' import notices."""
    log = log_of(flux_run)
    assert "trainer.engine.worker" in log  # the log itself is there (the launcher's command line)
    for chatter in ("Loading pipeline components", "Loading weights", "Writing model shards",
                    "Unable to import `torchao`", "is an Enum subclass"):
        assert chatter not in log, chatter
