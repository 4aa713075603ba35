"""SDXL on a tiny random-init model saved as a diffusers folder (trainer.families.sdxl.demo), offline, on the CPU.

In-process tests drive the family through its protocol with a one-process context; the engine test launches
real 1- and 2-process runs through the launcher (torchrun, gloo DDP).
"""

from pathlib import Path

import pytest
import torch

from tests.engine_helpers import assert_same_weights, final_weights, launch, log_of, progress
from trainer.core.config import load_config

PROMPT = "a photo of a red circle"


@pytest.fixture(scope="module")
def tiny_sdxl(tiny_sdxl_path):
    return tiny_sdxl_path


@pytest.fixture(scope="module")
def sdxl_data(tmp_path_factory):
    from PIL import Image

    from trainer.families.sd.demo import make_demo_dataset

    folder = make_demo_dataset(tmp_path_factory.mktemp("sdxl-data"), count=4)
    Image.new("RGB", (96, 64), (200, 40, 40)).save(folder / "wide.png")  # not square: crop conditioning
    (folder / "wide.txt").write_text("a photo of a red wide picture")
    return folder


class _Accelerator:  # what a family uses of accelerate's, for one process
    def wait_for_everyone(self):
        pass

    def unwrap_model(self, model):
        return model


def make_family(tmp_path, model, data, *overrides):
    from trainer.families import get_family
    from trainer.families.protocol import WorkerContext
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import make_plan

    config = load_config(None, [f"model.path={model}", "model.family=sdxl", f"data.path={data}", "precision=fp32",
                                "devices=cpu:1", "batch.total=2", "batch.per_device=2", "data.resolution=64",
                                "lora.rank=4", "lora.alpha=8", *overrides])
    warnings = []
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), warnings.append)
    family = get_family("sdxl")(ctx)
    family.load()
    family.prepare_data()
    family.set_prepared(family.trainable_modules())
    family.warnings = warnings
    return family


