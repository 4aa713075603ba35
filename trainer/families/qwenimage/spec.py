"""Qwen-Image, as the torch-free side sees it (trainer.core.family_spec). Its settings are the flow-matching section's."""

from trainer.core.memory import flow_sizes
from trainer.families.sizes import QWEN25_VL_7B, QWEN_VAE
from trainer.core.family_spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec

QWENIMAGE = FamilySpec(
    name="qwenimage",
    title="Qwen-Image (Qwen-Image, Qwen-Image-2512)",
    implementation="trainer.families.qwenimage.family:QwenImageFamily",
    checks="trainer.families.qwenimage.checks:qwenimage_checks",
    bucket_multiple=16,  # the transformer packs 2x2 latent patches of the 8x VAE
    block_lists=("transformer_blocks",),
    sizes=flow_sizes(((60, 339_831_296),), 40_523_328, 3072, QWEN25_VL_7B, QWEN_VAE,
                     # Qwen2.5-VL's states padded to 512 and their mask; true CFG encodes " " without a negative
                     text_tokens=512, text_floats=(3584 + 1, 0), negative_text=" "),
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=20e9,  # the model card's 20B (QwenImageTransformer2DModel(): 20,430,401,088)
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=("LoRA: output/pytorch_lora_weights.safetensors (diffusers) and a kohya/ComfyUI file "
             "(lora_unet_transformer_blocks_... keys, with alphas)",
             "full: a diffusers folder, the release's own layout (no original single file)"),
    demo_preset="demo-qwenimage.yaml",
    demo_assets={"tiny-qwenimage": "trainer.families.qwenimage.demo:ensure_tiny_qwenimage"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)
