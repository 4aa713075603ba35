"""What SD3/3.5 and FLUX.1 share, as an object each of them holds: `FlowTransformerTrainer`, a diffusers pipeline
with a transformer trained by flow matching, frozen text encoders, LoRA on the transformer (or a full fine-tune).
The data side (scan, VAE latent cache, per-position randomness) is `CaptionedLatents`; the maths is
`flow_matching`. The family holding it is its `FlowModel`: it says how to encode captions, how to call the
transformer, which layers get LoRA, and the timestep shift.

Text: the encoders are frozen, so every caption, sample prompt and negative prompt is encoded once into the
disk cache (`trainer.families.components.text_cache`, keyed by the captions and the encoders) and the encoders
then leave the GPU for good: T5-XXL alone is 9 GB in bf16. Samples are drawn from the cached embeddings.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.core.data.stream import position_seed
from trainer.errors import UserError
from trainer.families.components import flow_matching as fm
from trainer.families.components import text_cache, trained_weights
from trainer.families import spec_of
from trainer.families.components.base_weights import (frozen_dtype, parked, place_frozen_network,
                                                       store_text_encoder)
from trainer.families.components.block_swap import BlockSwap, ignored_by_ddp, last_blocks
from trainer.families.components.captioned import torch_generator
from trainer.families.components.captioned_latents import CaptionedLatents, Row
from trainer.families.components.latent_cache import weights_fingerprint
from trainer.families.components.objective import Objective
from trainer.families.components.transfer import on_device, tensor_on
from trainer.families.components.validation import held_out_loss
from trainer.families.protocol import Evaluates, Sample, WorkerContext


class FlowModel(Protocol):
    """What a flow-matching family tells its trainer about its model."""

    name: str
    pipeline_class: Any  # FluxPipeline / StableDiffusion3Pipeline
    text_encoder_names: tuple[str, ...]
    t5_name: str  # the T5 encoder's pipeline attribute (kept fp32 under fp16: T5 overflows)

    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        """{block list attribute: layer names inside one block}."""

    def max_sequence_length(self) -> int: ...

    def lora_paths(self, paths: list[str]) -> list[str]:
        """Of the layers the targets select, those that get LoRA: a layer whose output never reaches the prediction
        (the last two-stream block's text stream, where nothing reads it) would train nothing, and DDP refuses a
        parameter without a gradient."""

    def image_vae(self, vae: Any) -> Any:
        """The VAE as the latent cache calls it: `encode(B, C, H, W pixels).latent_dist` with (B, C, h, w) mean and
        std (a video VAE's frame dimension hidden here), with its `dtype` and `config`."""

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, h, w) in the transformer's space, same shape: FlowFamily's default is the VAE config's
        `(z - shift_factor) * scaling_factor` (FLUX.1, SD3, Chroma, Z-Image); Qwen-Image's per-channel mean/std;
        FLUX.2's batch-norm statistics of its 2x2-patchified latents."""

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        """The pipeline's guidance argument for `sample.guidance_scale` (its name differs between pipelines)."""

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """The frozen encoders' outputs for one caption (batch dimension 1), encoded on `flow.text_device`."""

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        """What the pipeline encodes to sample one prompt (SD3 adds the negative prompt of its guidance), as text
        keys (`text_key`)."""

    def text_key(self, caption: str, control: str | None) -> str:
        """The text cache's key of a sample's conditioning, which `encode_caption` encodes: the caption itself
        (FlowFamily's default), or where the text encoder reads the control image too (Qwen-Image-Edit's
        Qwen2.5-VL), the caption with that image's path and content digest, so that a changed control image is a
        new key. `control`: the sample's control image path with data.control_path, else None."""

    def shift(self, latent_shape: tuple[int, ...]) -> float: ...

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        """The transformer's velocity prediction, in the latents' (B, C, H, W) layout. `text`: the captions'
        conditioning and, with data.control_path (the families whose spec takes control images), `control`: the
        control images' latents (B, C, H, W), normalized as the targets'."""

    def checkpointing_func(self, transformer: torch.nn.Module) -> Any:
        """The function diffusers' `enable_gradient_checkpointing` calls each block through, or None for its own
        (FlowFamily's default); a family whose transformer drops an argument under checkpointing passes it here."""

    def sample_image_kwargs(self, width: int, height: int) -> dict:
        """The pipeline's arguments besides the prompt for a sample of (width, height): FlowFamily's default is
        none; an edit family gives the control image it edits."""

    def sample_kwargs(self, negative_prompt: str) -> dict: ...

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        """The pipeline's prompt arguments as cached embeddings (its text encoders are on the CPU): batched tensors,
        or lists of one tensor per prompt where the pipeline takes variable-length embeddings (Z-Image)."""

    # Exports (trainer.families.flow.outputs)
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """A plain LoRA's tensors in the layout ComfyUI loads for this model (`state`: the diffusers/peft state
        dict; `alphas`: per module path), or None where ComfyUI reads the diffusers file as it is."""

    def comfy_adapter_name(self, path: str) -> str:
        """The module name ComfyUI maps onto the transformer's `path` (diffusers' name) in a LoKr/LoHa/DoRA file."""

    def kohya_metadata(self) -> dict[str, str]:
        """The `ss_*` / modelspec entries that name this model in the ComfyUI file's header."""

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        """A full fine-tune's original-release single file, from the unwrapped `transformer` in memory."""


class FlowTransformerTrainer:
    """Loads, adapts, trains and samples a flow-matching transformer for the family (`model`) holding it."""

    def __init__(self, ctx: WorkerContext, model: FlowModel):
        self.ctx = ctx
        self.cfg = ctx.config
        self.model = model
        self.name = model.name
        self.pipeline_class = model.pipeline_class
        self.pipe: Any = None
        self.transformer: Any = None
        self.vae: Any = None
        self.text_encoders: list[Any] = []
        self.scheduler_config: dict[str, Any] = {}
        self.lora_targets: list[str] = []
        self.text_embeddings: dict[str, dict[str, torch.Tensor]] = {}  # without the disk cache: per run, in memory
        self.text_cache: text_cache.TextEmbeddings | None = None
        self.evaluator: Evaluates | None = None
        self.adapter: Any = None  # flow.training_adapter's hooks, off while sampling
        self.block_swap: BlockSwap | None = None
        self.swapped: list[torch.nn.Module] = []  # the blocks block_swap keeps in CPU memory
        self.encode_alone = False  # the text encoders reach the GPU only to fill the text cache
        self.encoders_fingerprint = ""  # of the text encoders' weights as loaded, for the text cache's key
        self.text_device: torch.device | None = None  # where the text encoders encode (model.text_encoder_device)
        self.text_dtype = torch.float32  # the first encoder's compute dtype (an fp8-stored one reports float8)

    # ---- models -------------------------------------------------------------------------------------------
    def load(self) -> None:
        cfg, device, plan, model = self.cfg, self.ctx.device, self.ctx.plan, self.model
        # lora/full.train_text_encoder and prior.enabled are refused with the config (trainer.families.flow.checks).
        self.pipe = self._load_pipeline()
        start = None
        if cfg.method == "lora" and cfg.lora.init_from:  # read before any cast, as diffusers loads a LoRA
            from trainer.families.components.adapter_init import read_start

            start = read_start(self.pipe, cfg.lora.init_from, ("transformer",))
        self.transformer, self.vae = self.pipe.transformer, self.pipe.vae
        self.text_encoders = [getattr(self.pipe, n) for n in model.text_encoder_names]
        self.scheduler_config = dict(self.pipe.scheduler.config)
        for module in (self.transformer, self.vae, *self.text_encoders):
            module.requires_grad_(False)
            module.eval()
        base_dtype = frozen_dtype(plan.precision, "lora")  # of the always-frozen parts: VAE and text encoders
        # fp16 turns FLUX/SD3 losses into NaN (sd-scripts #1571, #1407): VAE and T5 stay fp32 under fp16.
        self.vae.to(device, dtype=torch.float32 if plan.precision == "fp16" else base_dtype)
        # model.block_swap: those blocks' frozen weights stay in CPU memory, copied in for each call (block_swap.py)
        swapped = last_blocks(self.transformer, spec_of(cfg.model.family).block_lists, plan.block_swap)
        place_frozen_network(self.transformer, cfg.model.base_weights, device, frozen_dtype(plan.precision, cfg.method),
                             fp8_compute=plan.fp8_compute, held=swapped)
        # Encoders whose captions are cached meet the GPU only to encode them, while the denoiser waits in CPU
        # memory (prepare_data): the load then peaks at the larger of the two, not their sum (trainer.core.memory)
        self.swapped = swapped
        # model.text_encoder_device: cpu: the encoders encode in CPU memory (the config requires the text cache)
        self.text_device = torch.device("cpu") if cfg.model.text_encoder_device == "cpu" else device
        self.encode_alone = (text_cache.cache_text_embeddings(cfg, True) and plan.sharding == "ddp"
                             and self.text_device == device)
        # the text cache's key names the encoders' weights as loaded (torchao's quantized tensors have no sum)
        self.encoders_fingerprint = weights_fingerprint(*self.text_encoders) if \
            text_cache.cache_text_embeddings(cfg, True) else ""
        for name, te in zip(model.text_encoder_names, self.text_encoders):
            dtype = torch.float32 if plan.precision == "fp16" and name == model.t5_name else base_dtype
            te.to(dtype=dtype)
            if te is self.text_encoders[0]:
                self.text_dtype = dtype
            # model.text_encoder_weights: quantized in CPU memory, before the GPU sees them (base_weights.py)
            store_text_encoder(te, cfg.model.text_encoder_weights, dtype)
            te.to(self.text_device if not self.encode_alone else None)
        if cfg.method == "full":
            self.transformer.requires_grad_(True)  # fp32 (frozen_dtype); FSDP shards it when it does not fit
        else:
            if cfg.flow.training_adapter:  # on the frozen layers, before LoRA wraps them (training_adapter.py)
                from trainer.families.flow.training_adapter import TrainingAdapter, read_adapter

                self.adapter = TrainingAdapter(self.transformer, read_adapter(cfg.flow.training_adapter), device)
            self._add_lora()
            if start is not None:
                from trainer.families.components.adapter_init import apply_start

                apply_start(start, {"transformer": self.transformer}, cfg.lora)
        if swapped:  # after LoRA: its layers in the swapped blocks move to the device and train there (a full
            # fine-tune's swapped weights train in CPU memory: block_swap.py)
            self.block_swap = BlockSwap(swapped, device, trains=cfg.method == "full")
            ignored_by_ddp(self.transformer, self.block_swap)
        if cfg.train.gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing(model.checkpointing_func(self.transformer))
        self.transformer.train()
        self.text_embeddings = {}
        self.text_cache = None
        # No class images: prior preservation is refused above. The VAE as the family's image_vae hook shows it.
        self.data = CaptionedLatents(self.ctx, model.image_vae(self.vae))
        # The validation loss goes through the transformer itself: no DDP wrapper expects a backward of it.
        self.evaluator = held_out_loss(self.ctx, self.data,
                                       lambda rows, stream: self._rows_loss(rows, stream, self.transformer),
                                       lambda: [self.transformer])

    def _add_lora(self) -> None:
        cfg = self.cfg
        from trainer.families.components.adapters import add_adapter

        self.lora_targets = self.lora_target_paths()
        if not self.lora_targets:
            raise UserError(f"flow.lora_targets={list(cfg.flow.lora_targets)} with flow.lora_blocks="
                            f"{cfg.flow.lora_blocks} selects no layer of this transformer")
        torch.manual_seed(cfg.seed)  # identical adapter init on every rank and every world size
        add_adapter(self.transformer, cfg.lora, self.lora_targets)
        for p in self.transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # trained weights stay fp32 whatever the precision

    def _load_pipeline(self) -> Any:
        model = self.cfg.model
        local = Path(model.path).expanduser()
        try:
            return self.pipeline_class.from_pretrained(str(local) if local.exists() else model.path,
                                                       dtype=torch.float32, revision=model.revision,
                                                       variant=model.variant)
        except (OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"Could not load the {self.name} model at model.path '{model.path}': {first}. Give a "
                            "diffusers folder (model_index.json, transformer/, vae/, text encoders, tokenizers) or "
                            "a hub id with network access.") from None

    def lora_target_paths(self) -> list[str]:
        """Full module paths of the Linear layers that get LoRA (exact, so 'proj_out' never hits the final layer)."""
        wanted = self.model.default_lora_targets()
        if self.cfg.flow.lora_targets:
            wanted = {blocks: tuple(self.cfg.flow.lora_targets) for blocks in wanted}
        paths = []
        for name, module in self.transformer.named_modules():
            match = re.fullmatch(r"([a-z_]+)\.(\d+)\.(.+)", name)
            if match and isinstance(module, torch.nn.Linear) and match.group(3) in wanted.get(match.group(1), ()):
                paths.append(name)
        return self.model.lora_paths(paths)

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.transformer.parameters() if p.requires_grad], "lr": self.cfg.train.lr}]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return trained_weights.trainable_state(self.ctx, (("transformer", self.transformer),))

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        trained_weights.load_trainable_state(self.ctx, (("transformer", self.transformer),), state)

    # ---- text ---------------------------------------------------------------------------------------------
    def prepare_data(self) -> int:
        count = self.data.prepare()
        if text_cache.cache_text_embeddings(self.cfg, True, self.ctx.log_warning):
            self._cache_text()
        return count

    def _cache_text(self) -> None:
        cfg, ctx, model = self.cfg, self.ctx, self.model
        if self.data.control_paths is None:
            captions = self.data.captions()
        else:  # paired: each image's captions with its own control image
            captions = [model.text_key(caption, control) for caption, control in self.data.caption_controls()]
        captions += [t for prompt in trained_weights.sample_prompts(cfg.sample)
                     for t in model.texts_for(prompt, cfg.sample.negative_prompt)]
        key = {"family": self.name, "path": cfg.model.path, "revision": cfg.model.revision,
               "encoders": [te.config.to_dict() for te in self.text_encoders],
               "max_length": model.max_sequence_length(), "dtype": [str(te.dtype) for te in self.text_encoders],
               "stored": cfg.model.text_encoder_weights,
               "weights": self.encoders_fingerprint}
        folder = ctx.cache_dir / "text" / text_cache.text_cache_key(key, captions)

        with contextlib.ExitStack() as encoding:
            alone = [self.encode_alone]  # until the first captions to encode (a full disk cache needs none)

            def encode(batch: list[str]) -> dict[str, torch.Tensor]:
                if alone[0]:
                    alone[0] = False
                    encoding.enter_context(parked(self.transformer, ctx.device, self.swapped))
                    text_cache.onload(self.text_device or ctx.device, *self.text_encoders)
                rows = [model.encode_caption(caption) for caption in batch]
                return {k: torch.cat([row[k] for row in rows]) for k in rows[0]}

            self.text_cache = text_cache.build_text_cache(folder, captions, encode, rank=ctx.rank,
                                                          world_size=ctx.world_size,
                                                          barrier=ctx.accelerator.wait_for_everyone, device=ctx.device)
            text_cache.offload(*self.text_encoders)  # before the denoiser comes back

    @torch.no_grad()
    def _text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Batched text conditioning: from the disk cache, or (cache off) each caption encoded once per run, or
        at every step when shuffled tags make almost every caption new (kept, they would fill the memory)."""
        if self.text_cache is not None:
            return self.text_cache.stack(captions)
        if not self.data.cacheable:
            rows = [self.model.encode_caption(caption) for caption in captions]
            return {k: torch.cat([row[k] for row in rows]) for k in rows[0]}
        for caption in captions:
            if caption not in self.text_embeddings:
                self.text_embeddings[caption] = {k: v.detach() for k, v in self.model.encode_caption(caption).items()}
        return {k: torch.cat([self.text_embeddings[c][k] for c in captions]) for k in self.text_embeddings[captions[0]]}

    def cached(self, caption: str) -> dict[str, torch.Tensor]:
        """One caption's cached embeddings as the pipeline's own encoding would have produced them."""
        assert self.text_cache is not None, "only called when every prompt is in the cache"
        dtype = self.text_dtype
        return {k: on_device(v[None], self.ctx.device, dtype) for k, v in self.text_cache.get(caption).items()}

    # ---- loss ---------------------------------------------------------------------------------------------
    def static_shift(self) -> float:
        """`flow.shift`, else the scheduler's own shift."""
        return float(self.cfg.flow.shift) if self.cfg.flow.shift else float(self.scheduler_config.get("shift", 1.0))

    def scheduler_shift(self, latent_shape: tuple[int, ...]) -> float:
        """The shift the pipeline samples with: `flow.shift`, else the scheduler's static shift or, with its dynamic
        shifting on, exp(mu) of the packed 2x2 token count (the FLUX and Chroma pipelines' `calculate_shift`, with
        their defaults for missing scheduler keys)."""
        s = self.scheduler_config
        if self.cfg.flow.shift or not s.get("use_dynamic_shifting"):
            return self.static_shift()
        seq_len = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        return fm.resolution_shift(seq_len, base_seq_len=s.get("base_image_seq_len", 256),
                                   max_seq_len=s.get("max_image_seq_len", 4096), base_shift=s.get("base_shift", 0.5),
                                   max_shift=s.get("max_shift", 1.15))

    def loss(self, samples: list[Sample], transformer: torch.nn.Module) -> torch.Tensor:
        """Mean loss of a micro-batch through `transformer` (the wrapped one the loop accumulates on)."""
        return self.data.loss(samples, lambda rows, stream: self._rows_loss(rows, stream, transformer))

    @functools.cached_property
    def _input_dtype(self) -> torch.dtype:
        """The denoiser's input dtype, read once (the first step, after any wrapping): diffusers' `ModelMixin.dtype`
        walks every submodule, 1.5 ms of each micro-step on the demo's LoRA UNet (bench/README.md)."""
        return self.transformer.dtype

    def _rows_loss(self, rows: list[Row], stream: int, transformer: torch.nn.Module) -> torch.Tensor:
        cfg, flow, device = self.cfg, self.cfg.flow, self.ctx.device
        objective = Objective.from_config(cfg.train)
        dists, eps, noises, inputs, sigma_list = [], [], [], [], []
        for position, epoch, image_index, expanded_index, kind in rows:
            dists.append(self.data.latent_dist(image_index, epoch, expanded_index, kind))  # CPU, or device if encoded
            gen = torch_generator(position_seed(cfg.seed, position, stream))
            shape = tuple(dists[-1][0].shape)
            e, sigma, noise = fm.draw_sample(gen, shape, scheme=flow.timestep_sampling,
                                             logit_mean=flow.logit_mean, logit_std=flow.logit_std,
                                             shift=self.model.shift(shape), noise_offset=cfg.train.noise_offset)
            eps.append(e)
            noises.append(noise)
            inputs.append(objective.input_noise(gen, noise, training=kind != "val"))
            sigma_list.append(sigma)
        mean = torch.stack([on_device(m, device) for m, _ in dists])
        std = torch.stack([on_device(s, device) for _, s in dists])
        x0 = self.model.normalize_latents(mean + std * on_device(torch.stack(eps), device))
        noise = on_device(torch.stack(noises), device)
        sigmas = tensor_on(sigma_list, device, torch.float32)
        noisy, target = fm.noisy_and_target(x0, noise, sigmas, on_device(torch.stack(inputs), device))
        text = self._text([self.model.text_key(self.data.row_caption(row), self.data.row_control(row))
                           for row in rows])
        if self.data.control_paths is not None:  # paired training: the control images' latents condition too
            controls = [on_device(self.data.control_latent(image_index, epoch, expanded_index, kind), device)
                        for _, epoch, image_index, expanded_index, kind in rows]
            text = {**text, "control": self.model.normalize_latents(torch.stack(controls))}
        pred = self.model.forward(transformer, noisy.to(self._input_dtype), sigmas, text)
        return fm.per_sample_loss(pred, target, sigmas, flow.weighting, objective=objective,
                                  mask=self.data.loss_masks(rows, (x0.shape[-2], x0.shape[-1])))

    # ---- samples ------------------------------------------------------------------------------------------
    def _sampling_pipeline(self, from_cache: bool) -> Any:
        """The run's pipeline with the trained transformer (under FSDP: a plain model with the gathered weights);
        without its text encoders when the prompts come from the cache, so that nothing runs on the CPU copies
        and the pipeline's device is the transformer's."""
        components = {**self.pipe.components, "transformer": trained_weights.unwrapped(self.ctx, self.transformer)}
        if from_cache:
            components.update({name: None for name in self.model.text_encoder_names})
        # `components` leaves out a pipeline's optional settings: its plain registered values come back with it
        # (Flux2KleinPipeline's is_distilled, which turns its guidance off); module entries are left as they were
        _, optional = self.pipe._get_signature_keys(self.pipe)
        settings = {k: self.pipe.config[k] for k in optional
                    if isinstance(self.pipe.config.get(k), (bool, int, float, str))}
        pipe = self.pipeline_class(**components, **settings)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @torch.no_grad()
    def sample(self, prompts: list[str], seeds: list[int], *, size: int | tuple[int, int] | None = None, steps: int = 25,
               guidance_scale: float = 7.5, negative_prompt: str = ""):
        cache, model = self.text_cache, self.model
        from_cache = cache is not None and all(t in cache for p in prompts for t in model.texts_for(p, negative_prompt))
        if cache is not None and not from_cache and self.text_device != self.ctx.device:
            unseen = [p for p in prompts if any(t not in cache for t in model.texts_for(p, negative_prompt))]
            raise UserError(f"The prompts {unseen} are not in the text cache, and model.text_encoder_device: cpu "
                            "keeps the text encoders off the GPU: samples take the prompts of sample.prompts, which "
                            "the cache holds. Add the prompt there and resume, or set model.text_encoder_device=auto.")
        if cache is not None and not from_cache:  # a prompt the cache has not seen: the encoders come back
            text_cache.onload(self.ctx.device, *self.text_encoders)
        pipe = self._sampling_pipeline(from_cache)
        width, height = trained_weights.pixel_size(size, self.cfg.data.resolution)
        self.transformer.eval()
        images = []
        try:
            for prompt, run_seeds in trained_weights.prompt_runs(
                    prompts, seeds, width, height, trained_weights.PIXELS_PER_SAMPLE_CALL_DECODED_TOGETHER):
                gen = [torch.Generator(self.ctx.device).manual_seed(seed) for seed in run_seeds]
                n = len(gen)
                if from_cache:  # n copies: FLUX's and SD3's pipelines repeat only the embeddings they encode
                    text = {name: _repeated(embeds, n)
                            for name, embeds in model.embedded_prompt_kwargs(prompt, negative_prompt).items()}
                else:
                    text = {"prompt": prompt, "num_images_per_prompt": n, **model.sample_kwargs(negative_prompt)}
                # The plan's precision, not the transformer's dtype: a full fine-tune's fp32 transformer meets
                # the bf16 text encoders' embeddings here
                low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.ctx.plan.precision)
                # Samples show the trained LoRA as it will be used: without the training adapter
                with torch.autocast(self.ctx.device.type, dtype=low or torch.float32, enabled=low is not None), \
                        (self.adapter.off() if self.adapter is not None else contextlib.nullcontext()):
                    out = pipe(height=height, width=width, num_inference_steps=steps, generator=gen,
                               **model.guidance_kwargs(guidance_scale), **model.sample_image_kwargs(width, height),
                               **text)
                images.extend(out.images)
        finally:
            self.transformer.train()
            if cache is not None and not from_cache:
                text_cache.offload(*self.text_encoders)
        return images


def _repeated(embeds: Any, n: int) -> Any:
    """`n` copies of one prompt's embeddings: along the batch of a tensor, or of each item of a per-prompt list (a
    pipeline taking variable-length captions as a list, which a tensor's batch cannot hold)."""
    if isinstance(embeds, list):
        return [e for e in embeds for _ in range(n)]
    return embeds.repeat_interleave(n, dim=0)
