"""A frozen "training adapter" (`flow.training_adapter`): a LoRA that acts on the frozen transformer while a new LoRA
trains and is off when sampling, so the trained LoRA learns only what the data adds and is used without it.

This is ai-toolkit's answer to step-distilled models (Z-Image Turbo, FLUX.1 schnell): a de-distillation LoRA
(e.g. ostris/zimage_turbo_training_adapter) is merged into the base weights for training and removed (multiplier
-1) for samples and for use (extensions_built_in/diffusion_models/z_image/z_image.py:84-165). Here it is not merged
but added to each adapted layer's output by a forward hook, `y + scale * B(A(x))`: the same function as the merged
weight, without writing into the frozen weights (exact when switched off, whatever their storage: bf16, fp8, NF4),
and nothing of it is trained or saved.

The file: diffusers/peft names (`<path>.lora_A.weight` / `lora_B`), kohya's (`lora_down` / `lora_up`), under a
`diffusion_model.` or `transformer.` prefix as ai-toolkit and ComfyUI write them, with an optional `<path>.alpha`
(else alpha = rank, ai-toolkit's adapters).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from trainer.errors import UserError

PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.")
PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora_down.weight", ".lora_up.weight"))


def read_adapter(source: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors: a local .safetensors file, or `owner/repo/file.safetensors` on the Hugging Face hub."""
    from safetensors.torch import load_file

    path = Path(source).expanduser()
    if not path.exists():
        parts = source.split("/")
        if len(parts) != 3:
            raise UserError(f"flow.training_adapter: '{source}' is neither a file nor owner/repo/file on the hub")
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(repo_id="/".join(parts[:2]), filename=parts[2]))
    return load_file(str(path))


def adapter_layers(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{module path: (A (rank, in), B (out, rank), scale alpha / rank)} of a LoRA state dict."""
    def strip(key: str) -> str:
        for prefix in PREFIXES:
            key = key.removeprefix(prefix)
        return key

    state = {strip(k): v for k, v in state.items()}
    layers = {}
    for key in state:
        for down, up in PAIRS:
            if key.endswith(down):
                path = key[:-len(down)]
                a, b = state[key].float(), state[path + up].float()
                alpha = float(state[path + ".alpha"]) if path + ".alpha" in state else float(a.shape[0])
                layers[path] = (a, b, alpha / a.shape[0])
    if not layers:
        raise UserError("flow.training_adapter: the file holds no LoRA layer (no lora_A/lora_B or "
                        "lora_down/lora_up weights)")
    return layers


class TrainingAdapter:
    """The adapter's layers hooked onto `transformer` (before LoRA wraps them: the hooks stay on the base layers
    peft keeps inside its wrappers); `off()` switches them off for sampling."""

    def __init__(self, transformer: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device):
        self.active = True
        modules = dict(transformer.named_modules())
        unknown = sorted(p for p in adapter_layers(state) if p not in modules)
        if unknown:
            raise UserError(f"flow.training_adapter: {len(unknown)} of its layers are not in this transformer "
                            f"(first: {unknown[0]}): an adapter for another model?")
        self.handles = []
        for path, (a, b, scale) in adapter_layers(state).items():
            self.handles.append(modules[path].register_forward_hook(self._hook(a.to(device), b.to(device), scale)))

    def _hook(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        def hook(module, inputs, output):
            if not self.active:
                return output
            x = inputs[0]  # in the layer's compute dtype, as a merged bf16 weight would be: no fp32 activations
            return output + (scale * ((x @ a.T.to(x.dtype)) @ b.T.to(x.dtype))).to(output.dtype)
        return hook

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        self.active = False
        try:
            yield
        finally:
            self.active = True
