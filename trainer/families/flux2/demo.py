"""Tiny, randomly initialised FLUX.2 [dev] and [klein] pipelines written as real diffusers folders, offline. Klein: the real
Flux2Transformer2DModel (2 double and 2 single blocks, dim 32, no guidance embedding as klein), the real
AutoencoderKLFlux2 (8 latent channels, 2x2 patches: 32 transformer channels, batch-norm statistics set away from
0/1 so that their use is visible), a 28-layer Qwen3 text encoder (width 16: the pipeline stacks hidden states
9, 18 and 27, pipeline_flux2_klein.py:215) with the Z-Image demo's byte-level BPE and Qwen chat template, and
FLUX.2's scheduler. Dev: the same transformer with a guidance embedding, and a 31-layer Mistral3 (hidden states
10, 20 and 30, pipeline_flux2.py:312; a one-layer Pixtral vision tower it never runs) with a byte-level BPE and a
Mistral-style chat template that takes the system message and content lists the pipeline sends (lines 88-95).
Images are 64 px (VAE 4x: latents 16x16, 8x8 patches)."""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.tiny_assets import TOKENIZER_CORPUS, ensure_asset
from trainer.families.zimage.demo import write_qwen_tokenizer

TEXT_WIDTH = 16
TEXT_LAYERS = 28  # hidden_states has 29 entries: 0 (embeddings) .. 28; the pipeline reads 9, 18, 27


def flux2_vae():
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                              up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                              layers_per_block=1, latent_channels=8, norm_num_groups=8, sample_size=64)


# Mistral Small 3's chat format, the part Flux2Pipeline uses: the system prompt, then each user message's text items
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% for item in message.content %}"
                    "{% if message.role == 'system' %}[SYSTEM_PROMPT]{{ item.text }}[/SYSTEM_PROMPT]"
                    "{% else %}[INST]{{ item.text }}[/INST]{% endif %}{% endfor %}{% endfor %}")
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]")


def write_mistral_tokenizer(folder: Path, *, max_length: int = 512) -> int:
    """A byte-level BPE learnt from the demo's word list and FLUX.2's system message, with Mistral's special
    tokens and chat format; returns its vocab size."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(MISTRAL_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(TOKENIZER_CORPUS), SYSTEM_MESSAGE], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=max_length, padding_side="left")
    fast.chat_template = MISTRAL_TEMPLATE
    fast.save_pretrained(folder)
    return tok.get_vocab_size()


def tiny_transformer(*, text_width: int, guidance_embeds: bool):
    from diffusers import Flux2Transformer2DModel

    # joint_attention_dim: 3 stacked hidden states of the text encoder's width; head_dim 16 = sum(axes_dims_rope)
    return Flux2Transformer2DModel(in_channels=32, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=3 * text_width,
                                   timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                   guidance_embeds=guidance_embeds)


def tiny_vae():
    vae = flux2_vae()
    vae.bn.running_mean.normal_(0.0, 0.5)  # real statistics are far from N(0, 1); the tiny ones too
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def make_tiny_flux2(folder, *, seed: int = 0) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig,
                              PreTrainedTokenizerFast)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_mistral_tokenizer(folder / "tokenizer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_transformer(text_width=TEXT_WIDTH, guidance_embeds=True)
        torch.manual_seed(seed + 1)
        vae = tiny_vae()
        torch.manual_seed(seed + 2)
        text = MistralConfig(vocab_size=vocab, hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                             num_hidden_layers=31, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             max_position_embeddings=512, tie_word_embeddings=False)
        vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=32, patch_size=16)
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=MISTRAL_SPECIALS.index("[IMG]"),
            tie_word_embeddings=False))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer,
                         tokenizer=PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer"))
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def ensure_tiny_flux2(root) -> dict[str, Path]:
    """`root/tiny-flux2`, built once (atomically, see tiny_assets.ensure_asset)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-flux2": ensure_asset(root / "tiny-flux2", make_tiny_flux2, "model_index.json")}


def make_tiny_flux2_klein(folder, *, seed: int = 0) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_qwen_tokenizer(folder / "tokenizer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_transformer(text_width=TEXT_WIDTH, guidance_embeds=False)  # klein has none
        torch.manual_seed(seed + 1)
        vae = tiny_vae()
        torch.manual_seed(seed + 2)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=vocab, hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH, num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
            tie_word_embeddings=False))
    # FLUX.2's scheduler config (dynamic shifting: the pipeline passes its empirical mu, pipeline_flux2_klein.py:818)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer,
                              tokenizer=Qwen2TokenizerFast.from_pretrained(folder / "tokenizer"), is_distilled=False)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def ensure_tiny_flux2_klein(root) -> dict[str, Path]:
    """`root/tiny-flux2-klein`, built once (atomically, see tiny_assets.ensure_asset)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-flux2-klein": ensure_asset(root / "tiny-flux2-klein", make_tiny_flux2_klein, "model_index.json")}
