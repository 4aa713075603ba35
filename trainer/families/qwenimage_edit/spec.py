"""Qwen-Image-Edit, as the torch-free side sees it (trainer.core.family_spec). Its settings are the flow-matching
section's; its paired data is data.control_path."""

from dataclasses import replace

from trainer.core.family_spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec
from trainer.core.memory import flow_sizes
from trainer.families.sizes import QWEN25_VL_7B, QWEN_VAE

# Qwen-Image's transformer (the edit releases keep its architecture); the image sequence is the target's tokens
# and the control's, cached at the target's bucket: twice Qwen-Image's activations (SDPA's memory is linear in
# tokens; the text adds the control's ~200 vision tokens, a few percent of 8192 image tokens at 1024 px).
_SIZES = flow_sizes(((60, 339_831_296),), 40_523_328, 3072, QWEN25_VL_7B, QWEN_VAE,
                    # Qwen-Image's text layout (states padded to 512 and their mask), an entry per (caption, control)
                    text_tokens=512, text_floats=(3584 + 1, 0), negative_text=" ", text_per_image=True)

QWENIMAGE_EDIT = FamilySpec(
    name="qwenimage_edit",
    title="Qwen-Image-Edit (2509, 2511: instruction edits)",
    implementation="trainer.families.qwenimage_edit.family:QwenImageEditFamily",
    checks="trainer.families.qwenimage_edit.checks:qwenimage_edit_checks",
    bucket_multiple=16,  # the transformer packs 2x2 latent patches of the 8x VAE
    block_lists=("transformer_blocks",),
    sizes=replace(_SIZES, activation_gib=(2 * _SIZES.activation_gib[0], 2 * _SIZES.activation_gib[1])),
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS + ("data.control_path",),
    published_parameters=20e9,  # Qwen-Image's 20B transformer
    # The control images are half of every sample, and the text embeddings read them: other controls are another
    # dataset.
    frozen_on_resume=FLOW_FROZEN_ON_RESUME + ("data.control_path",),
    control_images="the control image is read twice, as the pipeline does: by Qwen2.5-VL with the instruction (the "
                   "text embeddings, cached per pair), and as latent tokens after the target's (img_shapes target, "
                   "then control); the loss is on the target's tokens",
    exports=("LoRA: diffusers file (QwenImageEditPlusPipeline.load_lora_weights) and a kohya/ComfyUI file "
             "(lora_unet_transformer_blocks_... keys with alphas, Qwen-Image's layout)",
             "full: a diffusers folder, the release's own layout (no original single file)"),
    demo_preset="demo-qwenimage-edit.yaml",
    demo_assets={"tiny-qwenimage-edit": "trainer.families.qwenimage_edit.demo:ensure_tiny_qwenimage_edit",
                 "demo-edit": "trainer.families.components.edit_pairs:ensure_demo_edit",
                 "demo-edit-control": "trainer.families.components.edit_pairs:ensure_demo_edit"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights: the Qwen2.5-VL (vision tower too) as Qwen-Image's
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)
