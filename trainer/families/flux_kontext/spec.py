"""FLUX.1 Kontext, as the torch-free side sees it (trainer.core.family_spec). Its settings are the flow-matching
section's; its paired data is data.control_path."""

from dataclasses import replace

from trainer.core.family_spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec
from trainer.core.memory import flow_sizes
from trainer.families.sizes import CLIP_L, T5XXL, VAE

# FLUX.1-Kontext-dev's transformer is FLUX.1-dev's architecture (the same counts); what differs is the sequence:
# the control image's latent tokens follow the target's, so at 1024 px it attends over 512 text + 2 x 4096 image
# tokens instead of 512 + 4096. Activations (linear in tokens under SDPA) are FLUX.1's measurement scaled by that:
# an estimate, not measured on a GPU.
SEQUENCE = (512 + 2 * 4096) / (512 + 4096)
_FLUX1 = flow_sizes(((19, 339_831_296), (38, 141_591_808)), 64_124_992, 3072, CLIP_L + T5XXL, VAE,
                    text_tokens=512, text_floats=(4096, 768))  # T5's states, CLIP's pooled (family.encode_caption)
SIZES = replace(_FLUX1, activation_gib=(_FLUX1.activation_gib[0] * SEQUENCE, _FLUX1.activation_gib[1] * SEQUENCE))

FLUX_KONTEXT = FamilySpec(
    name="flux_kontext",
    title="FLUX.1 Kontext (instruction edits)",
    implementation="trainer.families.flux_kontext.family:FluxKontextFamily",
    checks="trainer.families.flux_kontext.checks:flux_kontext_checks",
    bucket_multiple=16,  # the transformer packs 2x2 latent patches of the 8x VAE
    block_lists=("transformer_blocks", "single_transformer_blocks"),  # FLUX.1's transformer, swapped as FLUX's
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS + ("data.control_path",),
    published_parameters=11.9e9,  # FLUX.1-Kontext-dev's transformer is FLUX.1-dev's architecture
    sizes=SIZES,
    # The control images are half of every sample: other controls are another dataset.
    frozen_on_resume=FLOW_FROZEN_ON_RESUME + ("data.control_path",),
    control_images="the control image's latent tokens follow the target's in the image sequence (position ids "
                   "with first coordinate 1); the loss is on the target's tokens",
    exports=("LoRA: diffusers file (FluxKontextPipeline.load_lora_weights) and a kohya/ComfyUI file "
             "(lora_unet_double_blocks_... keys, as for FLUX.1)",
             "full: a diffusers folder and BFL's single-file layout"),
    demo_preset="demo-flux-kontext.yaml",
    demo_assets={"tiny-flux-kontext": "trainer.families.flux_kontext.demo:ensure_tiny_flux_kontext",
                 "demo-edit": "trainer.families.components.edit_pairs:ensure_demo_edit",
                 "demo-edit-control": "trainer.families.components.edit_pairs:ensure_demo_edit"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)
