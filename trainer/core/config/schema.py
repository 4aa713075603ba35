"""The typed config schema: the single source of truth for preset keys.

Presets are sparse YAML overlays on these defaults. Every field's `help` is its documentation (the UI shows
it next to the field; `docs/` is generated from it). `choices` lists the accepted values of a string field.
Derived quantities (accumulation, precision on this machine...) live in `trainer.core.plan`, not here.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Optional, Union

from trainer.core.config.data import DataConfig
from trainer.core.config.fields import key
# The sections only some families read; Config below holds one field per such section.
from trainer.core.config.sections.detection import DetectionConfig
from trainer.core.config.sections.flow import FlowConfig
from trainer.core.registry import SPECS

SCHEMA_VERSION = 1


@dataclass
class ModelConfig:
    # The two helps below list the registered families' data, so they are read when shown (fields.help_of): the
    # registry is filled after this module is imported.
    family: str = key(
        "sd", lambda: "Model family: " + ", ".join(f"`{spec.name}` ({spec.title})" for spec in SPECS.values()) + ".")
    path: str = key(
        "",
        lambda: "The base model: a local diffusers folder, a single-file `.safetensors`/`.ckpt` checkpoint, a hub id "
        "(`stable-diffusion-v1-5/stable-diffusion-v1-5`, needs network), or `demo://tiny-sd` for the offline demo."
        + "".join(f" {spec.path_help}" for spec in SPECS.values() if spec.path_help),
    )
    config: Optional[str] = key(
        None,
        "For a single-file checkpoint: a diffusers folder or hub id with the matching component configs "
        "(tokenizer, scheduler...). Needed offline; online diffusers infers it.",
    )
    prediction_type: str = key(
        "auto",
        "What the UNet predicts: `auto` reads the model's scheduler config; `epsilon` (SD 1.x, SD 2.x-base) or "
        "`v_prediction` (SD 2.x 768).",
        choices=("auto", "epsilon", "v_prediction"),
    )
    revision: Optional[str] = key(None, "Hub revision (branch, tag or commit) of a hub model.")
    variant: Optional[str] = key(None, "Hub weight variant, e.g. `fp16`.")
    base_weights: str = key(
        "bf16",
        "How a LoRA run stores the frozen network it adapts (UNet / transformer): `bf16` (unquantized, in the plan's "
        "precision: bf16 or fp16 on GPUs, fp32 on the CPU; `default`, its name before, is read as bf16); `fp8` (float8 e4m3: half the memory of bf16, FLUX's transformer "
        "12 GB instead of 24; each layer is upcast to the plan's precision for its own forward by diffusers' "
        "layerwise casting; needs train.gradient_checkpointing, without it every upcast weight is kept for the "
        "backward pass and nothing is saved; on GPUs with fp8 tensor cores model.fp8_compute multiplies in fp8 "
        "instead, which saves time too); or `nf4` (4-bit NormalFloat, QLoRA's format, through torchao: about "
        "a quarter of bf16's memory for the Linear layers, FLUX's transformer near 7 GB; dequantized inside each "
        "matmul, slower than fp8; `pip install 'imagetune[nf4]'`); or `int8` (torchao's weight-only int8, a scale "
        "per output row: as small as fp8, rounded to a finer grid per row, dequantized inside each matmul; needs no "
        "checkpointing; the same torchao extra). Each rounds the frozen weights a little; the LoRA itself always "
        "trains in fp32. All four run on the CPU as well (the upcast and the dequantization are plain torch ops), "
        "for every diffusion family.",
        choices=("bf16", "fp8", "nf4", "int8"),
    )
    text_encoder_weights: str = key(
        "bf16",
        "How the frozen text encoders are stored while they encode the captions (the text cache, or every step "
        "without it): `bf16` (unquantized, in the plan's precision); `fp8`, `int8` or `nf4` as model.base_weights "
        "stores the denoiser (the same component, quantized in CPU memory before they reach the GPU), which lets a "
        "big encoder fill the cache on a small card: FLUX.2 dev's Mistral Small 3 (44.7 GiB in bf16) in about 12 "
        "GiB as nf4, Qwen-Image's Qwen2.5-VL 7B (15.4 GiB) in about 8 (musubi-tuner's --fp8_vl / --fp8_text_encoder "
        "and ai-toolkit's quantize_te do the same). Each rounds the caption embeddings a little (tests bound it); "
        "the plan counts the encoders' load peak in this storage. The flow-matching families only.",
        choices=("bf16", "fp8", "nf4", "int8"),
    )
    text_encoder_device: str = key(
        "auto",
        "Where the frozen text encoders encode the captions into the text cache: `auto`, the run's device (the GPU); "
        "`cpu`, in CPU memory, for an encoder that does not fit the card even quantized (FLUX.2 dev's Mistral Small "
        "3 on a 12 GB card): slow (minutes per hundred captions for a 24B encoder), once, and needs the text cache "
        "(data.cache_text_embeddings not false, no data.shuffle_tags); the GPU never holds the encoders. With "
        "model.text_encoder_weights int8 the CPU keeps them in a quarter of the memory of fp32 and multiplies with "
        "its int8 kernels. The flow-matching families only.",
        choices=("auto", "cpu"),
    )
    fp8_compute: str = key(
        "off",
        "With model.base_weights=fp8: whether the frozen Linear layers also multiply in fp8 (kohya/musubi's "
        "`--fp8_scaled` with `--fp8_fast`; torchao's float8 rowwise recipe, for frozen weights), which saves time as "
        "well as memory: `auto` (where the GPUs have fp8 tensor cores, compute capability 8.9+: RTX 40xx/50xx, "
        "L4, L40, H100, H200, B200; elsewhere, and on the CPU, storage only as `fp8` describes, with a note in the "
        "plan; a torch build without the fp8 kernel for such a GPU stops the run at its start, saying so), `on` "
        "(always: refused on older GPUs; on the CPU it runs torch's reference fp8 matmul, slower than "
        "fp32, for tests) or `off` (storage only). The plan line says `· fp8 matmul` when it is used. Each such layer "
        "keeps its weight in float8 e4m3 with a power-of-two scale per output row, quantizes its input per row as "
        "it arrives and multiplies with torch._scaled_mm (bf16 out); the backward gives the input's gradient, the "
        "one the LoRA layers upstream need, through an fp8 matmul too, and nothing is upcast, so "
        "train.gradient_checkpointing is not needed for the memory. Layers with a dimension that is not a "
        "multiple of 16, norms, embeddings and convolutions stay as `fp8` stores them; the LoRA stays fp32. It "
        "rounds the activations to 8 bits as well as the weights: a matmul is off by about 3.5% (relative; bf16's "
        "0.3%); over 40 LoRA steps of the demo's pretrained tiny SD the loss stays 0.8% from bf16's on average "
        "(storage-only fp8 0.55%, fp32 0.3%), and the demo learns its concept as in bf16 (bench/README.md, "
        "`python bench/fp8_loss.py`). Off by default until its speed and its CUDA kernel path are measured on a "
        "GPU (`python bench/gpu_large.py --base-weights fp8-compute`): so far it has run on the CPU only.",
        choices=("auto", "on", "off"),
    )
    block_swap: Union[int, str] = key(
        0,
        "One GPU too small for the model: how many of the transformer's repeated blocks (the last ones) keep their "
        "weights in CPU memory, each copied to the GPU for its call while the previous block computes (`auto`: the "
        "fewest that fit the plan's memory estimate; 0: none). LoRA: their frozen weights; a full fine-tune: their "
        "fp32 weights, gradients and optimizer state too, stepped on the CPU. Slower by the copies that compute does "
        "not hide; needs train.gradient_checkpointing and DDP (not FSDP/DeepSpeed); the flow-matching families only "
        "(bench/block_swap.md).",
    )
    zero_terminal_snr: bool = key(
        False,
        "SD and SDXL: rescale the noise schedule so that its last timestep is pure noise (zero terminal SNR, Lin et "
        "al. 2023; kohya's `zero_terminal_snr`, diffusers' `rescale_betas_zero_snr`): the model learns to start "
        "from pure noise, which lets it draw very dark and very bright images. Training, samples and a full "
        "fine-tune's saved scheduler all use the rescaled schedule with `trailing` timestep spacing. Needs "
        "v-prediction (an epsilon model only copies pure noise): a v-prediction model, or model.prediction_type="
        "v_prediction to train one into it. SD3 and FLUX refuse it: flow matching already ends at pure noise.",
    )


@dataclass
class LoraConfig:
    rank: int = key(16, "LoRA rank (the inner dimension). 4-32 is usual for a subject or a style.")
    alpha: float = key(16.0, "LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = key(0.0, "Dropout on the LoRA branch (0 to 1).")
    unet_targets: list[str] = key(
        ["to_k", "to_q", "to_v", "to_out.0"], "UNet module names that get LoRA layers (attention projections)."
    )
    train_text_encoder: bool = key(False, "Also train LoRA layers on the text encoder.")
    text_encoder_targets: list[str] = key(
        ["q_proj", "k_proj", "v_proj", "out_proj"], "Text-encoder module names that get LoRA layers."
    )
    type: str = key(
        "lora",
        "The adapter: `lora` (low-rank update up @ down, scaled by alpha / rank), `lokr` (LyCORIS LoKr: the "
        "Kronecker product of a small full matrix and a second factor, itself low-rank (rank `lora.rank`) when "
        "the rank is under half its size, full otherwise; `lora.factor` sets the split) or `loha` (LyCORIS LoHa: "
        "the elementwise product of two rank-`lora.rank` updates). Trained with peft's implementations in every "
        "diffusion family; the outputs are a peft folder per adapted model (`output/peft/<model>/`, "
        "`PeftModel.from_pretrained`) and the kohya/ComfyUI file (`lokr_w1`, `lokr_w2[_a/_b]` / `hada_w1_a`... "
        "keys, which ComfyUI, Forge and A1111 load). As in LyCORIS, alpha / rank scales a LoKr only where a factor "
        "is low-rank: with both factors full (a large rank, e.g. LyCORIS' habit of rank 10000 with factor 8) it "
        "is unscaled. `lora.dropout` is LoRA's and must stay 0 for LoKr and LoHa.",
        choices=("lora", "lokr", "loha"),
    )
    factor: int = key(
        -1,
        "LoKr: how each side of a weight is split into the Kronecker factors (LyCORIS' `factor`): a side n "
        "becomes (factor, n / factor) where factor divides n, else the two divisors nearest its square root; -1 "
        "always takes those nearest the square root (the smallest files). 4-16 are usual. Only with "
        "lora.type=lokr.",
    )
    dora: bool = key(
        False,
        "DoRA (weight-decomposed LoRA, peft's): each adapted weight becomes m * (W + alpha / rank * up @ down) / "
        "||W + ...||, with a trained magnitude m per output row. Only with lora.type=lora; a little slower than "
        "LoRA. Outputs: the diffusers file (`lora_magnitude_vector`, loaded by `pipe.load_lora_weights`) and the "
        "kohya/ComfyUI file with `dora_scale` per module, output-row shaped (LyCORIS' `wd_on_out`) and written for "
        "ComfyUI's formula, which divides by the norm of the base weight W: the file reproduces the trained "
        "weights on the base model it was trained on, in ComfyUI and Forge. A1111 reads input-axis DoRA only. Not "
        "with lora.train_text_encoder (diffusers' loader drops a text encoder's DoRA magnitudes) nor with "
        "model.base_weights fp8/nf4 (its norms need the full-precision weights).",
    )
    init_from: str = key(
        "",
        "Start the adapter from an existing LoRA file instead of zero: a kohya/A1111/ComfyUI `.safetensors` or a "
        "diffusers `pytorch_lora_weights.safetensors` (or a folder holding one), of this family's base model, "
        "read by diffusers' own loader (kohya `lora_unet_`/`lora_te_` keys, FLUX's BFL names, diffusers and peft "
        "keys). Each module the file adapts must be one this run adapts, with the same rank; its alpha is "
        "honoured (folded into the up weights), so training starts from exactly the file's update. Modules the "
        "file lacks start at zero. With lora.dora: the file's magnitudes if it is a diffusers DoRA, else "
        "magnitudes that keep the file's update. Not for lora.type lokr or loha. Only read at the start: a resume "
        "continues from its checkpoint.",
    )
    ema: bool = key(
        False,
        "Keep an exponential moving average of the adapter weights (as `full.ema` does for a full fine-tune). "
        "Samples, evaluations (val_loss, checkpoints/best/) and the output files use the averaged weights; "
        "training continues on the live ones, and checkpoints keep both, so a resume is exact.",
    )
    ema_decay: float = key(
        0.999,
        "LoRA EMA decay per optimizer step (0 to 1), as diffusers' EMAModel applies it: at its n-th update the "
        "average moves by 1 - d towards the live weights, d = min(ema_decay, n / (n + 9)) (d = 0 at the first: the "
        "average starts as the live weights, and the warm-up keeps it from lagging behind the early steps for "
        "long). 0.999 averages over about the last thousand steps; lower it for short runs (0.99: a hundred).",
    )


@dataclass
class FullConfig:
    train_text_encoder: bool = key(False, "Full fine-tune: also train the text encoder.")
    ema: bool = key(False, "Keep an exponential moving average of the trained weights: samples, evaluations and the "
                           "output use it; training continues on the live weights.")
    ema_decay: float = key(0.9999, "EMA decay per optimizer step (0 to 1).")
    save_single_file: bool = key(True, "Also write the result as one `.safetensors` file for A1111 / ComfyUI.")


@dataclass
class PriorConfig:
    enabled: bool = key(False, "DreamBooth prior preservation: also train on class images with the class prompt.")
    class_path: str = key("", "Folder of class images; missing ones are generated with the base model.")
    class_prompt: str = key("", "Prompt of the class images, e.g. `a photo of a dog`.")
    num_class_images: int = key(100, "How many class images to have; generated when the folder holds fewer.")
    loss_weight: float = key(1.0, "Weight of the prior-preservation loss.")
    sample_steps: int = key(25, "Inference steps used to generate class images.")


@dataclass
class BatchConfig:
    total: int = key(
        4,
        "Effective batch per optimizer step, on any number of devices. "
        "accumulation = total / (per_device x processes). Detection: Faster R-CNN's losses accumulate exactly "
        "(equal-size images, frozen BatchNorm), so accumulation trains like one big batch; FCOS and RetinaNet "
        "normalise each micro-batch by its own foreground count (close to, not exactly, a big batch); trainable "
        "BatchNorm (random-init backbones, SSDlite, the v2 Faster R-CNN box head) never accumulates: its "
        "statistics come from each micro-batch of per_device images.",
    )
    per_device: Union[int, str] = key(
        1, "Micro-batch on each process, or `auto`: on GPUs the workers run the real training step at growing "
        "micro-batches (the divisors of their share of batch.total) before training and keep the largest that fits, "
        "the same on every rank; 1 on the CPU and under fsdp or deepspeed. The samples of each step do not depend "
        "on it."
    )


@dataclass
class TrainConfig:
    steps: int = key(1000, "Optimizer steps to train (not micro-steps; independent of the number of devices).")
    lr: float = key(1e-4, "Learning rate (peak, after warmup).")
    text_encoder_lr: Optional[float] = key(None, "Learning rate of the text encoder; defaults to `train.lr`.")
    optimizer: str = key(
        "adamw",
        "`adamw` (PyTorch's fused CUDA kernel where every trained tensor is a plain CUDA tensor, its foreach "
        "implementation elsewhere: FSDP's shards, the CPU; `sgd` likewise; the run's log names it), `adamw8bit` (bitsandbytes, CUDA only: a quarter of "
        "AdamW's state memory), `sgd` (momentum 0.9), `prodigy` (Prodigy, `prodigyopt`: estimates the step size "
        "itself, so train.lr is a multiplier and 1.0 is its norm; `pip install 'imagetune[optimizers]'`), "
        "`adafactor` (factored second moments: a fraction of AdamW's state, the memory path for single-GPU full "
        "fine-tunes; relative step off, so train.lr is the step size, 1e-5 to 1e-4 usual) or "
        "`adamw_schedulefree` (schedule-free AdamW, `schedulefree`: no decay schedule, train.scheduler must stay "
        "constant and train.warmup_steps is its own warmup; samples, evaluations, checkpoints and outputs use its "
        "averaged weights).",
        choices=("adamw", "adamw8bit", "sgd", "prodigy", "adafactor", "adamw_schedulefree"),
    )
    weight_decay: Optional[float] = key(
        None,
        "Weight decay. Unset: the optimizer's usual value: 1e-2 for AdamW (decoupled; also adamw8bit's, Prodigy's, "
        "Adafactor's and schedule-free AdamW's), 1e-4 for `sgd` (an L2 term added to the gradient, which momentum "
        "amplifies; torchvision's detection and classification recipes use 1e-4).",
    )
    betas: list[float] = key([0.9, 0.999], "AdamW betas (also Prodigy's and schedule-free AdamW's).")
    eps: float = key(1e-8, "AdamW epsilon.")
    scheduler: str = key(
        "constant",
        "Learning-rate schedule over optimizer steps.",
        choices=("constant", "linear", "cosine", "cosine_with_restarts", "polynomial"),
    )
    scheduler_cycles: int = key(
        1, "cosine_with_restarts: how many cosine cycles (restarts to the peak rate) fit in train.steps.")
    scheduler_power: float = key(
        1.0, "polynomial: the decay's power (1.0 is linear decay to zero, 2.0 quadratic).")
    warmup_steps: int = key(0, "Linear warmup, in optimizer steps.")
    max_grad_norm: Optional[float] = key(
        None, "Clip the gradient norm to this; 0 disables clipping. Unset: the optimizer's usual value: 1.0 for the "
        "AdamW-like optimizers (diffusers' and kohya's scripts), none for `sgd` (torchvision's recipes do not clip: "
        "SGD's step is proportional to the gradient, so a cap below its norm is a lower learning rate; a from-scratch "
        "Faster R-CNN's norm is 2-8, and clipping at 1 halved its mAP in 304 steps: bench/README.md).")
    noise_offset: float = key(
        0.0, "Noise offset: a random per-channel shift of each sample's noise (0.05-0.1 helps very dark or bright "
        "images), in every diffusion family (for SD3/FLUX the velocity target carries it); 0 disables it.")
    min_snr_gamma: Optional[float] = key(
        None, "Min-SNR loss weighting gamma (5 is usual) for the UNet families (SD, SDXL); unset disables it. "
        "SD3 and FLUX refuse it: their loss weighting is `flow.weighting`.")
    loss: str = key(
        "mse",
        "The error between prediction and target, per latent element: `mse` (squared), `huber` (squared up to "
        "train.huber_delta, linear beyond: 2 delta |e| - delta^2, so it equals mse on small errors and outliers "
        "pull less; kohya's `loss_type=huber` with a constant `huber_c`) or `l1` (absolute). Every diffusion "
        "family; weighted afterwards as before (Min-SNR, flow.weighting, data.masks).",
        choices=("mse", "huber", "l1"),
    )
    huber_delta: float = key(
        0.1, "train.loss=huber: where the loss turns from squared to linear (kohya's and diffusers' `huber_c`, 0.1).")
    input_perturbation: float = key(
        0.0, "Input perturbation (Ning et al. 2023; diffusers' `--input_perturbation`, 0.1 usual): the model's noisy "
        "input is made with the noise plus this much extra noise while the target keeps the noise, which reduces "
        "the exposure bias of sampling. Every diffusion family; the validation loss is measured without it; 0 "
        "disables it.")
    gradient_checkpointing: bool = key(False, "Trade compute for memory: recompute activations in backward.")
    channels_last: str = key(
        "auto",
        "Store the UNet (SD, SDXL) and VAE of a LoRA run in channels-last memory format (NHWC), which cuDNN's "
        "convolution kernels on tensor cores prefer: `auto` (on for LoRA runs of the UNet families on CUDA), `on` "
        "(also on the CPU), `off`. Same results within float rounding (convolution kernels differ); the LoRA and "
        "its files are unchanged. A full fine-tune keeps the standard layout (its saved weights must be "
        "contiguous), and the transformer families (SD3, FLUX) have almost no convolutions: both refuse `on`.",
        choices=("auto", "on", "off"),
    )
    compile: bool = key(
        False,
        "Regional compilation: torch.compile (inductor) of the trained network's repeated blocks, in place, after the "
        "adapters are added so that the LoRA / LoKr / LoHa layers are compiled with them: the blocks diffusers lists "
        "for `compile_repeated_blocks` (the UNet's transformer blocks for SD and SDXL, FLUX's double and single "
        "blocks) and SD3's joint blocks. Shapes are static: the blocks compile once per input shape (each "
        "aspect-ratio bucket, and without gradients the samples' and the validation loss's shapes; the plan's notes "
        "list them); a `warning` event gives each compile's time, and a step that compiles is left out of "
        "samples/s. Trains the weights eager training does (within float32 rounding), with DDP, gradient "
        "checkpointing, model.base_weights nf4, and on the CPU (needs g++ there; Triton needs gcc on GPUs). "
        "Costs: compiling, the first time about a minute for the demo's tiny UNet on 2 CPU cores, seconds once "
        "inductor's on-disk cache holds the graphs. Measured gain: none reliable on the CPU for the demo; on GPUs "
        "not measured (bench/engine_overhead.py --compile measures both). Not for detection (its shapes change "
        "with every batch), model.base_weights fp8, or distributed.sharding fsdp / deepspeed.",
    )
    max_nonfinite_steps: int = key(
        5, "Skip steps with a NaN/inf loss; after this many in a row the run fails (keeping its last checkpoint)."
    )

    def decay(self) -> float:
        """train.weight_decay, or the optimizer's usual value when unset. Why SGD has its own: its decay is an L2
        term in the gradient, which momentum 0.9 multiplies by ~10, so AdamW's decoupled 1e-2 would be 100x the
        SGD recipes' 1e-4 (torchvision's detection and classification references); it cost a from-scratch Faster
        R-CNN most of its mAP against torchvision's train.py (bench/README.md, detection parity)."""
        if self.weight_decay is not None:
            return self.weight_decay
        return 1e-4 if self.optimizer == "sgd" else 1e-2

    def clip_norm(self) -> float:
        """train.max_grad_norm, or the optimizer's usual value when unset (0: no clipping). Why none for SGD: see
        the key's help; clipping at 1 acted as a lower learning rate for SGD and halved a detector's mAP."""
        if self.max_grad_norm is not None:
            return self.max_grad_norm
        return 0.0 if self.optimizer == "sgd" else 1.0


