"""What every diffusion family's loss shares beyond its noise schedule (SD 1.x/2.x and SDXL: DDPM, SD3 and FLUX:
flow matching): the error per latent element (`train.loss`: mse, huber, l1), its weighting by the sample's loss
mask (`data.masks`), and input perturbation (`train.input_perturbation`).

Per sample, the loss is the mean over the latent's elements of mask x error: elements outside the mask (weight
0) add nothing and get no gradient, and a half-masked image weighs half (kohya's masked_loss does the same).
Huber is scaled to equal the squared error where |error| <= delta and grows as 2 delta |error| - delta^2 beyond
(twice PyTorch's huber_loss: switching from mse keeps the loss's scale on small errors; the same shape as kohya's
and diffusers' pseudo-Huber, 2 c (sqrt(error^2 + c^2) - c)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSSES = ("mse", "huber", "l1")


@dataclass(frozen=True)
class Objective:
    loss: str = "mse"
    huber_delta: float = 0.1
    input_perturbation: float = 0.0

    @classmethod
    def from_config(cls, train) -> Objective:
        """From the config's train section."""
        return cls(loss=train.loss, huber_delta=float(train.huber_delta),
                   input_perturbation=float(train.input_perturbation))

    def error(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The error of every element, in fp32."""
        diff = pred.float() - target.float()
        if self.loss == "mse":
            return diff**2
        if self.loss == "l1":
            return diff.abs()
        if self.loss == "huber":
            size, delta = diff.abs(), self.huber_delta
            return torch.where(size <= delta, diff**2, 2 * delta * size - delta**2)
        raise ValueError(f"unknown train.loss {self.loss!r}; expected one of {LOSSES}")

    def per_sample(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) losses: the mean of (mask x) the error over each sample's elements. `mask`: (B, 1, h, w) weights in
        [0, 1] broadcast over the channels, or None."""
        err = self.error(pred, target)
        if mask is not None:
            err = err * mask.to(err.device, err.dtype, non_blocking=True)  # no host sync (components.transfer)
        return err.mean(dim=tuple(range(1, err.ndim)))

    def input_noise(self, generator: torch.Generator, noise: torch.Tensor, *, training: bool = True) -> torch.Tensor:
        """The noise the model's input is made with: `noise` plus input_perturbation x fresh noise (Ning et al.
        2023, diffusers' --input_perturbation), drawn from the sample's generator after its other draws; the
        target keeps `noise`. Held-out rows (`training` False) are measured unperturbed."""
        if not (self.input_perturbation and training):
            return noise
        return noise + self.input_perturbation * torch.randn(noise.shape, generator=generator)
