"""Encode every training image with the VAE once, in parallel across ranks, one writer per node.

Images are split into fixed chunks by index (not by rank), each chunk encoded as one batch, so the cached
values do not depend on the number of processes. Rank r encodes the chunks c with c % world == r that are
not already cached, and sends them to every other rank through the process group, as safetensors bytes in a
tensor: on several machines each node has its own disk, so a file written by a rank on another node is never
assumed to be visible. The first process of each node (LOCAL_RANK 0) writes the chunks its node lacks,
atomically (temp file + rename), in the precision the encoder produced (bf16 on GPUs: half of float32); later
runs with the same images, model and resolution reuse them. Nothing is kept in memory: the rows are read from
disk when a sample needs them (trainer.families.components.disk_rows), so a rank's memory does not grow with
the dataset (bench/cache_scale.py measures it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainer.families.components.disk_rows import Column, DiskRows

CHUNK = 8


@torch.no_grad()
def weights_fingerprint(*modules: torch.nn.Module) -> str:
    """A digest of the modules' weights (the float64 sum and absolute sum of every tensor): part of every cache key,
    because a model folder's config and path stay the same when its weights change (a re-download, a retrained
    model written over the old one), and latents or text embeddings of the old weights would be reused silently.
    (Found when the demo's base was retrained in place: the runs folder's latents of the old VAE came back.)"""
    tensors = [t for module in modules if isinstance(module, torch.nn.Module) for t in module.state_dict().values()]
    stats = [torch.stack([t.double().sum(), t.double().abs().sum()]).cpu() for t in tensors if t.is_floating_point()]
    return hashlib.sha256(torch.cat(stats).numpy().tobytes()).hexdigest()[:16] if stats else ""


def cache_key(parts: dict, files: list[str]) -> str:
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for file in files:
        st = os.stat(file)
        h.update(f"{file}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _cached_everywhere(paths: list[Path], device) -> list[bool]:
    """Which chunks every process already has on its own disk (a shared cache or an earlier run)."""
    have = torch.tensor([p.exists() for p in paths], dtype=torch.int32, device=device)
    if _distributed() and len(paths):
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    return [bool(h) for h in have.tolist()]


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def build_latent_cache(
    folder: Path,
    count: int,
    encode: Callable[[list[int]], dict[str, torch.Tensor]],
    *,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    device="cpu",
    local_rank: int | None = None,
) -> dict[str, Column]:
    """`encode(indices)` returns a dict of (len(indices), ...) tensors; the result has a column per key, each
    indexable by row in [0, count) and read from disk. `local_rank`: this process's place on its node (default:
    torchrun's LOCAL_RANK, else `rank`); the node's 0 writes."""
    folder.mkdir(parents=True, exist_ok=True)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    paths = [folder / f"chunk-{c:06d}.safetensors" for c in range((count + CHUNK - 1) // CHUNK)]
    everywhere = _cached_everywhere(paths, device)
    for chunk, path in enumerate(paths):
        if everywhere[chunk]:
            continue
        owner = chunk % world_size
        tensors = None
        if rank == owner:
            if path.exists():
                tensors = load_file(str(path))
            else:
                indices = list(range(chunk * CHUNK, min(count, (chunk + 1) * CHUNK)))
                tensors = {k: v.detach().cpu().contiguous() for k, v in encode(indices).items()}
        if _distributed():
            from trainer.families.components.collectives import broadcast_tensors

            tensors = broadcast_tensors(tensors, src=owner)  # safetensors bytes, not a pickle
        assert tensors is not None, "without torch.distributed, this process owns every chunk"
        if local_rank == 0 and not path.exists():
            _write(path, tensors)
    barrier()  # every node's writer has written: its other ranks read the files
    return DiskRows(paths, CHUNK, count).table()
