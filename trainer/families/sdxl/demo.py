"""A tiny, randomly initialised SDXL pipeline written as a real diffusers folder (offline, a few MB).

Same architecture classes and folder layout as `stabilityai/stable-diffusion-xl-base-1.0`: a UNet with
`addition_embed_type="text_time"` (size/crop micro-conditioning), two CLIP text encoders (`CLIPTextModel` and
`CLIPTextModelWithProjection`) with locally built tokenizers (trainer.families.sd.demo's BPE writer), an AutoencoderKL and
an Euler scheduler. `StableDiffusionXLPipeline.from_pretrained(folder)` loads it without network.
"""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.tiny_assets import SPECIALS, build_bpe, ensure_asset, write_clip_tokenizer
from trainer.families.components.tiny_assets import VAE_SCALE_FACTOR
from trainer.errors import UserError

TE_HIDDEN = (32, 32)  # hidden sizes of text_encoder / text_encoder_2: cross_attention_dim = their sum
PROJECTION_DIM = 32  # text_encoder_2's pooled projection
TIME_EMBED_DIM = 8  # addition_time_embed_dim: 6 size/crop numbers x 8 + the pooled 32 = 80


def make_tiny_sdxl(folder, *, prediction_type: str = "epsilon", sample_size: int = 16, seed: int = 0) -> Path:
    """Write the tiny SDXL pipeline to `folder` and return its path. Images are `VAE_SCALE_FACTOR * sample_size`
    pixels (64 by default). The same seed always gives bit-identical weights."""
    if prediction_type not in ("epsilon", "v_prediction"):
        raise UserError(f"prediction_type must be 'epsilon' or 'v_prediction', not {prediction_type!r}.")
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = build_bpe(vocab_size=1000)
    for name in ("tokenizer", "tokenizer_2"):
        write_clip_tokenizer(folder / name, vocab, merges)
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    tokenizer_2 = CLIPTokenizer.from_pretrained(folder / "tokenizer_2")

    def text_config(hidden: int) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=PROJECTION_DIM, hidden_act="gelu",
            bos_token_id=vocab[SPECIALS[0]], eos_token_id=vocab[SPECIALS[1]], pad_token_id=vocab[SPECIALS[1]],
        )

    with torch.random.fork_rng(devices=[]):  # never shift the caller's random state
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=sample_size,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            transformer_layers_per_block=(1, 2),
            addition_embed_type="text_time",
            addition_time_embed_dim=TIME_EMBED_DIM,
            projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + PROJECTION_DIM,
            cross_attention_dim=sum(TE_HIDDEN),
            norm_num_groups=8,
        )
        torch.manual_seed(seed + 1)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32), layers_per_block=1,
            latent_channels=4, norm_num_groups=8, sample_size=sample_size * VAE_SCALE_FACTOR,
            scaling_factor=0.13025, force_upcast=True,
        )
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModel(text_config(TE_HIDDEN[0]))
        torch.manual_seed(seed + 3)
        text_encoder_2 = CLIPTextModelWithProjection(text_config(TE_HIDDEN[1]))
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type=prediction_type, steps_offset=1, timestep_spacing="leading", interpolation_type="linear",
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer", "tokenizer_2"):  # the classic vocab.json + merges.txt pair, as trainer.families.sd.demo does
        write_clip_tokenizer(folder / name, vocab, merges)
    return folder


def ensure_tiny_sdxl(root) -> dict[str, Path]:
    """`root/tiny-sdxl`, built once (atomically, see tiny_assets.ensure_asset); {"tiny-sdxl": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-sdxl": ensure_asset(root / "tiny-sdxl", make_tiny_sdxl, "model_index.json")}
