"""Mixed precision, done with torch.amp directly rather than through accelerate's `mixed_precision`.

Why: accelerate silently trains fp16 in fp32 on CPU (no autocast, no scaler), and it wraps the model's
forward in autocast for good, so evaluation and sampling through the same module also run in low precision.
Here autocast covers exactly the training forward, samples are drawn in fp32, and the GradScaler is ours, so
skipped overflow steps can be counted. Trainable weights always stay fp32.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from trainer.families.components.base_weights import DTYPES




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