@dataclass
class ScoredPrompt:
    prompt: str = key("", "A prompt drawn at every sample step (after `sample.prompts`) and scored.")
    shows: str = key(
        "", "What its samples must show, in the words of the shapes judge (trainer/families/components/"
        "shape_score.py), which reads the offline demo's world only: a colour and/or a shape, e.g. `yellow circle`.")


@dataclass
class SampleConfig:
    every: int = key(0, "Render samples every N optimizer steps (0: only at the start and the end).")
    prompts: list[str] = key([], "Prompts to render; one PNG per prompt each time.")
    images_per_prompt: int = key(
        1, "Images drawn per prompt at each sample step, side by side in its PNG (image j of prompt i uses seed "
        "sample.seed + i * images_per_prompt + j); several make a score more than one coin flip.")
    concept: ScoredPrompt = field(default_factory=ScoredPrompt)
    """The concept score: each sample step's `eval` event carries `concept`, the fraction of this prompt's
    images that show `shows` (the demo: 0 before its LoRA has learnt the concept, near 1 after)."""
    control: ScoredPrompt = field(default_factory=ScoredPrompt)
    """The control score (`control` in `eval` events): a prompt the base model already draws, which must keep
    drawing it (no collapse onto the concept)."""
    negative_prompt: str = key("", "Negative prompt for every sample.")
    seed: int = key(0, "Seed of the first prompt's noise (prompt i uses seed + i), fixed across the run.")
    steps: int = key(25, "Inference steps per sample.")
    guidance_scale: float = key(7.5, "Classifier-free guidance scale.")
    size: Optional[int] = key(None, "Square sample size in pixels (`sample.width`/`height` for other shapes).")
    width: Optional[int] = key(
        None, "Sample width in pixels. Unset: `sample.size`, else the most common aspect-ratio bucket's width in a "
        "bucketed run, else `data.resolution`.")
    height: Optional[int] = key(None, "Sample height in pixels; unset as for `sample.width`.")


