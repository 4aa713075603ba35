"""Tiny, randomly initialised FLUX.1 and SD3 pipelines written as real diffusers folders, offline.

`make_tiny_flux(folder)` and `make_tiny_sd3(folder)` write what `FluxPipeline.from_pretrained(folder)` and
`StableDiffusion3Pipeline.from_pretrained(folder)` load, with the real classes and folder layout (transformer/,
vae/ with 16 latent channels, CLIP text encoders, a T5 encoder, tokenizers, scheduler/), only with a few
thousand parameters per part (the encoders, tokenizers and VAE from trainer.families.components.tiny_flow). Images are 64 px (latents 16x16) like the SD demo.
"""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.tiny_assets import ensure_asset, write_clip_tokenizer
from trainer.families.components.tiny_flow import clip_config, clip_tokenizer, flow_vae, t5_encoder, write_t5_tokenizer


def make_tiny_flux(folder, *, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """A tiny FLUX.1 pipeline: `guidance_embeds=True` is dev-like (distilled guidance, dynamic shift),
    False is schnell-like (no guidance embedding, shift 1)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5TokenizerFast  # see tiny_flow.write_t5_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab, merges = clip_tokenizer(folder / "tokenizer")
    t5_vocab = write_t5_tokenizer(folder / "tokenizer_2", max_length=512 if guidance_embeds else 256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, guidance_embeds=guidance_embeds,
                                             axes_dims_rope=(4, 6, 6))
        torch.manual_seed(seed + 1)
        vae = flow_vae(scaling_factor=0.3611, shift_factor=0.1159, flux=True)
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModel(clip_config(vocab, hidden=32, projection=32))
        torch.manual_seed(seed + 3)
        text_encoder_2 = t5_encoder(t5_vocab, 32)
    if guidance_embeds:  # FLUX.1-dev's scheduler config
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    else:  # FLUX.1-schnell's
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=T5TokenizerFast.from_pretrained(folder / "tokenizer_2"),
                        transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    write_clip_tokenizer(folder / "tokenizer", vocab, merges)
    return folder


def make_tiny_sd3(folder, *, seed: int = 0) -> Path:
    """A tiny SD3/3.5 pipeline: MMDiT transformer (qk RMS norm as in 3.5), CLIP-L, CLIP-G, T5. Shaped like the
    real one where tools rely on it: CLIP-G wider than CLIP-L (1280 and 768 in SD3; single-file readers tell them
    apart by width), CLIP-L's text projection the identity (SD3 uses its pooled output unprojected), and T5 at
    least as wide as both CLIPs' hidden states together (the pipeline pads those to T5's width)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5TokenizerFast  # as above

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab, merges = clip_tokenizer(folder / "tokenizer")
    tokenizer_2, _, _ = clip_tokenizer(folder / "tokenizer_2")
    t5_vocab = write_t5_tokenizer(folder / "tokenizer_3", max_length=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=2,
                                            attention_head_dim=8, num_attention_heads=4, joint_attention_dim=48,
                                            caption_projection_dim=32, pooled_projection_dim=32, out_channels=16,
                                            pos_embed_max_size=32, qk_norm="rms_norm")
        torch.manual_seed(seed + 1)
        vae = flow_vae(scaling_factor=1.5305, shift_factor=0.0609, flux=False)
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModelWithProjection(clip_config(vocab, hidden=16, projection=16))
        with torch.no_grad():
            text_encoder.text_projection.weight.copy_(torch.eye(16))
        torch.manual_seed(seed + 3)
        text_encoder_2 = CLIPTextModelWithProjection(clip_config(vocab, hidden=24, projection=16))
        torch.manual_seed(seed + 4)
        text_encoder_3 = t5_encoder(t5_vocab, 48)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                    tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                    text_encoder_3=text_encoder_3,
                                    tokenizer_3=T5TokenizerFast.from_pretrained(folder / "tokenizer_3"))
    pipe.save_pretrained(folder, safe_serialization=True)
    write_clip_tokenizer(folder / "tokenizer", vocab, merges)
    write_clip_tokenizer(folder / "tokenizer_2", vocab, merges)
    return folder




def ensure_tiny_flux(root) -> dict[str, Path]:
    """`root/tiny-flux` (dev-like), built once (atomically, see tiny_assets.ensure_asset); {"tiny-flux": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-flux": ensure_asset(root / "tiny-flux", make_tiny_flux, "model_index.json")}


def ensure_tiny_sd3(root) -> dict[str, Path]:
    """`root/tiny-sd3`, built once; {"tiny-sd3": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-sd3": ensure_asset(root / "tiny-sd3", make_tiny_sd3, "model_index.json")}
