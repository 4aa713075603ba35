"""A tiny, randomly initialised Chroma pipeline written as a real diffusers folder, offline: the real
ChromaTransformer2DModel (2 double and 2 single blocks, a one-layer distilled guidance layer), a T5 encoder and
tokenizer, FLUX.1's 16-channel VAE shape and a FLUX-style scheduler with dynamic shifting, a few thousand
parameters per part (trainer.families.components.tiny_flow). Images are 64 px (latents 16x16)."""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.tiny_assets import ensure_asset
from trainer.families.components.tiny_flow import flow_vae, t5_encoder, write_t5_tokenizer


def make_tiny_chroma(folder, *, seed: int = 0) -> Path:
    import torch
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5TokenizerFast  # see tiny_flow.write_t5_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t5_vocab = write_t5_tokenizer(folder / "tokenizer", max_length=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = ChromaTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                               axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
                                               approximator_hidden_dim=32, approximator_layers=1)
        torch.manual_seed(seed + 1)
        vae = flow_vae(scaling_factor=0.3611, shift_factor=0.1159, flux=True)
        torch.manual_seed(seed + 2)
        text_encoder = t5_encoder(t5_vocab, 32)
    # FLUX.1's dynamic shifting, as ai-toolkit's Chroma scheduler (chroma_model.py:30-38)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                          tokenizer=T5TokenizerFast.from_pretrained(folder / "tokenizer"), transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def ensure_tiny_chroma(root) -> dict[str, Path]:
    """`root/tiny-chroma`, built once (atomically, see tiny_assets.ensure_asset); {"tiny-chroma": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-chroma": ensure_asset(root / "tiny-chroma", make_tiny_chroma, "model_index.json")}