@dataclass
class EvalConfig:
    every: int = key(0, "Evaluate every N optimizer steps, for runs with metrics (detection: mAP; diffusion families "
                        "with `data.val_split` or `data.val_path`: `val_loss`); 0: only at the end.")
    best: str = key(
        "auto",
        "What keeps `checkpoints/best/` (the trained weights of the best evaluation so far): `auto` (detection: "
        "`detection.best_metric`, higher is better; diffusion families with held-out images: `val_loss`, lower "
        "is better), `val_loss`, or `none` (no best checkpoint: for a full fine-tune it is a second copy of the "
        "model).",
        choices=("auto", "val_loss", "none"),
    )


@dataclass
class CheckpointConfig:
    every: int = key(500, "Save a checkpoint every N optimizer steps (0: only when stopping).")
    keep: int = key(2, "How many checkpoints to keep (the oldest are deleted).")
    export: bool = key(
        False, "Also write the outputs (the files a finished run writes: LoRA, full model, detector) of every "
        "checkpoint into output/step-NNNNNN/, so a LoRA can be downloaded mid-run and a stopped run has one. "
        "Any checkpoint can be exported later too: python launch.py --export RUN --step N.")


@dataclass
class HardwareConfig:
    gpu_memory_gb: float = key(
        0.0,
        "The GPU memory (GB as the card is sold, i.e. GiB: 24 for an RTX 4090) this preset is written for. The "
        "plan estimates the step's peak memory per GPU (trainer/core/memory.py) against the smallest visible GPU, "
        "or against this where none is visible (`--dry-run` on a laptop or in CI), and model.block_swap auto "
        "sizes itself for it; 0: no estimate without a GPU.",
    )
    gpus: int = key(
        0,
        "How many of those GPUs (per node) the preset is written for: 8 for a full fine-tune sharded across an "
        "8-GPU node. Where they are not visible (`--dry-run` in CI or on a laptop), the plan's memory estimate is "
        "made for them: the sharding distributed.sharding auto would choose there and the memory per GPU. A run "
        "on real GPUs plans for the ones it finds; 0: one GPU.",
    )


