"""Cached rows read from disk one at a time: the latent and text caches stay on disk, not in every rank's RAM.

A cache is a folder of safetensors chunks (trainer.families.components.latent_cache), each holding CHUNK rows of
every column ("mean", "std", "hidden"...) in the precision the encoder produced. `DiskRows` reads row i of a
column with one `pread` of exactly its bytes, so a process's memory holds the rows of the current micro-batch,
whatever the dataset's size: 10,000 FLUX images with their own captions are ~120 GB as float32 in RAM, per rank.

Why not `safe_open`'s memory map: pages of a mapped file that a process has read count in its resident memory
until the kernel reclaims them, so an epoch over a mapped cache grows every rank's RSS to the cache's size (shared
and reclaimable, but indistinguishable from a leak in a monitor, and what OOM killers read). `pread` leaves the
file in the page cache only, shared by every rank of the node and never charged to them.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    row_bytes: int
    offset: int  # of row 0 from the start of the file


def read_header(path: Path) -> tuple[dict[str, _Entry], int]:
    """({column: where its rows are}, rows) of one safetensors chunk (its JSON header only)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    entries, rows = {}, None
    for name, info in header.items():
        shape = tuple(info["shape"])
        start, end = info["data_offsets"]
        rows = shape[0] if rows is None else rows
        if shape[0] != rows:
            raise ValueError(f"{path}: column {name} has {shape[0]} rows, others {rows}")
        row_bytes = (end - start) // shape[0] if shape[0] else 0
        entries[name] = _Entry(DTYPES[info["dtype"]], shape[1:], row_bytes, 8 + length + start)
    return entries, rows or 0


class DiskRows:
    """Rows [0, count) of a chunked cache: `rows.column(name)[i]` is row i (a fresh CPU tensor, float32 for the
    float columns so the maths downstream is the same as with an in-memory cache)."""

    def __init__(self, paths: list[Path], chunk: int, count: int):
        self.paths, self.chunk, self.count = paths, chunk, count
        self._headers: dict[int, dict[str, _Entry]] = {}
        self.names = tuple(self._header(0)) if paths else ()

    def _header(self, chunk: int) -> dict[str, _Entry]:
        if chunk not in self._headers:
            self._headers[chunk] = read_header(self.paths[chunk])[0]
        return self._headers[chunk]

    def row(self, name: str, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(f"row {index} of a cache of {self.count}")
        chunk, offset = divmod(index, self.chunk)
        entry = self._header(chunk)[name]
        fd = os.open(self.paths[chunk], os.O_RDONLY)
        try:
            data = os.pread(fd, entry.row_bytes, entry.offset + offset * entry.row_bytes)
        finally:
            os.close(fd)
        if len(data) != entry.row_bytes:
            raise OSError(f"{self.paths[chunk]}: short read (the cache file was truncated; delete it to rebuild)")
        tensor = torch.frombuffer(bytearray(data), dtype=entry.dtype).reshape(entry.row_shape)
        return tensor.float() if tensor.is_floating_point() else tensor

    def column(self, name: str) -> "Column":
        return Column(name, [(self, i) for i in range(self.count)])

    def table(self) -> dict[str, "Column"]:
        return {name: self.column(name) for name in self.names}

    def __len__(self) -> int:
        return self.count


class Column:
    """One column of cached rows, indexable like a tensor's first dimension: `column[i]`, `len(column)`. Row i
    is row `places[i][1]` of the cache `places[i][0]`: one cache (`DiskRows.column`), or several
    (`Column.gather`: aspect-ratio buckets have a cache each)."""

    def __init__(self, name: str, places: list[tuple[DiskRows, int]]):
        self.name, self.places = name, places

    @classmethod
    def gather(cls, name: str, places: list[tuple[DiskRows, int]]) -> "Column":
        return cls(name, places)

    def __len__(self) -> int:
        return len(self.places)

    def __getitem__(self, i: int) -> torch.Tensor:
        rows, row = self.places[i]
        return rows.row(self.name, row)
