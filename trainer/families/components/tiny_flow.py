"""Tiny text encoders, tokenizers and VAEs that the flow-matching families' offline demo models share (the real
transformers / diffusers classes, a few thousand parameters each; nothing downloaded). The T5 tokenizer is a
`tokenizers` Unigram model over a small word list, wrapped as `T5TokenizerFast` (no sentencepiece)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from trainer.families.components.tiny_assets import SPECIALS, TOKENIZER_CORPUS, build_bpe, write_clip_tokenizer

T5SPECIALS = ("<pad>", "</s>", "<unk>")


def write_t5_tokenizer(folder: Path, *, max_length: int = 512) -> int:
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


def clip_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    vocab, merges = _bpe()
    write_clip_tokenizer(folder, vocab, merges)
    return CLIPTokenizer.from_pretrained(folder), vocab, merges


def clip_config(vocab, *, hidden: int, projection: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                          projection_dim=projection, hidden_act="quick_gelu", bos_token_id=vocab[SPECIALS[0]],
                          eos_token_id=vocab[SPECIALS[1]], pad_token_id=vocab[SPECIALS[1]])


def t5_encoder(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                                   num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0,
                                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                   # a PretrainedConfig keyword that T5Config's typed signature leaves out
                                   decoder_start_token_id=0))


def flow_vae(*, scaling_factor: float, shift_factor: float, flux: bool):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                         up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                         layers_per_block=1, latent_channels=16, norm_num_groups=8, sample_size=64,
                         scaling_factor=scaling_factor, shift_factor=shift_factor,
                         use_quant_conv=not flux, use_post_quant_conv=not flux)
