"""The tiny offline Qwen2.5-VL parts the Qwen-Image families' demo models share: a byte-level BPE tokenizer with
Qwen's chat (and vision) special tokens, and a 2-layer Qwen2.5-VL with a one-block vision tower. Random, seeded by
the caller; written with `save_pretrained` and read back through `from_pretrained` as a real model is."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from trainer.families.components.tiny_assets import TOKENIZER_CORPUS

CHAT_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


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


def write_qwen_tokenizer(folder: Path, words: Iterable[str] = (), special: tuple[str, ...] = CHAT_SPECIAL) -> int:
    """A byte-level BPE whose merges spell every corpus word (and `words`) after a space ("Ġword") as one token,
    the `special` tokens after it (the first is the end of text); returns the vocab size. Every merge extends a
    "Ġ" piece by one character, so no merge inside a word (("a", "t")) can outrank a word's own chain; a word
    after a newline is spelled out, byte by byte."""
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    merges: list[tuple[str, str]] = []
    for word in sorted(set(TOKENIZER_CORPUS) | set(words)):
        piece = "Ġ"
        for ch in word:
            if piece + ch not in vocab:
                merges.append((piece, ch))
                vocab[piece + ch] = len(vocab)
            piece += ch
    for token in special:
        vocab[token] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": list(special[1:])})
    tok.save_pretrained(folder)
    return len(vocab)


def qwen_text_encoder(vocab_size: int, hidden: int, **token_ids: int):
    """Qwen2.5-VL with 2 text layers and a one-block vision tower (its 14 px patches merged 2x2 into `hidden`-wide
    tokens). `token_ids`: the vision special tokens' ids in the tokenizer (image_token_id, vision_start_token_id,
    ...), where the prompts carry images; the chat tokens are the vocabulary's last three either way."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    chat = vocab_size - len(VISION_SPECIAL) if token_ids else vocab_size
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
                bos_token_id=chat - 3, eos_token_id=chat - 1, pad_token_id=chat - 3)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                  fullatt_block_indexes=[0])
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **token_ids))
