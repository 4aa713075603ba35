"""A tiny, randomly initialised Qwen-Image pipeline written as a real diffusers folder, offline: the real
QwenImageTransformer2DModel (2 blocks), AutoencoderKLQwenImage (the 3D video VAE, 8x spatial, Qwen-Image's
per-channel latents_mean/latents_std), a Qwen2.5-VL text encoder (2 text layers; a one-block vision tower that text
prompts never run) and a byte-level BPE tokenizer with Qwen's chat special tokens, and Qwen-Image's scheduler
config. Images are 64 px (latents 8x8, 16 image tokens)."""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.tiny_assets import TOKENIZER_CORPUS, ensure_asset

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The words of QwenImagePipeline's system prompt (prompt_template_encode), so that it tokenizes word by word as
# Qwen's own tokenizer does (34 tokens up to the caption, the pipeline's prompt_template_encode_start_idx).
TEMPLATE_WORDS = ("system Describe the image by detailing color shape size texture quantity text spatial relationships "
                  "objects and background user assistant")


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (the alphabet of a byte-level BPE)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_qwen_tokenizer(folder: Path) -> int:
    """A byte-level BPE whose merges spell every corpus word after a space ("Ġword") as one token, Qwen's special
    tokens after it; returns the vocab size. Every merge extends a "Ġ" piece by one character, so no merge inside a
    word (("a", "t")) can outrank a word's own chain; a word after a newline is spelled out, byte by byte."""
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    merges: list[tuple[str, str]] = []
    for word in sorted(set(TOKENIZER_CORPUS) | set(TEMPLATE_WORDS.split())):
        piece = "Ġ"
        for ch in word:
            if piece + ch not in vocab:
                merges.append((piece, ch))
                vocab[piece + ch] = len(vocab)
            piece += ch
    for token in SPECIAL:
        vocab[token] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL[1:])})
    tok.save_pretrained(folder)
    return len(vocab)


def qwen_text_encoder(vocab_size: int, hidden: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
                bos_token_id=vocab_size - 3, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 3)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                  fullatt_block_indexes=[0])
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))


def make_tiny_qwenimage(folder, *, seed: int = 0) -> Path:
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2Tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = write_qwen_tokenizer(folder / "tokenizer")
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
