"""Config checks of the flow-matching families (SD3, FLUX), torch-free: the shared diffusion checks, and the
keys of the UNet families that mean nothing under flow matching, refused with the key that does the job."""

from __future__ import annotations

from trainer.families.components.checks import diffusion_checks


def flow_checks(config, *, check_paths: bool = True) -> list[str]:
    p = diffusion_checks(config, check_paths=check_paths)
    family = config.model.family
    if config.method == "full" and config.full.train_text_encoder:
        p.append(f"full.train_text_encoder: {family} full fine-tunes train the transformer only; set "
                 "full.train_text_encoder=false")
    if config.method == "lora" and config.lora.train_text_encoder:
        p.append(f"lora.train_text_encoder: {family} LoRA adapts the transformer only (its text encoders stay "
                 "frozen); set lora.train_text_encoder=false")
    if config.method == "full" and config.flow.training_adapter:
        # The adapter is switched off for samples and never saved: a full fine-tune would train around a part of
        # the model its output does not have.
        p.append(f"flow.training_adapter: is for LoRA runs (a full fine-tune of {family} would depend on an adapter "
                 "its saved model lacks); unset it or use method: lora")
    if config.prior.enabled:
        p.append(f"prior.enabled: {family} cannot generate class images yet; put class images in a folder and add "
                 "it to data.datasets with is_regularization: true, or set prior.enabled=false")
    if config.train.min_snr_gamma is not None:
        # Min-SNR weights an epsilon/v-prediction loss by the noise schedule's signal-to-noise ratio; a flow
        # model's velocity loss has its own per-timestep weightings (SD3 paper, section 3.1).
        p.append(f"train.min_snr_gamma: {config.train.min_snr_gamma} is for the UNet families (epsilon and "
                 f"v-prediction); {config.model.family} trains by flow matching: unset it and choose "
                 "flow.weighting (sigma_sqrt or cosmap) or flow.timestep_sampling instead")
    if config.model.zero_terminal_snr:
        # sigma = 1 is pure noise by construction: there is no terminal SNR to rescale.
        p.append(f"model.zero_terminal_snr: is for the UNet families' DDPM noise schedule; {config.model.family} "
                 "trains by flow matching, whose last timestep (sigma 1) is already pure noise: set it to false")
    return p
