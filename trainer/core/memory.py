"""The plan's memory part: the peak GPU memory of a run per GPU, from published parameter counts, before anything is
loaded; torch-free and pure (the plan calls it). With `model.block_swap: auto` it picks the fewest swapped blocks
that fit the smallest GPU.

What is exact and what is estimated (the plan line says `~`):
- weights: parameter counts (each family's `ModelSizes`, counted from diffusers' classes at the published configs)
  x bytes per parameter of their dtype: exact for bf16 / fp16 / fp32, fp8 and int8 (int8's per-row scales, and the
  norms and embeddings fp8 keeps in bf16, left out: under 1%); nf4 at 0.52 bytes, FLUX.1's measured 5.7 GiB for
  11.9e9 (bench/gpu_large.md).
- block swap: the swapped blocks' weights leave the GPU (LoRA: frozen, in the base's dtype; a full fine-tune: fp32
  weights, gradients and optimizer state, stepped on the CPU) and are counted as CPU memory; a full fine-tune's
  step adds two blocks in flight (the computing one and the prefetched one, fp32) and one block's gradients.
- LoRA: its parameters (per unit of rank on the default layers, FLUX.1's 65.4e6 at rank 16 scaled by the model's
  blocks x width) x (fp32 weight + gradient + optimizer state).
- activations: calibrated on FLUX.1-dev LoRA at 1024 px on an H200 (bench/gpu_large.md: 2.75 GiB a sample with
  checkpointing, 33.2 without, from the batch 1 -> 2 difference), scaled by blocks x width for the
  other transformers and linearly by pixels and batch (SDPA's attention memory is linear in tokens); SD 1.5 and
  SDXL from their own measurements. An estimate, uncalibrated for the other families until a GPU measures them.
- the load: while the text cache is built the text encoders are on the GPU (in model.text_encoder_weights' dtype), alone for the flow-matching families
  under DDP (the denoiser waits in CPU memory), beside the denoiser otherwise; a peak of its own, reported when it
  is the larger one.
Besides, 1 GiB is kept free for the CUDA context and the allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
RESERVE_GIB = 1.0  # the CUDA context (~0.5 GiB) and the caching allocator's fragmentation, never counted above
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "nf4": 0.52}


@dataclass(frozen=True)
class ModelSizes:
    """What the memory plan knows of a family's model, as published counts."""

    blocks: tuple[tuple[int, int], ...]
    """(count, parameters of one block) for each of the denoiser's block lists, in forward order
    (FamilySpec.block_lists); empty for a UNet."""
    other: int
    """The denoiser's parameters outside those blocks (all of a UNet's)."""
    text_encoders: int
    vae: int
    activation_gib: tuple[float, float]
    """Activations of one sample at 1024x1024 px in bf16, GiB: (with gradient checkpointing, without)."""
    lora_per_rank: float
    """LoRA parameters per unit of lora.rank on the family's default layers."""
    caches_text: bool = True
    """The family's default for data.cache_text_embeddings."""
    text_tokens: int = 0
    """The text cache's tokens per caption by default (the pipeline's max_sequence_length; flow.max_sequence_length
    overrides); 0: no text cache figure in the plan (trainer.core.cache_plan)."""
    text_floats: tuple[int, int] = (0, 0)
    """(float32 values per token, per caption besides) of one cached caption: FLUX.1's T5 4096 a token, CLIP's
    pooled 768."""
    negative_text: str | None = None
    """What its sampling also encodes for a prompt: the negative prompt, this text when there is none; None: none."""
    text_per_image: bool = False
    """True: the text encoder also reads each image's control image (Qwen-Image-Edit), so the text cache holds an
    entry per (caption, image) pair, not per distinct caption."""
    takes_negative: bool = True
    """False: `negative_text` is always encoded, whatever sample.negative_prompt says (FLUX.2 klein's "")."""
    latent_channels: int = 16
    """Channels of the VAE's latents (the latent cache's rows), at 1/`latent_factor` of the pixels a side."""
    latent_factor: int = 8

    @property
    def denoiser(self) -> int:
        return self.other + sum(count * size for count, size in self.blocks)

    @property
    def block_count(self) -> int:
        return sum(count for count, _ in self.blocks)

    def last_blocks(self, n: int) -> int:
        """Parameters of the last `n` blocks (those model.block_swap keeps in CPU memory)."""
        sizes = [size for count, size in self.blocks for _ in range(count)]
        return sum(sizes[len(sizes) - n:]) if n > 0 else 0

    def largest_of_last(self, n: int) -> int:
        """Parameters of the largest of the last `n` blocks (a swapped block in flight)."""
        sizes = [size for count, size in self.blocks for _ in range(count)]
        return max(sizes[len(sizes) - n:]) if n > 0 else 0


def flow_sizes(blocks: tuple[tuple[int, int], ...], other: int, width: int, text_encoders: int, vae: int,
               **cached) -> ModelSizes:
    """A flow transformer's sizes with activations and LoRA scaled from FLUX.1's measurement by blocks x width;
    `cached`: the caches' layout (text_tokens, text_floats, negative_text, latent_channels...)."""
    count = sum(c for c, _ in blocks)
    scale = count * width / (57 * 3072)  # FLUX.1: 57 blocks of width 3072
    return ModelSizes(blocks, other, text_encoders, vae, (2.75 * scale, 33.25 * scale), 65.4e6 / 16 * scale,
                      **cached)


