"""Chroma, as the torch-free side sees it (trainer.core.family_spec). Its settings are the flow-matching section's."""

from trainer.core.memory import flow_sizes
from trainer.families.sizes import T5XXL, VAE
from trainer.core.family_spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec

CHROMA = FamilySpec(
    name="chroma",
    title="Chroma (Chroma1-HD, Chroma1-Base)",
    implementation="trainer.families.chroma.family:ChromaFamily",
    checks="trainer.families.chroma.checks:chroma_checks",
    bucket_multiple=16,  # the transformer packs 2x2 latent patches of the 8x VAE
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    sizes=flow_sizes(((19, 226_548_224), (38, 113_271_040)), 291_267_648, 3072, T5XXL, VAE,
                     # the T5 states and their mask (family.encode_caption); real guidance encodes a negative
                     text_tokens=512, text_floats=(4096 + 1, 0), negative_text=""),
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=8.9e9,  # the model card's 8.9B (ChromaTransformer2DModel(): 8,899,983,424)
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=("LoRA: output/pytorch_lora_weights.safetensors (diffusers) and a kohya/ComfyUI file "
             "(lora_unet_double_blocks_... keys, as for FLUX.1)",
             "full: a diffusers folder and the original single-file layout (as Chroma1-HD.safetensors)"),
    demo_preset="demo-chroma.yaml",
    demo_assets={"tiny-chroma": "trainer.families.chroma.demo:ensure_tiny_chroma"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)