@dataclass
class DistributedConfig:
    nodes: int = key(1, "Machines in the run (multi-node through torchrun's static rendezvous: node 0 is rank 0).")
    node_rank: int = key(0, "This machine's index, 0 .. nodes-1 (node 0 writes the run folder).")
    master_addr: str = key("127.0.0.1", "Address of node 0, reachable from every node.")
    master_port: int = key(29500, "Rendezvous port on node 0 (multi-node only; single-node picks a free one).")
    timeout_s: int = key(1800, "Seconds a collective may wait before the run fails naming what it waited for.")
    stall_warning_s: Optional[float] = key(
        None, "Seconds without an optimizer step after which a `warning` event names the silent ranks: the ones "
        "whose process froze (no heartbeat) and the ones waiting for them. Unset: 20 times the measured step time, "
        "at least 60. Time spent drawing samples, evaluating or checkpointing does not count.")
    stall_timeout_s: float = key(
        900, "Seconds without an optimizer step after which the launcher ends the run `failed`, naming the silent "
        "ranks and the last checkpoint to resume from (well before distributed.timeout_s would); 0: never.")
    sharding: str = key(
        "auto",
        "How the processes share a full fine-tune: `ddp` (every GPU holds the whole model, gradients averaged), "
        "`fsdp` (PyTorch FSDP2: weights, gradients and optimizer state sharded across the processes, for models "
        "that do not fit on one GPU; samples and checkpoints gather the full weights), or `auto` (fsdp when a "
        "full fine-tune's weights + gradients + AdamW state would not fit in 80% of one GPU's memory and there are "
        "several GPUs; ddp otherwise, and always for LoRA), or `deepspeed` (DeepSpeed ZeRO through accelerate: "
        "optimizer state (stage 1) and gradients (stage 2) partitioned across the processes, weights replicated; "
        "one trained network, precision bf16 or fp32, adamw or sgd; `pip install 'imagetune[deepspeed]'`).",
        choices=("auto", "ddp", "fsdp", "deepspeed"),
    )
    zero_stage: int = key(
        2,
        "DeepSpeed ZeRO stage with sharding=deepspeed: 1 partitions the optimizer state, 2 also the gradients. "
        "(Stage 3, sharded weights, is what sharding=fsdp does.)",
    )


