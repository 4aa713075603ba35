"""A tiny, randomly initialised Z-Image pipeline written as a real diffusers folder, offline: the real
ZImageTransformer2DModel (2 main layers, 1 noise and 1 context refiner, dim 32), a 3-layer Qwen3 text encoder
(the pipeline reads its second-to-last hidden state), a byte-level BPE tokenizer with a Qwen-style chat template,
FLUX.1's 16-channel VAE shape and Z-Image Turbo's scheduler (static shift 3). Images are 64 px (latents 16x16)."""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.tiny_assets import TOKENIZER_CORPUS, ensure_asset
from trainer.families.components.tiny_flow import flow_vae

# Qwen3's chat template, the part ZImagePipeline._encode_prompt uses: one user message and the assistant prompt
# (enable_thinking=True adds nothing after it; False would add an empty think block).
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
                 "and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_qwen_tokenizer(folder: Path, *, max_length: int = 512) -> int:
    """A Qwen2-style byte-level BPE learnt from the demo's word list (deterministic: `tokenizers` breaks ties by
    pair order), padding on the right with <|endoftext|> as Qwen3's; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(QWEN_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(TOKENIZER_CORPUS), "user assistant"], trainer=trainer)
    fast = Qwen2TokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                              unk_token=None, model_max_length=max_length, padding_side="right")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return tok.get_vocab_size()


def qwen3_encoder(vocab_size: int, hidden: int):
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  max_position_embeddings=512, tie_word_embeddings=False))


def make_tiny_zimage(folder, *, seed: int = 0) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen2TokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_qwen_tokenizer(folder / "tokenizer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # head_dim 16 = sum(axes_dims); 2 heads: dim 32. cap_feat_dim is the text encoder's width.
        transformer = ZImageTransformer2DModel(in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                                               n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6],
                                               axes_lens=[512, 64, 64])
        torch.manual_seed(seed + 1)
        vae = flow_vae(scaling_factor=0.3611, shift_factor=0.1159, flux=True)  # Z-Image uses FLUX.1's VAE
        torch.manual_seed(seed + 2)
        text_encoder = qwen3_encoder(vocab, 32)
    # Z-Image Turbo's scheduler: a static shift of 3 (ai-toolkit restates it, z_image.py:42-46)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer,
                          tokenizer=Qwen2TokenizerFast.from_pretrained(folder / "tokenizer"))
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def ensure_tiny_zimage(root) -> dict[str, Path]:
    """`root/tiny-zimage`, built once (atomically, see tiny_assets.ensure_asset); {"tiny-zimage": path}."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-zimage": ensure_asset(root / "tiny-zimage", make_tiny_zimage, "model_index.json")}