@dataclass(frozen=True)
class MemoryPlan:
    gpu_gib: float
    """The memory of the smallest GPU the plan is for (the visible ones, or `gpu_memory_gb` without any)."""
    parts: tuple[tuple[str, float], ...]
    """(what, GiB) of the training step's peak per GPU."""
    load_gib: float
    """The peak while the text cache is built (encoders beside the resident weights); 0 when nothing is cached."""
    base: str
    swapped: int
    blocks: int
    checkpointing: bool
    cpu_gib: float = 0.0
    """CPU memory the swapped blocks hold (their weights; a full fine-tune's gradients and optimizer state too)."""

    @property
    def step_gib(self) -> float:
        return sum(gib for _, gib in self.parts)

    @property
    def peak_gib(self) -> float:
        return max(self.step_gib, self.load_gib)

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.gpu_gib - RESERVE_GIB

    def line(self) -> str:
        """E.g. `peak ~21.4 GB of 24 GB: fp8 base, 12 of 57 blocks swapped, checkpointing`, then the parts."""
        how = [f"{self.base} base"]
        if self.blocks:
            how.append(f"{self.swapped} of {self.blocks} blocks swapped")
        how.append("checkpointing" if self.checkpointing else "no checkpointing")
        parts = ", ".join(f"{what} {gib:.1f}" for what, gib in self.parts)
        when = (f"; the text cache's build peaks at {self.load_gib:.1f} (encoders on the GPU)"
                if self.load_gib > self.step_gib else "")
        if self.cpu_gib:
            when += f"; the swapped blocks hold {self.cpu_gib:.1f} in CPU memory"
        return (f"peak ~{self.peak_gib:.1f} GB of {self.gpu_gib:g} GB: {', '.join(how)} (GiB; step: {parts}{when}; "
                f"weights counted exactly, activations estimated; {RESERVE_GIB:g} GB kept for the CUDA context)")


def estimate(sizes: ModelSizes, *, gpu_gib: float, method: str, precision: str, base_weights: str, swapped: int,
             checkpointing: bool, rank: int, optimizer_bytes: float, resolution: int, per_device: int,
             text_cached: bool, shards: int = 1, encode_alone: bool = False,
             encoder_weights: str = "bf16", encoders_on_gpu: bool = True) -> MemoryPlan:
    """The peak of one GPU's step. `optimizer_bytes`: per trained parameter (trainer.core.model_size);
    `shards`: the processes FSDP shards a full fine-tune across; `encode_alone`: the text encoders fill their cache
    while the denoiser waits in CPU memory; `encoder_weights`: model.text_encoder_weights (bf16: the plan's
    precision); `encoders_on_gpu` False: model.text_encoder_device cpu, they never reach the GPU."""
    act_bytes = BYTES["bf16"] if precision in ("bf16", "fp16") else BYTES["fp32"]
    if method == "full":
        base, weight_bytes = "fp32", BYTES["fp32"]
    else:
        base = precision if base_weights == "bf16" else base_weights  # bf16: unquantized, the plan's precision
        weight_bytes = BYTES[base]
    held = sizes.last_blocks(swapped)
    resident = sizes.denoiser - held
    parts = [("weights", resident * weight_bytes / GIB)]
    cpu = held * weight_bytes / GIB
    if method == "full":  # fp32 weight and gradient (8 bytes) and the optimizer's state; swapped ones on the CPU
        parts = [("weights, gradients, optimizer", resident * (8 + optimizer_bytes) / GIB / shards)]
        cpu = held * (8 + optimizer_bytes) / GIB
        if swapped:  # the computing block and the prefetched one (fp32 copies), one block's gradients
            parts.append(("swapped blocks in flight", sizes.largest_of_last(swapped) * 3 * BYTES["fp32"] / GIB))
    else:
        parts.append(("LoRA + optimizer", sizes.lora_per_rank * rank * (8 + optimizer_bytes) / GIB))
    activations = sizes.activation_gib[0 if checkpointing else 1] * per_device * (resolution / 1024) ** 2
    parts.append(("activations", activations * act_bytes / 2))
    encoder_bytes = act_bytes if encoder_weights == "bf16" else BYTES[encoder_weights]
    encoders, vae = sizes.text_encoders * encoder_bytes / GIB * encoders_on_gpu, sizes.vae * act_bytes / GIB
    parts.append(("VAE", vae))
    if not text_cached:
        parts.append(("text encoders", encoders))
    # The encoders fill the text cache with the denoiser parked in CPU memory (trainer.families.flow.trainer), but
    # under FSDP / DeepSpeed, and with the UNet families, beside it
    load = (0.0 if encode_alone else parts[0][1]) + vae + encoders if text_cached else 0.0
    return MemoryPlan(gpu_gib, tuple(parts), load, base, swapped, sizes.block_count, checkpointing, cpu)


def fewest_swapped(fit, blocks: int) -> int | None:
    """The fewest swapped blocks (0..blocks) for which `fit(n)` holds, else None; `fit` grows with n."""
    lo, hi = 0, blocks
    if not fit(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
