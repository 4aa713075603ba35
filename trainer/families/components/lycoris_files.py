"""LoKr, LoHa and DoRA outputs: the kohya/ComfyUI single file (LyCORIS' keys) and a peft folder per model.

A kohya-format file holds, per adapted module `<name>` (`lora_unet_...`, `lora_te1_...`, `lora_transformer_...`),
what ComfyUI's weight adapters (comfy/weight_adapter/lokr.py, loha.py, lora.py) and A1111/Forge's
network_lokr / network_hada read:

- LoKr: `lokr_w1` (or `lokr_w1_a` @ `lokr_w1_b`), `lokr_w2` (or `lokr_w2_a` @ `lokr_w2_b`), `alpha`; the update is
  kron(w1, w2) * alpha / rank where a factor is low-rank (rank: its `_b`'s first side), kron(w1, w2) otherwise;
- LoHa: `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`, `alpha`; (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rank;
- DoRA: a LoRA's `lora_down`, `lora_up`, `alpha` and `dora_scale`, one per output row (shape (out, 1): LyCORIS'
  `wd_on_out`, which ComfyUI recognises by that shape). ComfyUI then computes
  W' = (W + alpha / rank * up @ down) * dora_scale / ||W||, the row norms of the *base* weight W (peft and
  LyCORIS divide by the norms of the adapted weight; ComfyUI PR #15458 would change this), so the file holds
  m * ||W|| / ||W + alpha / rank * up @ down||: it gives the trained weights in ComfyUI (and Forge, which shares
  its code) on the base model trained on, and is off by those norms' ratio, near 1, in a reader that follows
  LyCORIS. The diffusers file holds peft's magnitudes themselves.

peft names the same tensors the same way, so a layer's own parameters are written, each in fp32 and contiguous.
The peft folder is `adapter_config.json` + `adapter_model.safetensors`, what `PeftModel.from_pretrained(model,
folder)` reads (peft's own layout, keys under `base_model.model.`): diffusers' LoRA loaders read no LoHa.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from trainer.families.components.adapters import (
    ADAPTER,
    adapter_layers,
    base_weight,
    kind,
    lora_product,
    magnitude,
    row_norm,
)

_LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def _tensor(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu().contiguous()


def _lokr(layer) -> dict[str, torch.Tensor]:
    if ADAPTER in layer.lokr_t2:
        raise ValueError("LoKr with a Tucker core (lokr_t2) is not written: kohya readers expect it only for convs")
    out = {name: _tensor(getattr(layer, name)[ADAPTER]) for name in _LOKR if ADAPTER in getattr(layer, name)}
    if "lokr_w1_b" in out or "lokr_w2_b" in out:
        out["alpha"] = torch.tensor(float(layer.alpha[ADAPTER]))  # readers scale by alpha / (the _b's rank) == peft
    else:  # readers apply both full factors unscaled: carry peft's scale in w1 (1 unless set otherwise)
        out["lokr_w1"] = out["lokr_w1"] * layer.scaling[ADAPTER]
        out["alpha"] = torch.tensor(float(layer.r[ADAPTER]))
    return out


def _loha(layer) -> dict[str, torch.Tensor]:
    if ADAPTER in layer.hada_t1:
        raise ValueError("LoHa with Tucker cores (hada_t1/t2) is not written: kohya readers expect it only for convs")
    out = {name: _tensor(getattr(layer, name)[ADAPTER]) for name in _LOHA}
    out["alpha"] = torch.tensor(float(layer.scaling[ADAPTER] * layer.r[ADAPTER]))
    return out


def _dora(layer) -> dict[str, torch.Tensor]:
    weight = base_weight(layer)
    scale = magnitude(layer) * row_norm(weight) / row_norm(weight + lora_product(layer))
    return {"lora_down.weight": _tensor(layer.lora_A[ADAPTER].weight), "lora_up.weight": _tensor(layer.lora_B[ADAPTER].weight),
            "alpha": torch.tensor(float(layer.scaling[ADAPTER] * layer.r[ADAPTER])), "dora_scale": _tensor(scale)}


_WRITERS = {"lokr": _lokr, "loha": _loha, "dora": _dora}


def kohya_tensors(*models: tuple[torch.nn.Module | None, Callable[[str], str]]) -> dict[str, torch.Tensor]:
    """The kohya entries of the LoKr / LoHa / DoRA layers of each (model, name) pair (None: skipped), where
    `name(module path)` is a module's kohya name."""
    out: dict[str, torch.Tensor] = {}
    for model, name in models:
        for path, layer in sorted(adapter_layers(model).items() if model is not None else ()):
            writer = _WRITERS.get(kind(layer))
            if writer is None:
                raise ValueError(f"{path} is a plain LoRA layer: write it with the LoRA writers (kohya.to_kohya)")
            out.update({f"{name(path)}.{key}": t for key, t in writer(layer).items()})
    if not out:
        raise ValueError("no adapter layers to write")
    return out


def network_metadata(lora) -> dict[str, str]:
    """sd-scripts' `ss_network_module` / `ss_network_args` of a LyCORIS network (the `lora` config section)."""
    args: dict[str, object] = {"algo": "lora" if lora.type == "lora" else lora.type}
    if lora.type == "lokr":
        args["factor"] = lora.factor
    if lora.dora:
        args.update(dora_wd=True, wd_on_out=True)
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args)}


def save_peft_folders(out_dir: Path, models: Mapping[str, torch.nn.Module]) -> list[Path]:
    """`out_dir/peft/<component>/` for each adapted model: its peft config and adapter weights."""
    from peft.utils import get_peft_model_state_dict

    folders = []
    for component, model in models.items():
        folder = out_dir / "peft" / component
        folder.mkdir(parents=True, exist_ok=True)
        model.peft_config[ADAPTER].save_pretrained(str(folder))  # type: ignore[index, union-attr]
        state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
        write_file(folder / "adapter_model.safetensors", {f"base_model.model.{k}": _tensor(v) for k, v in state.items()},
                   {"format": "pt"})
        folders.append(folder)
    return folders


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """A safetensors file written whole or not at all (a reader never sees half of one)."""
    from safetensors.torch import save_file

    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, path)
    return path
