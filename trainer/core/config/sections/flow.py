"""The `flow:` config section, read by the flow-matching families (SD3, FLUX, Chroma, Qwen-Image); torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainer.core.config.fields import key


@dataclass
class FlowConfig:
    """Flow-matching families (SD3/3.5, FLUX.1, Chroma, Qwen-Image): timestep sampling, shift, guidance, which
    layers get LoRA."""

    timestep_sampling: str = key(
        "logit_normal", "How training timesteps are drawn: `logit_normal` (sigmoid of a normal; SD3/FLUX) or `uniform`.",
        choices=("logit_normal", "uniform"),
    )
    logit_mean: float = key(0.0, "Mean of the normal under `logit_normal` sampling (negative: less noisy timesteps).")
    logit_std: float = key(1.0, "Standard deviation of the normal under `logit_normal` sampling.")
    shift: Optional[float] = key(
        None, "Timestep shift s (sigma = s*u / (1 + (s-1)*u)); unset: the model's own (SD3: 3.0 from its scheduler; "
        "FLUX dev and Chroma: resolution-dependent, e^1.15 at 1024 px; Qwen-Image: e^0.69 at 1024 px; "
        "FLUX schnell: 1).",
    )
    weighting: str = key("none", "Loss weighting per timestep: `none`, `sigma_sqrt` or `cosmap`.",
                         choices=("none", "sigma_sqrt", "cosmap"))
    guidance: float = key(1.0, "FLUX dev: the guidance value fed to the guidance embedding while training (1 is "
                         "usual); Chroma and Qwen-Image, with no guidance embedding, refuse any other value.")
    max_sequence_length: Optional[int] = key(
        None, "T5 tokens per caption (Qwen-Image: Qwen2.5-VL tokens after its chat template, at most 1024); unset: "
        "the model's default (FLUX dev 512, schnell 256, SD3 256, Chroma 512, Qwen-Image 512).")
    lora_targets: list[str] = key(
        [], "Layer names inside each transformer block that get LoRA (e.g. `attn.to_q`, `ff.net.2`, `proj_mlp`); "
        "empty: every attention projection and MLP of the family.",
    )
    training_adapter: Optional[str] = key(
        None, "LoRA only: a frozen LoRA that acts on the transformer while training and is off for samples (a local "
        ".safetensors file or owner/repo/file on the hub), as ai-toolkit's training adapters keep a LoRA for a "
        "step-distilled model (Z-Image Turbo: ostris/zimage_turbo_training_adapter) usable at its few steps.",
    )
    lora_blocks: str = key(
        "all", "FLUX and Chroma: which blocks get LoRA: `all`, `double` (the 19 two-stream blocks) or `single` (the 38 "
        "single-stream blocks). SD3: ignored (all its blocks are joint blocks); Qwen-Image: only `all` (one kind of "
        "block).",
        choices=("all", "double", "single"),
    )
