"""SD3/3.5 and FLUX.1: flow-matching transformers, as the torch-free side sees them (trainer.core.family_spec)."""

from trainer.core.memory import flow_sizes
from trainer.families.sizes import CLIP_G, CLIP_L, T5XXL, VAE
from trainer.core.family_spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec

SD3_TEXT = dict(text_tokens=256, text_floats=(4096, 77 * 4096 + 2048), negative_text="")

SD3 = FamilySpec(
    name="sd3",
    title="Stable Diffusion 3 / 3.5",
    implementation="trainer.families.flow.sd3:SD3Family",
    checks="trainer.families.flow.checks:flow_checks",
    bucket_multiple=16,  # the transformer packs 2x2 latent patches
    block_lists=("transformer_blocks",),
    # SD3.5 medium (its 13 dual-attention blocks averaged in) and large, counted at their configs
    # the text cache: CLIP-L/G's 77 tokens and T5's beside them, 4096 wide, and the 2048 pooled (sd3.encode_caption);
    # sampling encodes the negative prompt too
    sizes=flow_sizes(((24, 92_653_957),), 19_476_544, 1536, CLIP_L + CLIP_G + T5XXL, VAE, **SD3_TEXT),
    sizes_variants={"large": flow_sizes(((38, 210_975_616),), 39_554_112, 2432, CLIP_L + CLIP_G + T5XXL, VAE,
                                        **SD3_TEXT)},
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=2.03e9,  # SD3/3.5 medium MMDiT
    published_variants={"large": 8.06e9},
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=("LoRA: output/pytorch_lora_weights.safetensors (diffusers keys, which ComfyUI also loads for SD3)",
             "full: a diffusers folder and Stability's all-in-one single file"),
    demo_preset="demo-sd3.yaml",
    demo_assets={"tiny-sd3": "trainer.families.flow.demo:ensure_tiny_sd3"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # their transformers run diffusers' attention processors on SDPA; xformers is wired for UNets
)

FLUX = FamilySpec(
    name="flux",
    title="FLUX.1 (dev, schnell)",
    implementation="trainer.families.flow.flux:FluxFamily",
    checks="trainer.families.flow.checks:flow_checks",
    bucket_multiple=16,
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    sizes=flow_sizes(((19, 339_831_296), (38, 141_591_808)), 64_124_992, 3072, CLIP_L + T5XXL, VAE,
                     text_tokens=512, text_floats=(4096, 768)),  # T5's states, CLIP's pooled (flux.encode_caption)
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=11.9e9,  # FLUX.1 dev/schnell transformer
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=("LoRA: diffusers file and a kohya/ComfyUI file (lora_unet_double_blocks_... keys)",
             "full: a diffusers folder and BFL's single-file layout"),
    demo_preset="demo-flux.yaml",
    demo_assets={"tiny-flux": "trainer.families.flow.demo:ensure_tiny_flux"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # their transformers run diffusers' attention processors on SDPA; xformers is wired for UNets
)