def train(family, steps: int, lr: float = 1e-3) -> list[float]:
    """Optimizer steps on one fixed micro-batch (same samples, same draws): the loss must go down."""
    params = [p for g in family.param_groups() for p in g["params"]]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0)
    losses = []
    for _ in range(steps):
        loss = family.loss([(0, 0, 0), (1, 0, 4)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def render(pipe):
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator().manual_seed(0)
    return pipe(PROMPT, num_inference_steps=2, generator=gen, output_type="pt").images


@pytest.mark.slow
def test_caches_are_used_and_the_encoders_are_not_called_after_caching(tmp_path, tiny_sdxl, sdxl_data):
    family = make_family(tmp_path, tiny_sdxl, sdxl_data)  # defaults: both caches on for SDXL
    assert family.text_embeddings is not None and family.data.latents is not None
    assert len(list((tmp_path / "cache" / "text").glob("*/chunk-*.safetensors"))) == 1
    calls = {"vae": 0, "te": 0}

    def count(name):
        def hook(*_):
            calls[name] += 1
        return hook

    family.vae.encoder.register_forward_pre_hook(count("vae"))
    family.text_encoder.register_forward_pre_hook(count("te"))
    family.text_encoder_2.register_forward_pre_hook(count("te"))
    losses = train(family, 4)
    assert calls == {"vae": 0, "te": 0}
    assert losses[-1] < losses[0], losses

    # A second run with the same captions and model reuses the caches: nothing is encoded again.
    before = {name: sorted(p.stat().st_mtime_ns for p in (tmp_path / "cache" / name).rglob("chunk-*"))
              for name in ("text", "latents")}
    again = make_family(tmp_path, tiny_sdxl, sdxl_data)
    after = {name: sorted(p.stat().st_mtime_ns for p in (tmp_path / "cache" / name).rglob("chunk-*"))
             for name in ("text", "latents")}
    assert before == after
    assert PROMPT not in again.text_embeddings  # only training captions are cached
    caption = family.data.images[0].caption
    hidden, pooled = family.encode_prompts([caption])
    torch.testing.assert_close(again.text_embeddings.get(caption)["hidden"], hidden[0])
    torch.testing.assert_close(again.text_embeddings.get(caption)["pooled"], pooled[0])
    assert hidden.shape[-1] == 64  # both encoders' penultimate states, concatenated


def test_text_cache_dedupes_is_keyed_and_reused_from_disk(tmp_path):
    from trainer.families.components.text_cache import build_text_cache, text_cache_key

    captions = [f"caption {i}" for i in range(20)] + ["caption 3"]  # duplicates are cached once
    batches = []

    def encode(batch):
        batches.append(list(batch))
        return {"hidden": torch.stack([torch.full((3,), float(c.split()[1])) for c in batch])}

    folder = tmp_path / text_cache_key({"model": "m"}, captions)
    assert folder.name != text_cache_key({"model": "other"}, captions) != text_cache_key({"model": "m"}, captions[:5])
    cache = build_text_cache(folder, captions, encode, rank=0, world_size=1, barrier=lambda: None)
    assert len(cache) == 20 and sum(len(b) for b in batches) == 20 and max(len(b) for b in batches) <= 8
    torch.testing.assert_close(cache.stack(["caption 7", "caption 3"])["hidden"][:, 0], torch.tensor([7.0, 3.0]))
    again = build_text_cache(folder, captions, lambda b: pytest.fail("encoded again"), rank=0, world_size=1,
                             barrier=lambda: None)
    torch.testing.assert_close(again.get("caption 11")["hidden"], torch.full((3,), 11.0))


@pytest.mark.slow
def test_micro_conditioning_uses_the_real_size_and_crop(tmp_path, tiny_sdxl, sdxl_data):
    import numpy as np
    from PIL import Image

    from trainer.families.components.captioned import load_image_tensor, sample_rng

    family = make_family(tmp_path, tiny_sdxl, sdxl_data, "data.cache_text_embeddings=false")
    wide = [i for i, item in enumerate(family.data.images) if item.path.endswith("wide.png")][0]
    assert family.time_ids((0, 0, wide, 0, "instance")) == [64, 96, 0, 16, 64, 64]

    family.cfg.data.center_crop, family.data.use_cache = False, False  # random crops: replayed from the sample's rng
    with Image.open(family.data.images[wide].path) as img:
        whole = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).float() / 127.5 - 1
    lefts = set()
    for epoch in range(4):
        _, _, top, left, _, _ = family.time_ids((0, epoch, wide, 5, "instance"))
        pixels = load_image_tensor(family.data.images[wide].path, 64, crop="random", rng=sample_rng(0, epoch, 5))
        torch.testing.assert_close(pixels, whole[:, top:top + 64, left:left + 64])
        lefts.add(left)
    assert len(lefts) > 1


@pytest.mark.slow
def test_lora_with_both_text_encoders_loads_back_in_diffusers_and_kohya(tmp_path, tiny_sdxl, sdxl_data):
    from diffusers import StableDiffusionXLPipeline
    from safetensors import safe_open

    family = make_family(tmp_path, tiny_sdxl, sdxl_data, "lora.train_text_encoder=true")
    assert family.text_embeddings is None  # trained encoders are never cached
    losses = train(family, 4)
    assert losses[-1] < losses[0], losses
    out = tmp_path / "out"
    family.save_outputs(out, step=4)

    base = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    trained = StableDiffusionXLPipeline(vae=family.vae, text_encoder=family.text_encoder,
                                        text_encoder_2=family.text_encoder_2, tokenizer=family.tokenizer,
                                        tokenizer_2=family.tokenizer_2, unet=family.unet, scheduler=base.scheduler)
    for m in (family.unet, family.text_encoder, family.text_encoder_2):
        m.eval()
    expected = render(trained)
    base.load_lora_weights(out)
    torch.testing.assert_close(render(base), expected, rtol=0, atol=1e-4)

    kohya = next(out.glob("*_kohya.safetensors"))
    with safe_open(str(kohya), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert {k.split("_")[1] for k in keys} == {"unet", "te1", "te2"}
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0" and meta["ss_network_dim"] == "4"
    assert all(f"{k.rsplit('.', 2)[0]}.alpha" in keys for k in keys if k.endswith("lora_down.weight"))
    with safe_open(str(kohya), "pt") as f:  # trained: the up weights left their zero init, so the check bites
        assert all(f.get_tensor(k).abs().max() > 0 for k in keys if k.endswith("lora_up.weight"))
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
    pipe.load_lora_weights(str(kohya))  # diffusers' own kohya conversion
    torch.testing.assert_close(render(pipe), expected, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_full_fine_tune_writes_a_diffusers_folder_and_fp16_keeps_the_vae_fp32(tmp_path, tiny_sdxl, sdxl_data):
    from diffusers import UNet2DConditionModel

    family = make_family(tmp_path, tiny_sdxl, sdxl_data, "method=full", "model.prediction_type=v_prediction")
    losses = train(family, 3, lr=1e-4)
    assert losses[-1] < losses[0], losses
    folder, single = family.save_outputs(tmp_path / "out", step=3)
    assert Path(single).suffix == ".safetensors" and Path(single).stat().st_size > 0  # tested in test_export_sdxl
    unet = UNet2DConditionModel.from_pretrained(Path(folder) / "unet")
    for name, p in unet.named_parameters():
        torch.testing.assert_close(p, dict(family.unet.named_parameters())[name])

    half = make_family(tmp_path / "fp16", tiny_sdxl, sdxl_data, "precision=fp16")
    assert half.vae.dtype == torch.float32 and half.unet.dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in half.unet.parameters() if p.requires_grad)
    image = half.sample([PROMPT], [0], steps=2)[0]
    assert image.size == (64, 64)


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, tiny_sdxl, sdxl_data):
    """Same effective batch on 1 and 2 processes, with both caches on (built by the ranks together). SGD: the
    weights compare the gradients themselves (Adam turns fp32 summation-order noise in near-zero gradients of
    freshly initialised LoRA layers into lr-sized steps)."""
    base = [f"model.path={tiny_sdxl}", "model.family=sdxl", f"data.path={sdxl_data}", "precision=fp32",
            "batch.total=2", "train.steps=2", "train.optimizer=sgd", "train.lr=0.5", "sample.every=0", "checkpoint.every=0",
            "data.resolution=64", "data.flip=true", "lora.rank=4", "lora.alpha=8"]
    one_dir, final = launch(tmp_path, load_config(None, [*base, "devices=cpu:1", "batch.per_device=2", "name=one"]))
    assert final["type"] == "done", log_of(one_dir)
    two_dir, final = launch(tmp_path, load_config(None, [*base, "devices=cpu:2", "batch.per_device=1", "name=two"]))
    assert final["type"] == "done", log_of(two_dir)
    assert_same_weights(final_weights(one_dir), final_weights(two_dir))
    assert [e["loss"] for e in progress(one_dir)] == pytest.approx([e["loss"] for e in progress(two_dir)], rel=1e-5)
    assert (two_dir / "output" / "pytorch_lora_weights.safetensors").exists()
