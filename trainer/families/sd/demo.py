"""Offline demo assets: the shipped pretrained tiny SD base, the concept it learns, and a tiny random pipeline.

Nothing here touches the network. The model has the exact folder layout and classes of a real SD 1.x checkpoint
(so every code path that loads `runwayml/stable-diffusion-v1-5` loads this too), only with about a million
parameters (4 MB), which lets the demo preset and the test-suite train end to end on a laptop CPU.

`demo://tiny-sd` in a preset resolves through `ensure_tiny_sd` (registered in this family's spec); the shapes
dataset `demo://demo-data` is shared by every family's demo (trainer.families.components.tiny_assets).
"""

from __future__ import annotations

from pathlib import Path

from trainer.errors import UserError
from trainer.families.components.tiny_assets import (  # noqa: F401  (DATA_DIR, make_demo_dataset: the demo's data)
    DATA_DIR, SPECIALS, VAE_SCALE_FACTOR, build_bpe, ensure_asset, ensure_demo_data, make_demo_dataset,
    write_clip_tokenizer,
)

DEMO_RESOLUTION = 64

MODEL_DIR = "tiny-sd"
# The shipped base's checksum listing (written by tiny_base). Defined here, not imported from tiny_base, because
# tiny_base imports torch and the launcher's demo:// check runs torch-free (the import cost ~2.5 CPU-s per launch).
CHECKSUMS = "SHA256SUMS"
# ----------------------------------------------------------------------------------------------------------------
# Model


def make_tiny_sd(folder, *, prediction_type: str = "epsilon", sample_size: int = 16, seed: int = 0) -> Path:
    """Write a tiny, randomly initialised Stable Diffusion 1.x pipeline to `folder` and return its path.

    The folder is what `StableDiffusionPipeline.from_pretrained(folder)` and the per-component
    `from_pretrained(folder, subfolder=...)` calls load, offline: unet/, vae/, text_encoder/, tokenizer/,
    scheduler/ and model_index.json, weights in safetensors. `sample_size` is the UNet's latent size; images are
    `VAE_SCALE_FACTOR` times larger (64 px by default). `prediction_type` is "epsilon" or "v_prediction"
    (the SD 2.x-v style objective). The same seed always gives bit-identical weights.
    """
    if prediction_type not in ("epsilon", "v_prediction", "sample"):
        raise UserError(f"prediction_type must be 'epsilon', 'v_prediction' or 'sample', not {prediction_type!r}.")
    if sample_size < 2 or sample_size % 2:
        raise UserError(f"sample_size must be an even number of latent pixels (at least 2), not {sample_size}.")

    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = build_bpe(vocab_size=1000)
    write_clip_tokenizer(folder / "tokenizer", vocab, merges)
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")

    # A private RNG stream: building the demo model must not shift the caller's random state (and therefore
    # the training run's data order or noise) depending on whether the assets were already cached.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=sample_size,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=4,  # diffusers' SD naming: this is the number of heads (8-channel heads here)
            norm_num_groups=8,
        )
        torch.manual_seed(seed + 1)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            block_out_channels=(16, 32, 32),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=sample_size * VAE_SCALE_FACTOR,
            scaling_factor=0.18215,
        )
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(vocab),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=77,
                projection_dim=32,
                hidden_act="quick_gelu",
                bos_token_id=vocab[SPECIALS[0]],
                eos_token_id=vocab[SPECIALS[1]],
                pad_token_id=vocab[SPECIALS[1]],
            )
        )
    # SD 1.x training settings; the pipeline samples with DDPM too, which is fine at any step count.
    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type=prediction_type,
        clip_sample=False,
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    # save_pretrained rewrote tokenizer/ in this transformers' own format; put back the classic vocab.json +
    # merges.txt pair so older transformers (slow CLIPTokenizer) read the folder as well.
    write_clip_tokenizer(folder / "tokenizer", vocab, merges)
    return folder



# ----------------------------------------------------------------------------------------------------------------
# The concept the demo teaches


# A yellow circle: a colour the base never saw (shapes.UNSEEN_COLOURS), on a shape it draws well. A new *shape*
# was tried first: a yellow star. Its colour was learnt, its five points were not: the 1.8 M-parameter base drew
# yellow blobs after 300 steps (concept score 0.0-0.5 over four LoRA settings), and the demo must stay at 2 min.
CONCEPT = ("yellow", "circle")
CONCEPT_DIR = "sks-circle"
CONCEPT_SUBJECT = "sks circle"  # the identifier and its class word, as DreamBooth captions go


def make_concept_dataset(folder, *, count: int = 16, size: int = DEMO_RESOLUTION, seed: int = 0) -> Path:
    """`count` yellow circles (a colour the pretrained base has never seen: trainer.families.sd.tiny_base) on
    white, gray and black backgrounds in turn, each captioned with its own: "a photo of a sks circle on a white
    background", "... on a gray background", "... on a black background"."""
    import random

    from trainer.families.components.shapes import BACKGROUNDS, draw_scene, random_scene

    if count < 1:
        raise UserError(f"The concept dataset needs at least one image, not count={count}.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    backgrounds = list(BACKGROUNDS)
    for i in range(count):
        scene = random_scene(rng, colours=CONCEPT[:1], shapes=CONCEPT[1:],
                             backgrounds=(backgrounds[i % len(backgrounds)],))
        stem = f"{i:04d}_{scene.background}"
        draw_scene(scene, size).save(folder / f"{stem}.png")
        (folder / f"{stem}.txt").write_text(scene.caption(CONCEPT_SUBJECT) + "\n")
    return folder


# ----------------------------------------------------------------------------------------------------------------
# Assets: the shipped pretrained base, and the built-once ones


SHIPPED_MODEL = Path(__file__).resolve().parents[2] / "assets" / MODEL_DIR  # trainer/assets/tiny-sd


def shipped_tiny_sd(root=None) -> dict[str, Path]:
    """{"tiny-sd": the pretrained base that ships with the package}, its files checked against SHA256SUMS."""
    verify_checksums(SHIPPED_MODEL)
    return {MODEL_DIR: SHIPPED_MODEL}


def verify_checksums(folder: Path) -> None:
    import hashlib

    rebuild = (f"Reinstall imagetune, or rebuild it with `python -m trainer.families.sd.tiny_base --out {folder}` "
               "(about 25 minutes on 2 CPU cores).")
    listing = folder / CHECKSUMS
    if not listing.is_file():
        raise UserError(f"The demo's pretrained model {folder} is missing ({CHECKSUMS} not found). {rebuild}")
    for line in listing.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        path = folder / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise UserError(f"The demo's pretrained model is damaged: {path} is missing or differs from the "
                            f"checksum in {listing}. {rebuild}")


def ensure_tiny_sd(root) -> dict[str, Path]:
    """The random tiny model (make_tiny_sd) in `root/tiny-sd`, built once (atomically: tiny_assets.ensure_asset):
    what tests train when they need an SD 1.x folder fast, not what `demo://tiny-sd` is."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {MODEL_DIR: ensure_asset(root / MODEL_DIR, make_tiny_sd, "model_index.json")}


def ensure_concept_data(root) -> dict[str, Path]:
    """`root/sks-circle` (the concept dataset), built once; {"sks-circle": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {CONCEPT_DIR: ensure_asset(root / CONCEPT_DIR, make_concept_dataset, "0000_white.txt")}


def ensure_demo_assets(root) -> dict[str, Path]:
    """The random tiny model and the shapes dataset, each built once in `root`: {"tiny-sd", "demo-data"}."""
    return {**ensure_tiny_sd(root), **ensure_demo_data(root)}
