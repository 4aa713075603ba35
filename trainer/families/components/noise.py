"""DDPM-style training maths shared by the UNet families (SD 1.x/2.x, SDXL): noise, targets, loss weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.errors import UserError
from trainer.families.components.objective import Objective


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
    alphas_cumprod = scheduler.alphas_cumprod.to(timesteps.device, non_blocking=True)[timesteps].float()
    return alphas_cumprod / (1 - alphas_cumprod)


def per_sample_loss(pred, target, *, scheduler, timesteps, prediction_type: str, min_snr_gamma: float | None,
                    objective: Objective = Objective(), mask: torch.Tensor | None = None):
    """The objective's loss per sample (fp32; MSE by default; `mask`: trainer.families.components.objective),
    with Min-SNR weighting (Hang et al. 2023) when gamma is set."""
    loss = objective.per_sample(pred, target, mask)
    if min_snr_gamma:
        s = snr(scheduler, timesteps)
        clipped = torch.clamp(s, max=min_snr_gamma)
        # epsilon: weight min(snr, g)/snr; v-prediction: min(snr, g)/(snr+1) (the v target already carries snr+1).
        weight = clipped / (s + 1) if prediction_type == "v_prediction" else clipped / s
        loss = loss * weight
    return loss


def zero_terminal_snr(scheduler_config: dict, *, enabled: bool, prediction_type: str) -> dict:
    """`model.zero_terminal_snr`: the model's scheduler config with its betas rescaled so that the last timestep is
    pure noise (Lin et al. 2023, diffusers' `rescale_betas_zero_snr`: the training scheduler's alphas_cumprod[-1]
    becomes 0) and samplers starting from that last timestep (`trailing` spacing), for training, samples and the
    saved model alike. An epsilon-predicting UNet cannot learn that timestep (its input is the noise it is asked
    for, and sampling divides by alphas_cumprod[-1]), so it is refused: the paper, diffusers and kohya pair it
    with v-prediction."""
    if not enabled:
        return scheduler_config
    if prediction_type != "v_prediction":
        raise UserError(
            f"model.zero_terminal_snr needs a v-prediction model, and this one predicts {prediction_type} (from "
            "model.prediction_type or the model's scheduler config): at zero terminal SNR the last timestep's input "
            "is pure noise, which an epsilon model only copies, and its samples divide by zero. Use a "
            "v-prediction model (SD 2.x 768), set model.prediction_type=v_prediction to train this one into "
            "v-prediction (a long fine-tune), or set model.zero_terminal_snr=false.")
    return {**scheduler_config, "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
