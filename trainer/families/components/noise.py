"""DDPM-style training maths shared by the UNet families (SD 1.x/2.x, SDXL): noise, targets, loss weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SampleDraws:
    """A sample's random draws, all from its own generator (see trainer.core.data.stream.position_seed)."""

    latent_eps: torch.Tensor  # draws the latent from the VAE's distribution: mean + std * eps
    timestep: int
    noise: torch.Tensor


def draw(generator: torch.Generator, latent_shape: tuple[int, ...], *, num_timesteps: int, noise_offset: float):
    latent_eps = torch.randn(latent_shape, generator=generator)
    timestep = int(torch.randint(0, num_timesteps, (1,), generator=generator))
    noise = torch.randn(latent_shape, generator=generator)
    if noise_offset:
        # One offset per channel shifts the image's mean colour: teaches very dark/bright images.
        noise = noise + noise_offset * torch.randn((latent_shape[0], 1, 1), generator=generator)
    return SampleDraws(latent_eps, timestep, noise)


def target_for(scheduler, latents, noise, timesteps, prediction_type: str) -> torch.Tensor:
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unknown prediction type {prediction_type}")


def snr(scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    alphas_cumprod = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alphas_cumprod / (1 - alphas_cumprod)


def per_sample_loss(pred, target, *, scheduler, timesteps, prediction_type: str, min_snr_gamma: float | None):
    """MSE per sample (fp32), with Min-SNR weighting (Hang et al. 2023) when gamma is set."""
    loss = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.ndim)))
    if min_snr_gamma:
        s = snr(scheduler, timesteps)
        clipped = torch.clamp(s, max=min_snr_gamma)
        # epsilon: weight min(snr, g)/snr; v-prediction: min(snr, g)/(snr+1) (the v target already carries snr+1).
        weight = clipped / (s + 1) if prediction_type == "v_prediction" else clipped / s
        loss = loss * weight
    return loss
