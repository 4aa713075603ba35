"""Rectified-flow (flow-matching) training maths shared by SD3/3.5 and FLUX.1.

With sigma in [0, 1] (0: the clean latent x0, 1: pure noise):

    noisy  = (1 - sigma) * x0 + sigma * noise
    target = noise - x0                      (the velocity the transformer predicts)

Timesteps are drawn per sample from its own generator (seeded by its stream position), as `u` in (0, 1):
`uniform`, or `logit_normal` (SD3 paper: u = sigmoid(N(mean, std))), then shifted towards noise by
`sigma = s * u / (1 + (s - 1) * u)`. SD3 uses a fixed shift (3.0 in its scheduler config); FLUX uses a
resolution-dependent one, `s = exp(mu)`, mu linear in the number of image tokens between
(base_image_seq_len, base_shift) and (max_image_seq_len, max_shift) - the schedule FLUX's own sampler uses.
The transformer's timestep is `sigma * 1000` (SD3) or `sigma` (FLUX's diffusers module scales by 1000 itself).
"""

from __future__ import annotations

import math

import torch

from trainer.families.components.objective import Objective

SCHEMES = ("logit_normal", "uniform")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


def draw_u(generator: torch.Generator, *, scheme: str, logit_mean: float = 0.0, logit_std: float = 1.0) -> float:
    """One timestep fraction u in (0, 1) from this sample's generator."""
    if scheme == "uniform":
        return float(torch.rand((), generator=generator))
    if scheme == "logit_normal":
        return float(torch.sigmoid(torch.randn((), generator=generator) * logit_std + logit_mean))
    raise ValueError(f"unknown timestep sampling scheme {scheme!r}; expected one of {SCHEMES}")


def shift_sigma(u, shift: float):
    """sigma = s*u / (1 + (s-1)*u): s > 1 spends more training on noisier timesteps (works on floats and tensors)."""
    return shift * u / (1 + (shift - 1) * u)


def resolution_shift(image_seq_len: int, *, base_seq_len: int = 256, max_seq_len: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's shift for an image of `image_seq_len` packed tokens: exp(mu), mu linear in the token count
    (diffusers' `calculate_shift`, the same numbers FLUX's sampler uses): 1024 px (4096 tokens) -> e^1.15."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    mu = image_seq_len * slope + (base_shift - slope * base_seq_len)
    return math.exp(mu)


def noisy_and_target(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                     input_noise: torch.Tensor | None = None):
    """(noisy input, velocity target) for latents x0 (B, ...) and per-sample sigmas (B,); `input_noise` (input
    perturbation: noise plus a little more) makes the input, the target keeps `noise`."""
    s = sigmas.to(x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * (noise if input_noise is None else input_noise), noise - x0


def loss_weight(sigmas: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample loss weights (diffusers' `compute_loss_weighting_for_sd3`): `none` (1, the SD3/FLUX default
    with logit-normal sampling), `sigma_sqrt` (sigma^-2) or `cosmap` (2 / (pi * (1 - 2s + 2s^2)))."""
    if weighting == "none":
        return torch.ones_like(sigmas)
    if weighting == "sigma_sqrt":
        return sigmas.clamp_min(1e-4) ** -2.0
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    raise ValueError(f"unknown loss weighting {weighting!r}; expected one of {WEIGHTINGS}")


def per_sample_loss(pred: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor, weighting: str = "none", *,
                    objective: Objective = Objective(), mask: torch.Tensor | None = None):
    """The objective's loss per sample (fp32; MSE by default; `mask`: trainer.families.components.objective),
    weighted per timestep."""
    loss = objective.per_sample(pred, target, mask)
    return loss * loss_weight(sigmas.float().to(loss.device), weighting)


def draw_sample(generator: torch.Generator, latent_shape: tuple[int, ...], *, scheme: str, logit_mean: float,
                logit_std: float, shift: float, noise_offset: float = 0.0):
    """A sample's draws in a fixed order: the VAE latent's eps, the timestep, the noise (then, with a noise
    offset, one more draw per channel). Returns (latent_eps, sigma, noise)."""
    latent_eps = torch.randn(latent_shape, generator=generator)
    sigma = shift_sigma(draw_u(generator, scheme=scheme, logit_mean=logit_mean, logit_std=logit_std), shift)
    noise = torch.randn(latent_shape, generator=generator)
    if noise_offset:
        # As for the UNet families (trainer.families.components.noise): a per-channel shift of the noise, so the
        # model also learns to move an image's mean colour (very dark or bright images); the velocity target
        # noise - x0 carries it.
        noise = noise + noise_offset * torch.randn((latent_shape[0], *([1] * (len(latent_shape) - 1))),
                                                   generator=generator)
    return latent_eps, float(sigma), noise


# ---- FLUX latent packing: 2x2 patches of a (C, H, W) latent become (H/2 * W/2) tokens of C*4 channels ----------
def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C * 4), the layout FluxPipeline._pack_latents uses."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack_latents` for a latent of `height` x `width` (latent pixels)."""
    b, _, d = packed.shape
    x = packed.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def latent_image_ids(height: int, width: int) -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of the packed tokens (channel 0 zero, then row, column)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)
