"""A tiny, randomly initialised FLUX.1 Kontext pipeline written as a real diffusers folder, offline: the tiny FLUX.1
dev pipeline (trainer.families.flow.demo: the real FluxTransformer2DModel with its guidance embedding, CLIP, T5,
the 16-channel VAE, dev's scheduler) saved as FluxKontextPipeline, as black-forest-labs/FLUX.1-Kontext-dev is (the
same components; its model_index.json names FluxKontextPipeline). Images are 64 px."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.families.components.tiny_assets import ensure_asset
from trainer.families.flow.demo import make_tiny_flux


def make_tiny_flux_kontext(folder, *, seed: int = 0) -> Path:
    folder = make_tiny_flux(folder, guidance_embeds=True, seed=seed)
    index = folder / "model_index.json"
    model_index = json.loads(index.read_text())
    model_index["_class_name"] = "FluxKontextPipeline"
    index.write_text(json.dumps(model_index, indent=2) + "\n")
    return folder


def ensure_tiny_flux_kontext(root) -> dict[str, Path]:
    """`root/tiny-flux-kontext`, built once (atomically, see tiny_assets.ensure_asset)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {"tiny-flux-kontext": ensure_asset(root / "tiny-flux-kontext", make_tiny_flux_kontext, "model_index.json")}