@dataclass
class LoggingConfig:
    tensorboard: bool = key(
        False, "Also write the run's loss, learning rate, every eval metric, the samples (as images), the plan and "
        "the config (as text) to `runs/<name>/tensorboard/` (`tensorboard --logdir runs`); a resume continues the "
        "same TensorBoard run. `pip install 'imagetune[tensorboard]'`.")
    wandb: Optional[str] = key(
        None, "Also log the same to Weights & Biases, in this project (`project` or `entity/project`); the API key "
        "comes from `WANDB_API_KEY` or `wandb login`, `WANDB_MODE=offline` logs without network. A resume continues "
        "the same W&B run (its id is kept in `runs/<name>/wandb-run-id`). `pip install 'imagetune[wandb]'`.")


@dataclass
class OutputConfig:
    push_to_hub: Optional[str] = key(
        None, "When the run is done, upload its outputs to this Hugging Face Hub model repo (`user/name` or "
        "`org/name`; created private if it does not exist) with a generated model card (base model and its licence, "
        "trigger words, family, method, settings, the last samples). The token comes from `HF_TOKEN` (or `hf auth "
        "login`) and is never written to the run folder; `HF_ENDPOINT` selects another Hub. A failed upload is a "
        "`warning`: the run stays done and its files stay in output/.")


