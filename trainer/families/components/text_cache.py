"""Text-encoder outputs cached once to disk, shared by every family whose text encoders are frozen
(SDXL, SD3, FLUX): a caption's embeddings are computed once per (captions, model) instead of every step.

Stable API (other families import it):

- ``text_cache_key(model: dict, captions) -> str``: the cache folder name for these captions and this model
  (``model`` holds whatever identifies the encoders' output: path, revision, encoder configs, max length...).
- ``build_text_cache(folder, captions, encode, *, rank, world_size, barrier) -> TextEmbeddings``:
  ``encode(list[str]) -> dict[str, Tensor]`` with one row per caption (e.g. ``{"hidden": (n, 77, d),
  "pooled": (n, d2)}``). Distinct captions are sorted and split into fixed chunks (independent of the number of
  processes, so the cached values are too); rank r encodes chunks r, r+W, ...; the chunks travel to every rank
  through the process group and are written atomically (temp file + rename) into each node's cache folder, so
  one process encodes each chunk and the others wait for it (the chunking and exchange are
  trainer.families.components.latent_cache's). A finished cache is reused by later runs without encoding anything.
- ``TextEmbeddings.get(caption)`` -> dict of tensors for one caption; ``.stack(captions)`` -> batched dict.
- ``cache_text_embeddings(config, family_default, log_warning=None) -> bool``: the preset key
  ``data.cache_text_embeddings`` (``null`` means the family's default); off when ``data.shuffle_tags`` varies the
  captions (trainer.core.data.captions: dropped captions and the prefix are cached, shuffled tags are not).
- ``offload(*modules)``: frees frozen text encoders after caching (moved to the CPU; their memory on the
  accelerator is released). Sampling moves them back with ``onload``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Iterable

import torch

from trainer.families.components.disk_rows import Column
from trainer.families.components.latent_cache import build_latent_cache


def text_cache_key(model: dict, captions: Iterable[str]) -> str:
    h = hashlib.sha256(json.dumps(model, sort_keys=True, default=str).encode())
    for caption in sorted(set(captions)):
        h.update(caption.encode("utf-8") + b"\0")
    return h.hexdigest()[:20]


class TextEmbeddings:
    """Cached encoder outputs, looked up by caption (CPU fp32 tensors, read from disk per caption:
    trainer.families.components.disk_rows)."""

    def __init__(self, captions: list[str], tensors: dict[str, Column]):
        self.index = {caption: i for i, caption in enumerate(captions)}
        self.tensors = tensors

    def __contains__(self, caption: str) -> bool:
        return caption in self.index

    def __len__(self) -> int:
        return len(self.index)

    def get(self, caption: str) -> dict[str, torch.Tensor]:
        i = self.index[caption]
        return {k: v[i] for k, v in self.tensors.items()}

    def stack(self, captions: list[str]) -> dict[str, torch.Tensor]:
        rows = [self.index[c] for c in captions]
        return {k: torch.stack([v[i] for i in rows]) for k, v in self.tensors.items()}


def build_text_cache(
    folder: Path,
    captions: Iterable[str],
    encode: Callable[[list[str]], dict[str, torch.Tensor]],
    *,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    device="cpu",
) -> TextEmbeddings:
    """See the module docstring. `device`: where the process group's collectives run (the rank's device)."""
    unique = sorted(set(captions))
    if not unique:
        raise ValueError("no captions to cache")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # for people looking into the cache; never read back
        (folder / "captions.json").write_text(json.dumps(unique))

    @torch.no_grad()
    def encode_rows(indices: list[int]) -> dict[str, torch.Tensor]:
        return encode([unique[i] for i in indices])

    tensors = build_latent_cache(folder, len(unique), encode_rows, rank=rank, world_size=world_size,
                                 barrier=barrier, device=device)
    return TextEmbeddings(unique, tensors)


def cache_text_embeddings(config, family_default: bool, log_warning: Callable[[str], None] | None = None) -> bool:
    value = getattr(config.data, "cache_text_embeddings", None)
    wanted = family_default if value is None else bool(value)
    if wanted and getattr(config.data, "shuffle_tags", False):  # validation refuses an explicit `true` with it
        if log_warning is not None:
            log_warning("data.cache_text_embeddings is off because data.shuffle_tags makes a new caption at almost "
                        "every step: the captions are encoded at every step, and the text encoders stay on the "
                        "device")
        return False
    return wanted


def offload(*modules: torch.nn.Module) -> None:
    """Move frozen text encoders off the accelerator once their outputs are cached."""
    for module in modules:
        if module is not None:
            module.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def onload(device: torch.device, *modules: torch.nn.Module) -> None:
    for module in modules:
        if module is not None:
            module.to(device)
