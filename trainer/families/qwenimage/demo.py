"""A tiny, randomly initialised Qwen-Image pipeline written as a real diffusers folder, offline: the real
QwenImageTransformer2DModel (2 blocks), AutoencoderKLQwenImage (the 3D video VAE, 8x spatial, Qwen-Image's
per-channel latents_mean/latents_std), a Qwen2.5-VL text encoder (2 text layers; a one-block vision tower that text
prompts never run) and a byte-level BPE tokenizer with Qwen's chat special tokens, and Qwen-Image's scheduler
config. Images are 64 px (latents 8x8, 16 image tokens)."""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.tiny_assets import ensure_asset
from trainer.families.components.tiny_qwen import qwen_text_encoder, write_qwen_tokenizer

# The words of QwenImagePipeline's system prompt (prompt_template_encode), so that it tokenizes word by word as
# Qwen's own tokenizer does (34 tokens up to the caption, the pipeline's prompt_template_encode_start_idx).
TEMPLATE_WORDS = ("system Describe the image by detailing color shape size texture quantity text spatial relationships "
                  "objects and background user assistant")


def make_tiny_qwenimage(folder, *, seed: int = 0) -> Path:
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2Tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = write_qwen_tokenizer(folder / "tokenizer", TEMPLATE_WORDS.split())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                  axes_dims_rope=(4, 6, 6))
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)  # real stats
        torch.manual_seed(seed + 2)
        text_encoder = qwen_text_encoder(vocab_size, 32)
    # Qwen/Qwen-Image's scheduler/scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                                time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                             tokenizer=Qwen2Tokenizer.from_pretrained(folder / "tokenizer"), transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def ensure_tiny_qwenimage(root) -> dict[str, Path]:
    """`root/tiny-qwenimage`, built once (atomically, see tiny_assets.ensure_asset); {"tiny-qwenimage": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-qwenimage": ensure_asset(root / "tiny-qwenimage", make_tiny_qwenimage, "model_index.json")}
