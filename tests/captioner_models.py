"""Tiny, seeded, randomly initialised captioners of the real architectures (transformers' Florence-2, Qwen2.5-VL and
LLaVA, a timm ViT tagger), saved with save_pretrained / timm's save_for_hf into a folder, so tests load them back
through the same from_pretrained path a downloaded model takes. Nothing is downloaded: the tokenizers are word-level
ones built here, and the processors are constructed from their parts."""

from __future__ import annotations

from pathlib import Path

WORDS = "a cat dog photo of red blue green the on grass user assistant system : describe image".split()
TAGS = ["1girl", "solo", "long_hair", "red_eyes", "smile", "outdoors"]


def word_tokenizer(specials: list[str], **named):
    """A fast word-level tokenizer: `specials` first (ids 0..), then WORDS; `named` maps bos/eos/pad... to them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate([*specials, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=specials[0], **named)
    tokenizer.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in named.values()]})
    return tokenizer, vocab


# Content as parts (Qwen-VL, llava-hf), or as a plain string with the image placed by the template in the user's
# message (JoyCaption's template).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% if m['content'] is string %}"
                 "{% if m['role'] == 'user' %}IMAGE {% endif %}{{ m['content'] }} {% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'image' %}IMAGE {% else %}{{ c['text'] }} {% endif %}"
                 "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")


def build_llava(folder: Path) -> Path:
    """JoyCaption's architecture (LlavaForConditionalGeneration: CLIP vision tower, Llama text model)."""
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer, vocab = word_tokenizer(["<unk>", "<s>", "</s>", "<pad>", "<image>"], bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>")
    template = CHAT_TEMPLATE.replace("IMAGE", "<image>")
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                  crop_size={"height": 32, "width": 32}),
                               tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=template, image_token="<image>")
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=32, patch_size=8, projection_dim=16),
        text_config=LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                bos_token_id=1, eos_token_id=2, pad_token_id=3),
        image_token_id=vocab["<image>"], vision_feature_layer=-1)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def build_tagger(folder: Path) -> Path:
    """A WD-style tagger: a timm ViT with one output per row of selected_tags.csv, saved as the WD repos are."""
    import timm
    import torch

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=len(TAGS), img_size=32,
                              embed_dim=16, depth=1, num_heads=2)
    timm.models.save_for_hf(model, folder, model_config={"num_classes": len(TAGS)},
                            model_args={"img_size": 32, "embed_dim": 16, "depth": 1, "num_heads": 2},
                            safe_serialization=True)
    rows = ["tag_id,name,category,count"] + [f"{i},{tag},0,{100 - i}" for i, tag in enumerate(TAGS)]
    (folder / "selected_tags.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


def build_florence2(folder: Path) -> Path:
    """transformers' own Florence2ForConditionalGeneration (DaViT vision tower, BART encoder-decoder)."""
    import torch
    from transformers import (BartConfig, CLIPImageProcessor, Florence2Config, Florence2ForConditionalGeneration,
                              Florence2Processor, Florence2VisionConfig)

    tokenizer, vocab = word_tokenizer(["<unk>", "<s>", "</s>", "<pad>", "<image>"], bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessor(size={"height": 64, "width": 64}, do_center_crop=False, image_seq_length=5)
    processor = Florence2Processor(image_processor=images, tokenizer=tokenizer)
    torch.manual_seed(0)
    vision = Florence2VisionConfig(depths=(1, 1, 1, 1), embed_dim=(8, 16, 16, 16), num_heads=(1, 1, 1, 1),
                                   num_groups=(1, 1, 1, 1), window_size=2, projection_dim=16, drop_path_rate=0.0)
    text = BartConfig(vocab_size=len(vocab), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3, decoder_start_token_id=2, forced_eos_token_id=2)
    config = Florence2Config(text_config=text, vision_config=vision, image_token_id=vocab["<image>"])
    Florence2ForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def build_qwen25_vl(folder: Path) -> Path:
    """Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): the chat captioner of musubi-tuner."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    tokenizer, vocab = word_tokenizer(specials, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    template = CHAT_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
    pixels = {"min_pixels": 28 * 28, "max_pixels": 56 * 56, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                    video_processor=Qwen2VLVideoProcessor(**pixels), chat_template=template)
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                     "bos_token_id": None, "eos_token_id": vocab["<|im_end|>"], "pad_token_id": vocab["<|endoftext|>"]},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [0]},
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
