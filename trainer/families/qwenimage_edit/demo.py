"""A tiny, randomly initialised Qwen-Image-Edit-2511 pipeline written as a real diffusers folder, offline: the real
QwenImageTransformer2DModel (2 blocks, `zero_cond_t` on as Qwen/Qwen-Image-Edit-2511's transformer config has it:
the control tokens are modulated with timestep 0), AutoencoderKLQwenImage (the 3D video VAE, with a narrow posterior
as a trained VAE's, `narrow_posterior`, and per-channel latents_mean/latents_std that are its own latents'
statistics on the demo's edit pairs, `latent_statistics`), a
Qwen2.5-VL (2 text layers and a one-block vision tower, which the edit
prompts run on the control image), a byte-level BPE tokenizer with Qwen's chat and vision special tokens, a
Qwen2VLProcessor whose image processor caps images at 112² pixels (the real one at 384² area gives 196 vision
tokens; here a 384² condition image is 6x6 patches, 9 tokens), and Qwen-Image's scheduler config, saved as
QwenImageEditPlusPipeline. Images are 64 px (latents 8x8, 16 target and 16 control tokens)."""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.edit_pairs import INSTRUCTION
from trainer.families.components.tiny_assets import ensure_asset
from trainer.families.components.tiny_qwen import CHAT_SPECIAL, VISION_SPECIAL, qwen_text_encoder, write_qwen_tokenizer

# The words of QwenImageEditPlusPipeline's system prompt and image label (prompt_template_encode, "Picture {}: "),
# so that they tokenize word by word, and the demo's instruction.
TEMPLATE_WORDS = ("system Describe the key features of the input image color shape size texture objects background "
                  "then explain how the user's text instruction should alter or modify image Generate a new that "
                  "meets requirements while maintaining consistency with original where appropriate user assistant "
                  "Picture " + INSTRUCTION)
MAX_PIXELS = 112 * 112  # the image processor's cap: small vision sequences on the CPU


def narrow_posterior(vae, log_variance: float = -12.0) -> None:
    """The encoder's log-variance made a constant (std 0.0025), as a trained VAE's posterior is narrow: with random
    weights its std is about 1, twenty times the spread of its means over the demo's images, and every sampled
    latent would be noise. The means (quant_conv's first z_dim outputs) are left as they are."""
    import torch

    z_dim = vae.config.z_dim
    with torch.no_grad():
        vae.quant_conv.weight[z_dim:] = 0
        vae.quant_conv.bias[z_dim:] = log_variance


def latent_statistics(vae) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the VAE's latents (its distributions' means) over the demo's edit pairs, both
    sides, as Qwen's latents_mean/latents_std are their VAE's over its data. With Qwen's own values this random
    VAE's latents normalise to a near-constant: the edit (black background) is 0.6% of their norm, too little to
    learn or to measure in a CPU minute; with its own statistics the latents are about N(0, 1) per channel."""
    import tempfile

    import numpy as np
    import torch
    from PIL import Image

    from trainer.families.components.edit_pairs import make_edit_pairs

    with tempfile.TemporaryDirectory() as tmp:
        paths = [p for side in ("target", "control")
                 for p in sorted(make_edit_pairs(Path(tmp) / side, side=side).glob("*.png"))]
        pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"), dtype=np.float32))
                              for p in paths]).permute(0, 3, 1, 2) / 127.5 - 1
    with torch.no_grad():
        z = vae.encode(pixels[:, :, None]).latent_dist.mean[:, :, 0]
    return z.mean((0, 2, 3)).tolist(), z.std((0, 2, 3)).tolist()


def make_tiny_qwenimage_edit(folder, *, seed: int = 0) -> Path:
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = write_qwen_tokenizer(folder / "tokenizer", TEMPLATE_WORDS.split(), CHAT_SPECIAL + VISION_SPECIAL)
    tokenizer = Qwen2Tokenizer.from_pretrained(folder / "tokenizer")
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(VISION_SPECIAL))))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                  axes_dims_rope=(4, 6, 6), zero_cond_t=True)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
        torch.manual_seed(seed + 2)
        text_encoder = qwen_text_encoder(vocab_size, 32, **ids)
    narrow_posterior(vae)
    mean, std = latent_statistics(vae)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    sizes = dict(min_pixels=28 * 28, max_pixels=MAX_PIXELS)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(**sizes))
    # Qwen/Qwen-Image-Edit-2511's scheduler/scheduler_config.json (Qwen-Image's)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                                time_shift_type="exponential")
    pipe = QwenImageEditPlusPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                     processor=processor, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def ensure_tiny_qwenimage_edit(root) -> dict[str, Path]:
    """`root/tiny-qwenimage-edit`, built once (atomically, see tiny_assets.ensure_asset)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-qwenimage-edit": ensure_asset(root / "tiny-qwenimage-edit", make_tiny_qwenimage_edit,
                                                "model_index.json")}
