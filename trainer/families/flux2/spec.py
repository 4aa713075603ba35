"""FLUX.2 [dev] and [klein], as the torch-free side sees them (trainer.core.family_spec): two families, one pipeline
class each, sharing the hooks of trainer.families.flux2.family. Their settings are the flow-matching section's."""

from trainer.core.memory import flow_sizes
from trainer.families.sizes import FLUX2_VAE, MISTRAL_SMALL_31, QWEN3_4B, QWEN3_8B
from trainer.core.family_spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec

_EXPORTS = ("LoRA: output/pytorch_lora_weights.safetensors (diffusers) and a ComfyUI file (the diffusers "
            "transformer.* lora_A/lora_B keys with an alpha each, which ComfyUI's Flux key map names)",
            "full: a diffusers folder and BFL's single-file layout (as flux2-dev.safetensors)")

FLUX2 = FamilySpec(
    name="flux2",
    title="FLUX.2 [dev]",
    implementation="trainer.families.flux2.family:Flux2Family",
    checks="trainer.families.flux2.checks:flux2_checks",
    bucket_multiple=16,  # 2x2 patches of the 8x VAE (the pipeline rounds to vae_scale_factor * 2)
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    sizes=flow_sizes(((8, 981_467_648), (48, 490_733_824)), 816_316_416, 6144, MISTRAL_SMALL_31, FLUX2_VAE,
                     # Mistral's 3 stacked hidden states (3 x 5120) a token; 32 latent channels
                     text_tokens=512, text_floats=(15360, 0), latent_channels=32),
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=32e9,  # the model card's 32B transformer (black-forest-labs/FLUX.2-dev)
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=_EXPORTS,
    demo_preset="demo-flux2.yaml",
    demo_assets={"tiny-flux2": "trainer.families.flux2.demo:ensure_tiny_flux2"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)

FLUX2_KLEIN = FamilySpec(
    name="flux2_klein",
    title="FLUX.2 [klein] (4B, 9B)",
    implementation="trainer.families.flux2.family:Flux2KleinFamily",
    checks="trainer.families.flux2.checks:flux2_klein_checks",
    bucket_multiple=16,  # 2x2 patches of the 8x VAE (the pipeline rounds to vae_scale_factor * 2)
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # klein 4B (3.89e9) and 9B (9.10e9) counted at the configs recalled from their model cards (5+20 blocks of width
    # 3072, 8+24 of 4096): to check against the hub's transformer/config.json
    sizes=flow_sizes(((5, 245_367_296), (20, 122_683_648)), 205_258_752, 3072, QWEN3_4B, FLUX2_VAE,
                     # Qwen3's 3 stacked hidden states (3 x 2560); with guidance it always encodes "" too
                     text_tokens=512, text_floats=(7680, 0), negative_text="", takes_negative=False, latent_channels=32),
    sizes_variants={"9b": flow_sizes(((8, 436_208_128), (24, 218_104_064)), 372_244_480, 4096, QWEN3_8B, FLUX2_VAE,
                                     text_tokens=512, text_floats=(12288, 0), negative_text="", takes_negative=False,
                                     latent_channels=32)},
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=4e9,  # the model name's size (black-forest-labs/FLUX.2-klein-4B, -base-4B)
    published_variants={"9b": 9e9},  # FLUX.2-klein-9B, -base-9B
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=_EXPORTS,
    demo_preset="demo-flux2-klein.yaml",
    demo_assets={"tiny-flux2-klein": "trainer.families.flux2.demo:ensure_tiny_flux2_klein"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)