@dataclass
class Config:
    version: int = key(SCHEMA_VERSION, "Schema version of this preset (old versions are migrated on load).")
    name: str = key("run", "Run name; the run folder is `runs/<name>` (a number is appended if it exists).")
    method: str = key("lora", "`lora` (small adapter file) or `full` (DreamBooth full fine-tune).", choices=("lora", "full"))
    seed: int = key(0, "Seed of everything: initialisation, data order, noise, augmentation.")
    devices: Any = key(
        "auto",
        "`auto` (every visible GPU, else CPU), a GPU count (2), a list of GPU ids ([0, 2]) or `cpu:N` "
        "(N CPU processes on gloo).",
    )
    precision: str = key(
        "auto",
        "`auto` (bf16 where the GPU has it, else fp16 with loss scaling; fp32 on CPU), `bf16`, `fp16`, `fp32`.",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    attention: str = key(
        "auto", "`auto` (xformers if installed on CUDA, else PyTorch SDPA), `sdpa`, `xformers`.",
        choices=("auto", "sdpa", "xformers"),
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    full: FullConfig = field(default_factory=FullConfig)
    prior: PriorConfig = field(default_factory=PriorConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def iter_keys(cls=Config, prefix: str = ""):
    """Yield (dotted key, dataclass field) for every leaf key of the schema, in declaration order."""
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            sub = f.default_factory
            yield from iter_keys(sub, name + ".")
        else:
            yield name, f
