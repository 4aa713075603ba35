"""Published parameter counts of the frozen encoders and VAEs the families' specs share, for the plan's memory
estimate (trainer.core.memory). The denoisers' own counts sit in each spec, counted with diffusers 0.42's classes
on the meta device at the published configs."""

CLIP_L = 123_060_480  # CLIPTextModel, openai/clip-vit-large-patch14
CLIP_G = 694_659_840  # CLIPTextModelWithProjection, OpenCLIP bigG (SDXL, SD3)
T5XXL = 4_762_310_656  # T5EncoderModel, google/t5-v1_1-xxl (FLUX.1, SD3, Chroma)
QWEN25_VL_7B = 8_292_166_656  # Qwen2.5-VL-7B-Instruct (Qwen-Image)
QWEN3_4B = 4_022_468_096  # Qwen3-4B (Z-Image, FLUX.2 klein 4B)
QWEN3_8B = 8_190_735_360  # Qwen3-8B (FLUX.2 klein 9B)
MISTRAL_SMALL_31 = 24_011_361_280  # Mistral-Small-3.1-24B with its vision tower (FLUX.2 dev)
VAE = 83_819_683  # AutoencoderKL, 16 latent channels (FLUX.1, SD3, Chroma, Z-Image)
SD_VAE = 83_653_863  # AutoencoderKL, 4 latent channels (SD 1.x/2.x, SDXL)
QWEN_VAE = 126_892_531  # AutoencoderKLQwenImage (Wan 2.1's)
FLUX2_VAE = 84_046_115  # AutoencoderKLFlux2
