"""Encode every training image with the VAE once, in parallel across ranks, one writer per file.

Images are split into fixed chunks by index (not by rank), each chunk encoded as one batch, so the cached
values do not depend on the number of processes. Rank r encodes chunks r, r+W, ...; each chunk is written
atomically (temp file + rename); everyone waits at a barrier and then reads all chunks. A finished cache is
reused by later runs with the same images, model and resolution.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

CHUNK = 8


def cache_key(parts: dict, files: list[str]) -> str:
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for file in files:
        st = os.stat(file)
        h.update(f"{file}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def build_latent_cache(
    folder: Path,
    count: int,
    encode: Callable[[list[int]], dict[str, torch.Tensor]],
    *,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
) -> dict[str, torch.Tensor]:
    """`encode(indices)` returns a dict of (len(indices), ...) tensors; the result stacks all `count` rows."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks = range((count + CHUNK - 1) // CHUNK)
    for chunk in chunks:
        if chunk % world_size != rank:
            continue
        target = folder / f"chunk-{chunk:06d}.safetensors"
        if target.exists():
            continue
        indices = list(range(chunk * CHUNK, min(count, (chunk + 1) * CHUNK)))
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in encode(indices).items()}
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(tmp))
        os.replace(tmp, target)
    barrier()
    parts = [load_file(str(folder / f"chunk-{chunk:06d}.safetensors")) for chunk in chunks]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
