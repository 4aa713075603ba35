"""Mixed precision, done with torch.amp directly rather than through accelerate's `mixed_precision`.

Why: accelerate silently trains fp16 in fp32 on CPU (no autocast, no scaler), and it wraps the model's
forward in autocast for good, so evaluation and sampling through the same module also run in low precision.
Here autocast covers exactly the training forward, samples are drawn in fp32, and the GradScaler is ours, so
skipped overflow steps can be counted. Trainable weights always stay fp32.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Amp:
    def __init__(self, precision: str, device_type: str):
        self.precision = precision
        self.device_type = device_type
        self.dtype = DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None
        self.overflow_steps = 0

    def autocast(self):
        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale(self, optimizer) -> None:
        """Before clipping: gradients back in true units."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> bool:
        """Optimizer step; False when the fp16 scaler skipped it because gradients overflowed."""
        if not self.scaler:
            optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        skipped = self.scaler.get_scale() < scale_before
        self.overflow_steps += int(skipped)
        return not skipped

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler else None, "overflow_steps": self.overflow_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.overflow_steps = state.get("overflow_steps", 0)


def store_base_weights(module: torch.nn.Module, base_weights: str, compute_dtype: torch.dtype) -> None:
    """`model.base_weights: fp8`: the frozen network's weights stored in float8 e4m3 and upcast to `compute_dtype`
    layer by layer around each forward (diffusers' layerwise casting; norms and embeddings stay as they are).
    Call it after the last `.to(dtype)` and before adding LoRA: the adapter's own layers then stay fp32."""
    if base_weights == "fp8":
        # Convolutions stay as they are: under gradient checkpointing their recomputed forward saw the float8
        # weight (torch's CheckpointError), Linear layers do not. UNets keep their ResNet convolutions in the
        # plan's precision; transformers (FLUX, SD3) are nearly all Linear.
        module.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype,
                                        skip_modules_classes=(torch.nn.Conv2d,))


def frozen_dtype(precision: str, method: str) -> torch.dtype:
    """dtype of the frozen base weights: low precision saves memory for LoRA; trained weights stay fp32."""
    if method == "lora" and precision in ("bf16", "fp16"):
        return DTYPES[precision]
    return torch.float32
