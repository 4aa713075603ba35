"""SDXL (base and its fine-tunes), as the torch-free side sees it (trainer.core.family_spec)."""

from trainer.core.memory import ModelSizes
from trainer.families.sizes import CLIP_G, CLIP_L, SD_VAE
from trainer.core.family_spec import DIFFUSION_FROZEN_ON_RESUME, FamilySpec

SPEC = FamilySpec(
    name="sdxl",
    title="Stable Diffusion XL",
    implementation="trainer.families.sdxl.family:StableDiffusionXLFamily",
    checks="trainer.families.components.checks:diffusion_checks",
    block_swap_note="its UNet has no run of identical blocks to swap (its down and up blocks differ in width); a "
                    "LoRA fits 12 GB with model.base_weights=fp8 and train.gradient_checkpointing",
    # activations per 1024x1024 sample measured on an H200 (bench/gpu_sd15.md, bench/gpu_large.md; SD 1.5's at
    # 512 px scaled by pixels)
    sizes=ModelSizes((), 2_567_463_684, CLIP_L + CLIP_G, SD_VAE, (0.67, 7.24), 23.2e6 / 16, latent_channels=4),
    trained_component="unet",
    channels_last=True,
    published_parameters=2.57e9,  # SDXL base UNet
    frozen_on_resume=DIFFUSION_FROZEN_ON_RESUME,
    exports=("LoRA: diffusers file and a kohya/ComfyUI file (lora_te1_/lora_te2_ keys)",
             "full: a diffusers folder and an original-layout single file"),
    demo_preset="demo-sdxl.yaml",
    demo_assets={"tiny-sdxl": "trainer.families.sdxl.demo:ensure_tiny_sdxl"},
)
