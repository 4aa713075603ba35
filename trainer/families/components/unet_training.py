"""What the UNet families (SD 1.x/2.x, SDXL) share besides the data: placing and adapting their models
(`setup_models`) and the DDPM loss of a batch of samples (`ddpm_loss`), each family supplying its own UNet call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.core.data.stream import position_seed
from trainer.families.components import noise as diffusion
from trainer.families.components.base_weights import frozen_dtype, place_frozen_network
from trainer.families.components.captioned import torch_generator
from trainer.families.components.captioned_latents import CaptionedLatents, Row
from trainer.families.components.objective import Objective
from trainer.families.components.transfer import on_device, tensor_on

Predict = Callable[[torch.Tensor, torch.Tensor, list[str], list[Row]], torch.Tensor]
"""`predict(noisy latents, timesteps, captions, rows)`: the UNet's prediction with the family's conditioning."""


def ddpm_loss(rows: list[Row], stream: int, *, data: CaptionedLatents, vae: Any, noise_scheduler: Any,
              prediction_type: str, predict: Predict) -> torch.Tensor:
    """Per-sample losses of `rows`: each sample's latent, noise and timestep drawn from its own generator
    (seeded by its stream position and `stream`), noised by the scheduler (input perturbation: with a little
    more noise), predicted with its caption (trainer.core.data.captions), and the objective's error (mse, huber,
    l1) weighted by its loss mask and Min-SNR."""
    cfg, device = data.cfg, data.ctx.device
    objective = Objective.from_config(cfg.train)
    dists, eps, noises, inputs, timesteps = [], [], [], [], []
    for position, epoch, image_index, expanded_index, kind in rows:
        dists.append(data.latent_dist(image_index, epoch, expanded_index, kind))  # cached: CPU; encoded: device
        gen = torch_generator(position_seed(cfg.seed, position, stream))
        shape = tuple(dists[-1][0].shape)
        d = diffusion.draw(gen, shape, num_timesteps=noise_scheduler.config.num_train_timesteps,
                           noise_offset=cfg.train.noise_offset)
        eps.append(d.latent_eps)
        noises.append(d.noise)
        inputs.append(objective.input_noise(gen, d.noise, training=kind != "val"))
        timesteps.append(d.timestep)
    mean = torch.stack([on_device(m, device) for m, _ in dists])
    std = torch.stack([on_device(s, device) for _, s in dists])
    x0 = (mean + std * on_device(torch.stack(eps), device)) * vae.config.scaling_factor
    noise = on_device(torch.stack(noises), device)
    t = tensor_on(timesteps, device, torch.long)
    noisy = noise_scheduler.add_noise(x0, on_device(torch.stack(inputs), device), t)
    pred = predict(noisy, t, [data.row_caption(row) for row in rows], rows)
    target = diffusion.target_for(noise_scheduler, x0, noise, t, prediction_type)
    return diffusion.per_sample_loss(pred, target, scheduler=noise_scheduler, timesteps=t,
                                     prediction_type=prediction_type, min_snr_gamma=cfg.train.min_snr_gamma,
                                     objective=objective, mask=data.loss_masks(rows, (x0.shape[-2], x0.shape[-1])))


def setup_models(cfg, plan, device, *, unet, vae, text_encoders, train_text_encoder: bool, te_lora_kwargs=None,
                 pipeline=None) -> None:
    """Shared by the UNet families (SD 1.x/2.x, SDXL): move and cast the models, add LoRA layers (or unfreeze for a
    full fine-tune), keep trained weights fp32, gradient checkpointing, train/eval modes. `te_lora_kwargs[i]`:
    extra peft config arguments for text encoder i (e.g. which layers); `pipeline()`: the family's pipeline of
    these models, which reads `lora.init_from`."""
    components = ("unet", "text_encoder", "text_encoder_2")[:1 + len(text_encoders)]
    start = None
    if cfg.method == "lora" and cfg.lora.init_from:  # read before any cast: diffusers loads it as it loads a LoRA
        from trainer.families.components.adapter_init import read_start

        assert pipeline is not None, "a family that reads lora.init_from passes its pipeline"
        start = read_start(pipeline(), cfg.lora.init_from, components)
    base_dtype = frozen_dtype(plan.precision, cfg.method)
    # The VAE stays fp32 under fp16: SD VAEs (SDXL's above all) overflow to NaN latents in fp16 (black samples).
    vae.to(device, dtype=torch.float32 if plan.precision == "fp16" else base_dtype)
    place_frozen_network(unet, cfg.model.base_weights, device, base_dtype,  # fp8 / nf4: LoRA only (validated)
                         fp8_compute=plan.fp8_compute)
    if plan.channels_last:
        # cuDNN's tensor-core convolutions want NHWC; converted before LoRA is added, so the adapter's own
        # weights (saved to files) stay contiguous. LoRA runs only (the plan's rule): a full fine-tune saves the
        # UNet and VAE, whose tensors must be contiguous. Not fused QKV (diffusers' fuse_qkv_projections): its
        # to_qkv copy bypasses to_q/to_k/to_v, where the LoRA layers are, so they would never train.
        unet.to(memory_format=torch.channels_last)
        vae.to(memory_format=torch.channels_last)
    for text_encoder in text_encoders:
        text_encoder.to(device, dtype=base_dtype)
    if plan.attention == "xformers":
        unet.enable_xformers_memory_efficient_attention()

    torch.manual_seed(cfg.seed)  # identical adapter init on every rank and every world size
    if cfg.method == "lora":
        from trainer.families.components.adapters import add_adapter

        add_adapter(unet, cfg.lora, cfg.lora.unet_targets)
        if train_text_encoder:
            for i, text_encoder in enumerate(text_encoders):
                add_adapter(text_encoder, cfg.lora, cfg.lora.text_encoder_targets, inject=True,
                            **(te_lora_kwargs or {}).get(i, {}))
    else:
        unet.requires_grad_(True)
        for text_encoder in text_encoders:
            text_encoder.requires_grad_(train_text_encoder)
    trained = [unet] + (list(text_encoders) if train_text_encoder else [])
    for module in trained:
        for p in module.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # trained weights stay fp32 whatever the precision
    if start is not None:  # into the fp32 weights: a bf16 copy would round the file's update
        from trainer.families.components.adapter_init import apply_start

        apply_start(start, dict(zip(components, [unet, *text_encoders])), cfg.lora)
    if cfg.train.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if train_text_encoder:
            for text_encoder in text_encoders:
                enable = getattr(text_encoder, "activation_checkpointing_enable", None)
                (enable or text_encoder.gradient_checkpointing_enable)()
    unet.train()
    for text_encoder in text_encoders:
        text_encoder.train(train_text_encoder)
    vae.eval()
