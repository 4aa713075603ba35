"""Stable Diffusion 1.x / 2.x, as the torch-free side sees it (trainer.core.family_spec)."""

from trainer.core.memory import ModelSizes
from trainer.families.sizes import CLIP_L, SD_VAE
from trainer.core.family_spec import DIFFUSION_FROZEN_ON_RESUME, FamilySpec

SPEC = FamilySpec(
    name="sd",
    title="Stable Diffusion 1.x / 2.x",
    implementation="trainer.families.sd.family:StableDiffusionFamily",
    checks="trainer.families.components.checks:diffusion_checks",
    block_swap_note="its UNet has no run of identical blocks to swap (its down and up blocks differ in width); a "
                    "LoRA fits 12 GB with model.base_weights=fp8 and train.gradient_checkpointing",
    # activations per 1024x1024 sample measured on an H200 (bench/gpu_sd15.md, bench/gpu_large.md; SD 1.5's at
    # 512 px scaled by pixels)
    sizes=ModelSizes((), 859_520_964, CLIP_L, SD_VAE, (1.02, 4.34), 0.2e6, caches_text=False, latent_channels=4),
    trained_component="unet",
    channels_last=True,
    published_parameters=860e6,  # SD 1.x/2.x UNet
    frozen_on_resume=DIFFUSION_FROZEN_ON_RESUME,
    exports=("LoRA: output/pytorch_lora_weights.safetensors (diffusers) and a kohya/ComfyUI file",
             "full: a diffusers folder and an original-layout single file"),
    demo_preset="demo.yaml",
    demo_assets={"tiny-sd": "trainer.families.sd.demo:shipped_tiny_sd",
                 "sks-circle": "trainer.families.sd.demo:ensure_concept_data",
                 "demo-data": "trainer.families.components.tiny_assets:ensure_demo_data"},
)
