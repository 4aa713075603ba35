"""How the frozen networks are stored on the device: in the plan's precision, or as float8 / NF4 base weights
(`model.base_weights`) for LoRA runs. The families call this while loading; trainable weights stay fp32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from trainer.errors import UserError

if TYPE_CHECKING:
    from diffusers import ModelMixin

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def place_frozen_network(module: ModelMixin, base_weights: str, device: torch.device, dtype: torch.dtype,
                         fp8_compute: bool = False, held: Sequence[torch.nn.Module] = ()) -> None:
    """Move the network a LoRA run adapts (UNet / transformer, still frozen) to `device` in `dtype`, stored as
    `model.base_weights` says. Call it before adding LoRA (the adapter's layers then stay fp32) and never cast the
    module's dtype afterwards (that would dequantize NF4).

    - `bf16`: unquantized, as it is, in `dtype` (the plan's precision: bf16/fp16 on GPUs, fp32 on the CPU).
    - `fp8`: weights stored in float8 e4m3 and upcast to `dtype` layer by layer around each forward (diffusers'
      layerwise casting; norms and embeddings stay as they are). With `fp8_compute` (the plan's, from
      `model.fp8_compute`), the Linear layers that can (trainer.families.components.fp8_linear) instead keep a
      scaled e4m3 weight and multiply in fp8; the rest is stored as without it.
    - `int8`: the Linear weights in int8 with a scale per output row (torchao's weight-only int8), dequantized
      inside each matmul; kernels on CUDA and the CPU.
    - `nf4`: the Linear weights in 4-bit NormalFloat (QLoRA's format) as torchao's `NF4Tensor`, dequantized inside
      each matmul; the backward keeps the 4-bit weight, not a dequantized copy.

    Quantized where the model was loaded (the CPU) or layer by layer on the device, so the device never holds
    the whole network in full precision: FLUX's transformer is 24 GB in bf16, more than the cards fp8 and NF4
    are for.

    `held`: submodules (the blocks `model.block_swap` swaps, trainer.families.components.block_swap) stored the same
    way but left in CPU memory: they never reach the device whole."""
    if base_weights == "bf16":  # unquantized, in the plan's precision (`dtype`)
        module.to(device if not held else None, dtype=dtype)
        _to_device(module, device, held)
        return
    module.to(dtype=dtype)
    if base_weights == "fp8":
        from trainer.families.components.fp8_linear import Fp8Linear, require_fp8_matmul, swap_in_fp8_linears

        if fp8_compute:
            require_fp8_matmul(device)  # before anything is quantized: a build without the kernel fails here, clearly
            swap_in_fp8_linears(module, dtype, device, layerwise_casting_skips(module))
        # Convolutions stay as they are: under gradient checkpointing their recomputed forward saw the float8
        # weight (torch's CheckpointError), Linear layers do not. UNets keep their ResNet convolutions in the
        # plan's precision; transformers (FLUX, SD3) are nearly all Linear.
        module.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype,
                                        skip_modules_classes=(torch.nn.Conv2d, Fp8Linear))
        for layer in module.modules():
            if getattr(layer, "weight", None) is not None and layer.weight.dtype == torch.float8_e4m3fn:
                # peft gives the adapters it adds the dtype of their base layer, or its `compute_dtype`: without
                # this, a LoRA's initial weights were rounded to float8 before training made them fp32.
                layer.compute_dtype = dtype
    elif base_weights == "nf4":
        store_linear_weights_nf4(module, device, held)
    elif base_weights == "int8":
        store_linear_weights_int8(module, device, held)
    else:
        raise ValueError(f"unknown model.base_weights {base_weights!r}")
    _to_device(module, device, held)  # what was not quantized; stored weights keep their storage dtype


def store_text_encoder(module: torch.nn.Module, text_encoder_weights: str, dtype: torch.dtype) -> None:
    """`model.text_encoder_weights`: a frozen text encoder (a transformers model, in CPU memory in `dtype`) stored
    as the denoiser's base weights are, before it meets the GPU: its Linear layers (nearly all of a text encoder's
    weights; embeddings and norms kept) `fp8` through diffusers' layerwise casting hook, each upcast for its own
    forward, `nf4` and `int8` through torchao, quantized where it lies (so the GPU never holds it in full
    precision). `bf16`: as it is."""
    if text_encoder_weights == "bf16":
        return
    cpu = torch.device("cpu")
    if text_encoder_weights == "fp8":
        # Linear layers only: diffusers' apply_layerwise_casting on a transformers model also cast T5's RMSNorm
        # weight, which T5 multiplies with fp32 activations ("Promotion for Float8 Types is not supported")
        # weight, which T5 multiplies with fp32 activations ("Promotion for Float8 Types is not supported"). The
        # model's own `_keep_in_fp32_modules` (T5's `wo`, whose input it casts to that weight's dtype) stay as well.
        from diffusers.hooks.layerwise_casting import apply_layerwise_casting_hook

        keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
        for name, layer in module.named_modules():
            if isinstance(layer, torch.nn.Linear) and not layer.weight.requires_grad and not keep & set(name.split(".")):
                apply_layerwise_casting_hook(layer, torch.float8_e4m3fn, dtype, non_blocking=False)
    elif text_encoder_weights == "nf4":
        store_linear_weights_nf4(module, cpu)
    elif text_encoder_weights == "int8":
        store_linear_weights_int8(module, cpu)
    else:
        raise ValueError(f"unknown model.text_encoder_weights {text_encoder_weights!r}")


@contextlib.contextmanager
def parked(module: torch.nn.Module, device: torch.device, held: Sequence[torch.nn.Module] = ()) -> Iterator[None]:
    """`module`'s weights on the device (all but `held`, which stay where they are) moved to CPU memory for the
    duration, then back: the frozen text encoders then encode the captions alone on the GPU, instead of beside the
    denoiser (FLUX.2 dev's 45 GiB Mistral and its transformer never fit a 24 GB card together). Stored dtypes
    (float8, NF4) are kept. Only before the optimizer and DDP hold the parameters."""
    _to_device(module, torch.device("cpu"), held)
    try:
        yield
    finally:
        _to_device(module, device, held)


def _to_device(module: torch.nn.Module, device: torch.device, held: Sequence[torch.nn.Module]) -> None:
    """`module.to(device)` but for the modules inside `held`."""
    if not held:
        module.to(device)
        return
    stay = {id(m) for block in held for m in block.modules()}
    for sub in module.modules():
        if id(sub) not in stay:
            sub._apply(lambda t: t.to(device), recurse=False)


def layerwise_casting_skips(module: torch.nn.Module) -> tuple[str, ...]:
    """The module-path patterns diffusers' layerwise casting leaves in full precision for this model (norms,
    position and patch embeddings, its own list): the fp8 matmul keeps away from the same layers."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    own = [*(getattr(module, "_keep_in_fp32_modules", None) or ()),
           *(getattr(module, "_skip_layerwise_casting_patterns", None) or ())]
    return tuple(DEFAULT_SKIP_MODULES_PATTERN) + tuple(own)


NF4_BLOCK = 64  # weights per absmax scale, as in QLoRA and bitsandbytes


def nf4_scaler_block(numel: int) -> int | None:
    """torchao quantizes the per-block scales again in groups ("double quantization"): the group size must divide
    the number of blocks. 256 (QLoRA's) for real layers; a smaller power of two for the odd small layer (tiny
    test models). None: this weight cannot be stored as NF4 and stays as it is."""
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    return next((size for size in (256, 128, 64, 32, 16, 8, 4, 2) if blocks % size == 0), None)


def store_linear_weights_nf4(module: torch.nn.Module, device: torch.device,
                             held: Sequence[torch.nn.Module] = ()) -> int:
    """Replace every eligible frozen Linear weight of `module` by a 4-bit NF4Tensor on `device` (quantized there, one
    layer at a time; those inside `held` in CPU memory); returns how many. The NF4 tensor keeps its original dtype
    for dequantization (the plan's precision), so matmuls run as before."""
    try:
        from torchao.quantization import to_nf4
    except ImportError as err:  # missing, or built for another torch
        raise UserError("model.base_weights: nf4 needs torchao (PyTorch's quantization library), which could not "
                        f"be imported here ({err}). Install it with `pip install 'imagetune[nf4]'` (a torchao "
                        "release made for your torch version), or set model.base_weights=fp8 (8-bit, built in) or "
                        "bf16 (unquantized).") from None
    stored = 0
    stay = {id(m) for block in held for m in block.modules()}
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if not isinstance(layer, torch.nn.Linear) or weight is None or weight.requires_grad:
            continue
        scaler_block = nf4_scaler_block(weight.numel())
        if scaler_block is None or not weight.is_floating_point():
            continue
        where = torch.device("cpu") if id(layer) in stay else device
        quantized = to_nf4(weight.detach().to(where), NF4_BLOCK, scaler_block)
        layer.weight = torch.nn.Parameter(quantized, requires_grad=False)
        stored += 1
    return stored


def store_linear_weights_int8(module: torch.nn.Module, device: torch.device,
                              held: Sequence[torch.nn.Module] = ()) -> int:
    """Replace every frozen Linear weight of `module` by torchao's int8 weight-only tensor (a scale per output row),
    quantized on `device` one layer at a time (those inside `held` in CPU memory); returns how many. Matmuls
    dequantize in the plan's precision, on CUDA and the CPU alike; peft puts its LoRA beside it (TorchaoLoraLinear)."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as err:  # missing, or built for another torch
        raise UserError("model.base_weights: int8 needs torchao (PyTorch's quantization library), which could not "
                        f"be imported here ({err}). Install it with `pip install 'imagetune[nf4]'` (a torchao "
                        "release made for your torch version), or set model.base_weights=fp8 or bf16.") from None
    stay = {id(m) for block in held for m in block.modules()}
    layers = [layer for layer in module.modules() if isinstance(layer, torch.nn.Linear)
              and layer.weight is not None and not layer.weight.requires_grad and layer.weight.is_floating_point()]
    for layer in layers:
        layer.to(torch.device("cpu") if id(layer) in stay else device)
        quantize_(layer, Int8WeightOnlyConfig())
    return len(layers)


def frozen_dtype(precision: str, method: str) -> torch.dtype:
    """dtype of the frozen base weights: low precision saves memory for LoRA; trained weights stay fp32."""
    if method == "lora" and precision in ("bf16", "fp16"):
        return DTYPES[precision]
    return torch.float32
