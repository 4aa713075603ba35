"""The offline demo assets: a tiny SD 1.x pipeline that real diffusers code loads, and the shapes dataset."""

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from trainer.families.sd.demo import DEMO_RESOLUTION, ensure_demo_assets, make_demo_dataset, make_tiny_sd
from trainer.errors import UserError


@pytest.fixture(scope="module")
def tiny_sd(tiny_sd_path):  # the session's demo model: make_tiny_sd with its defaults
    return tiny_sd_path


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*/*.safetensors")):
        tensors.update({f"{file.parent.name}.{k}": v for k, v in load_file(file).items()})
    return tensors


def test_pipeline_loads_and_generates_offline(tiny_sd, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.safety_checker is None
    assert pipe.vae_scale_factor * pipe.unet.config.sample_size == DEMO_RESOLUTION
    out = pipe(
        "a photo of a red circle",
        height=32,
        width=32,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    assert out.images.shape == (1, 32, 32, 3)
    assert np.isfinite(out.images).all()


def test_components_load_by_subfolder(tiny_sd, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    unet = UNet2DConditionModel.from_pretrained(tiny_sd, subfolder="unet")
    vae = AutoencoderKL.from_pretrained(tiny_sd, subfolder="vae")
    text_encoder = CLIPTextModel.from_pretrained(tiny_sd, subfolder="text_encoder")
    scheduler = DDPMScheduler.from_pretrained(tiny_sd, subfolder="scheduler")

    assert vae.config.latent_channels == unet.config.in_channels == 4
    assert text_encoder.config.hidden_size == unet.config.cross_attention_dim
    assert scheduler.config.beta_schedule == "scaled_linear"
    assert scheduler.config.prediction_type == "epsilon"
    assert scheduler.config.num_train_timesteps == 1000
    # A training step's shapes: 64 px images -> 16x16 latents -> UNet output of the same shape.
    with torch.no_grad():
        latents = vae.encode(torch.zeros(2, 3, 64, 64)).latent_dist.sample()
        states = text_encoder(torch.tensor([[0, 1, 2]] * 2)).last_hidden_state
        noise_pred = unet(latents, torch.tensor([10, 500]), states).sample
    assert latents.shape == noise_pred.shape == (2, 4, 16, 16)


def test_tokenizer_round_trips_offline(tiny_sd, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tiny_sd, subfolder="tokenizer")
    assert tokenizer.model_max_length == 77
    prompt = "a photo of sks dog wearing a zebra hat in paris"  # includes words never seen when learning merges
    ids = tokenizer(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids[1:-1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt
    # Common prompt words are single tokens, as in real CLIP.
    assert tokenizer.tokenize("a red circle") == ["a</w>", "red</w>", "circle</w>"]
    padded = tokenizer(prompt, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    assert padded.input_ids.shape == (1, 77)
    assert max(max(tokenizer.get_vocab().values()), int(padded.input_ids.max())) < 1000


def test_same_seed_same_weights_other_seed_differs(tiny_sd, tmp_path):
    again = _weights(make_tiny_sd(tmp_path / "again", seed=0))
    other = _weights(make_tiny_sd(tmp_path / "other", seed=1))
    first = _weights(tiny_sd)
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["unet.conv_in.weight"], other["unet.conv_in.weight"])
    assert not torch.equal(first["vae.encoder.conv_in.weight"], other["vae.encoder.conv_in.weight"])


def test_building_does_not_disturb_the_callers_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_sd(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_v_prediction_variant(tmp_path):
    folder = make_tiny_sd(tmp_path / "v", prediction_type="v_prediction")
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert config["prediction_type"] == "v_prediction"
    assert config["_class_name"] == "DDPMScheduler"
    assert (config["beta_start"], config["beta_end"]) == (0.00085, 0.012)


def test_bad_arguments_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="prediction_type"):
        make_tiny_sd(tmp_path / "x", prediction_type="flow")
    with pytest.raises(UserError, match="count"):
        make_demo_dataset(tmp_path / "d", count=0)


def test_demo_dataset(tmp_path):
    folder = make_demo_dataset(tmp_path / "data", count=7, size=48, seed=3)
    images = sorted(folder.glob("*.png"))
    captions = sorted(folder.glob("*.txt"))
    assert len(images) == len(captions) == 7
    assert [p.stem for p in images] == [p.stem for p in captions]
    shapes = set()
    for image_path, caption_path in zip(images, captions):
        caption = caption_path.read_text().strip()
        shape = next(s for s in ("circle", "square", "triangle") if s in caption)
        assert shape in image_path.stem
        shapes.add(shape)
        with Image.open(image_path) as image:
            assert image.size == (48, 48) and image.mode == "RGB"
    assert shapes == {"circle", "square", "triangle"}

    same = make_demo_dataset(tmp_path / "same", count=7, size=48, seed=3)
    other = make_demo_dataset(tmp_path / "other", count=7, size=48, seed=4)
    assert all((same / p.name).read_bytes() == p.read_bytes() for p in images + captions)
    assert any((other / p.name).read_bytes() != p.read_bytes() for p in images)


def test_ensure_demo_assets_is_idempotent(tmp_path):
    paths = ensure_demo_assets(tmp_path)
    assert paths == {"tiny-sd": tmp_path / "tiny-sd", "demo-data": tmp_path / "demo-data"}
    assert (paths["tiny-sd"] / "model_index.json").is_file()
    assert len(list(paths["demo-data"].glob("*.png"))) == 16
    stamp = (paths["tiny-sd"] / "unet" / "config.json").stat().st_mtime_ns

    assert ensure_demo_assets(tmp_path) == paths
    assert (paths["tiny-sd"] / "unet" / "config.json").stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-data", "tiny-sd"]  # no temp folders left


def test_ensure_demo_assets_concurrent_callers(tmp_path):
    # Two processes (as two ranks of one run would) race to create the same assets; both must succeed.
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=ensure_demo_assets, args=(tmp_path,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-data", "tiny-sd"]
    assert (tmp_path / "tiny-sd" / "model_index.json").is_file()


def test_incomplete_asset_folder_is_reported(tmp_path):
    (tmp_path / "tiny-sd").mkdir()
    with pytest.raises(UserError, match="Delete it"):
        ensure_demo_assets(tmp_path)
