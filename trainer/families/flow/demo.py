"""Tiny, randomly initialised FLUX.1 and SD3 pipelines written as real diffusers folders, offline.

`make_tiny_flux(folder)` and `make_tiny_sd3(folder)` write what `FluxPipeline.from_pretrained(folder)` and
`StableDiffusion3Pipeline.from_pretrained(folder)` load, with the real classes and folder layout (transformer/,
vae/ with 16 latent channels, CLIP text encoders, a T5 encoder, tokenizers, scheduler/), only with a few
thousand parameters per part. The T5 tokenizer is a `tokenizers` Unigram model over a small word list, wrapped
as `T5TokenizerFast` (no sentencepiece, no download). Images are 64 px (latents 16x16) like the SD demo.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from trainer.families.components.tiny_assets import SPECIALS, TOKENIZER_CORPUS, build_bpe, ensure_asset, write_clip_tokenizer

T5SPECIALS = ("<pad>", "</s>", "<unk>")


def _write_t5_tokenizer(folder: Path, *, max_length: int = 512) -> int:
    """A T5-style tokenizer (pad 0, eos 1, unk 2, metaspace words + single letters); returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    # transformers 5 keeps T5TokenizerFast as a run-time alias of T5Tokenizer only (4.x has the class itself).
    from transformers import T5TokenizerFast

    letters = sorted(set("".join(TOKENIZER_CORPUS)) | set("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"))
    words = sorted(set(TOKENIZER_CORPUS))
    vocab = [(t, 0.0) for t in T5SPECIALS] + [("\u2581" + w, -2.0) for w in words]
    vocab += [("\u2581", -3.0)] + [(c, -5.0) for c in letters] + [("\u2581" + c, -4.0) for c in letters]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    fast = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=max_length)
    fast.save_pretrained(folder)
    return len(vocab)


@lru_cache(maxsize=1)
def _bpe():
    return build_bpe(vocab_size=1000)  # the SD demo's CLIP BPE, learnt once per process


def _clip_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    vocab, merges = _bpe()
    write_clip_tokenizer(folder, vocab, merges)
    return CLIPTokenizer.from_pretrained(folder), vocab, merges


def _clip_config(vocab, *, hidden: int, projection: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                          projection_dim=projection, hidden_act="quick_gelu", bos_token_id=vocab[SPECIALS[0]],
                          eos_token_id=vocab[SPECIALS[1]], pad_token_id=vocab[SPECIALS[1]])


def _t5(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                                   num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0,
                                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                   # a PretrainedConfig keyword that T5Config's typed signature leaves out
                                   decoder_start_token_id=0))


def _vae(*, scaling_factor: float, shift_factor: float, flux: bool):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                         layers_per_block=1, latent_channels=16, norm_num_groups=8, sample_size=64,
                         scaling_factor=scaling_factor, shift_factor=shift_factor,
                         use_quant_conv=not flux, use_post_quant_conv=not flux)


def make_tiny_flux(folder, *, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """A tiny FLUX.1 pipeline: `guidance_embeds=True` is dev-like (distilled guidance, dynamic shift),
    False is schnell-like (no guidance embedding, shift 1)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5TokenizerFast  # see _write_t5_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab, merges = _clip_tokenizer(folder / "tokenizer")
    t5_vocab = _write_t5_tokenizer(folder / "tokenizer_2", max_length=512 if guidance_embeds else 256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, guidance_embeds=guidance_embeds,
                                             axes_dims_rope=(4, 6, 6))
        torch.manual_seed(seed + 1)
        vae = _vae(scaling_factor=0.3611, shift_factor=0.1159, flux=True)
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModel(_clip_config(vocab, hidden=32, projection=32))
        torch.manual_seed(seed + 3)
        text_encoder_2 = _t5(t5_vocab, 32)
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
    tokenizer, vocab, merges = _clip_tokenizer(folder / "tokenizer")
    tokenizer_2, _, _ = _clip_tokenizer(folder / "tokenizer_2")
    t5_vocab = _write_t5_tokenizer(folder / "tokenizer_3", max_length=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=2,
                                            attention_head_dim=8, num_attention_heads=4, joint_attention_dim=48,
                                            caption_projection_dim=32, pooled_projection_dim=32, out_channels=16,
                                            pos_embed_max_size=32, qk_norm="rms_norm")
        torch.manual_seed(seed + 1)
        vae = _vae(scaling_factor=1.5305, shift_factor=0.0609, flux=False)
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModelWithProjection(_clip_config(vocab, hidden=16, projection=16))
        with torch.no_grad():
            text_encoder.text_projection.weight.copy_(torch.eye(16))
        torch.manual_seed(seed + 3)
        text_encoder_2 = CLIPTextModelWithProjection(_clip_config(vocab, hidden=24, projection=16))
        torch.manual_seed(seed + 4)
        text_encoder_3 = _t5(t5_vocab, 48)
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
