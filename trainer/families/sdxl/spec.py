"""SDXL (base and its fine-tunes), as the torch-free side sees it (trainer.families.spec)."""

from trainer.families.spec import DIFFUSION_FROZEN_ON_RESUME, FamilySpec

SPEC = FamilySpec(
    name="sdxl",
    title="Stable Diffusion XL",
    implementation="trainer.families.sdxl.family:StableDiffusionXLFamily",
    checks="trainer.families.components.checks:diffusion_checks",
    trained_component="unet",
    channels_last=True,
    published_parameters=2.57e9,  # SDXL base UNet
    frozen_on_resume=DIFFUSION_FROZEN_ON_RESUME,
    exports=("LoRA: diffusers file and a kohya/ComfyUI file (lora_te1_/lora_te2_ keys)",
             "full: a diffusers folder and an original-layout single file"),
    demo_preset="demo-sdxl.yaml",
    demo_assets={"tiny-sdxl": "trainer.families.sdxl.demo:ensure_tiny_sdxl"},
)
