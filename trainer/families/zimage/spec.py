"""Z-Image, as the torch-free side sees it (trainer.core.family_spec). Its settings are the flow-matching section's."""

from trainer.core.memory import flow_sizes
from trainer.families.sizes import QWEN3_4B, VAE
from trainer.core.family_spec import FLOW_FROZEN_ON_RESUME, FLOW_PATH_KEYS, FLOW_SECTION_TITLE, FamilySpec

ZIMAGE = FamilySpec(
    name="zimage",
    title="Z-Image (Z-Image Turbo, Z-Image)",
    implementation="trainer.families.zimage.family:ZImageFamily",
    checks="trainer.families.zimage.checks:zimage_checks",
    bucket_multiple=16,  # the transformer patchifies 2x2 latent patches of the 8x VAE (ZImagePipeline checks 16)
    block_lists=("noise_refiner", "context_refiner", "layers"),  # their forward order
    sizes=flow_sizes(((2, 180_910_336), (2, 176_962_816), (30, 180_910_336)), 11_852_352, 3840, QWEN3_4B, VAE,
                     # Qwen3's states padded to 512 and their mask; with guidance "" without a negative prompt
                     text_tokens=512, text_floats=(2560 + 1, 0), negative_text=""),
    trained_component="transformer",
    path_keys=FLOW_PATH_KEYS,
    published_parameters=6.15e9,  # the model card's 6B (ZImageTransformer2DModel(): 6,154,908,736)
    frozen_on_resume=FLOW_FROZEN_ON_RESUME,
    exports=("LoRA: output/pytorch_lora_weights.safetensors (diffusers) and a ComfyUI file "
             "(diffusion_model.layers... lora_A/lora_B/alpha keys, ComfyUI's Lumina2 key map)",
             "full: a diffusers folder, the release's own layout (no original single file)"),
    demo_preset="demo-zimage.yaml",
    demo_assets={"tiny-zimage": "trainer.families.zimage.demo:ensure_tiny_zimage"},
    section="flow",
    section_title=FLOW_SECTION_TITLE,
    quantizes_text_encoders=True,  # model.text_encoder_weights (trainer.families.flow.trainer)
    xformers=False,  # diffusers' attention processors on SDPA; xformers is wired for the UNets
)
