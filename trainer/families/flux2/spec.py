"""FLUX.2 [dev] and [klein], as the torch-free side sees them (trainer.families.spec): two families, one pipeline
class each, sharing the hooks of trainer.families.flux2.family. Their settings are the flow-matching section's."""

from trainer.families.spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec

_EXPORTS = ("LoRA: output/pytorch_lora_weights.safetensors (diffusers) and a ComfyUI file (the diffusers "
            "transformer.* lora_A/lora_B keys with an alpha each, which ComfyUI's Flux key map names)",
            "full: a diffusers folder (no single file yet)")

FLUX2 = FamilySpec(
    name="flux2",
    title="FLUX.2 [dev]",
    implementation="trainer.families.flux2.family:Flux2Family",
    checks="trainer.families.flux2.checks:flux2_checks",
    bucket_multiple=16,  # 2x2 patches of the 8x VAE (the pipeline rounds to vae_scale_factor * 2)
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=32e9,  # the model card's 32B transformer (black-forest-labs/FLUX.2-dev)
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=_EXPORTS,
    demo_preset="demo-flux2.yaml",
    demo_assets={"tiny-flux2": "trainer.families.flux2.demo:ensure_tiny_flux2"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)

FLUX2_KLEIN = FamilySpec(
    name="flux2_klein",
    title="FLUX.2 [klein] (4B, 9B)",
    implementation="trainer.families.flux2.family:Flux2KleinFamily",
    checks="trainer.families.flux2.checks:flux2_klein_checks",
    bucket_multiple=16,  # 2x2 patches of the 8x VAE (the pipeline rounds to vae_scale_factor * 2)
    block_lists=("transformer_blocks", "single_transformer_blocks"),
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
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)
