"""Exchanging data between ranks as bytes in uint8 tensors, never as pickles.

torch's *_object collectives pickle on one rank and unpickle on the others: whoever can join the process group
(a multi-node run's master_addr is a setting) could run code in every rank. These carry safetensors (tensors)
or JSON (plain values) instead, which only ever decode to data.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors


def _device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def broadcast_bytes(data: bytes | None, src: int) -> bytes:
    device = _device()
    mine = dist.get_rank() == src
    assert data is not None or not mine, "the source rank sends bytes (the others pass None)"
    payload = data or b""
    size = torch.tensor([len(payload) if mine else 0], dtype=torch.long, device=device)
    dist.broadcast(size, src)
    buf = _to_tensor(payload, device) if mine else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if buf.numel():
        dist.broadcast(buf, src)
    return buf.cpu().numpy().tobytes()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank."""
    device, world = _device(), dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[:len(data)] = _to_tensor(data, device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    if longest:
        dist.all_gather(bufs, buf)
    return [b[:int(s.item())].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]


def broadcast_json(value, src: int):
    data = json.dumps(value).encode() if dist.get_rank() == src else None
    return json.loads(broadcast_bytes(data, src))


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None, src: int) -> dict[str, torch.Tensor]:
    # None on the source rank fails in broadcast_bytes, which names the mistake.
    data = None
    if dist.get_rank() == src and tensors is not None:
        data = save_tensors({k: v.contiguous() for k, v in tensors.items()})
    return load_tensors(broadcast_bytes(data, src))


def all_gather_tensors(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [load_tensors(b) for b in all_gather_bytes(save_tensors({k: v.contiguous() for k, v in tensors.items()}))]
