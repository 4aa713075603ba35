"""The latent and text caches live on disk (trainer.families.components.latent_cache, disk_rows): written once
per node in the encoder's precision, read back row by row with the values the encoder produced, reused without
encoding, and built by real process groups where each node's first process is its only writer. How memory and
time scale with 1k-100k images is bench/cache_scale.py's (bench/README.md)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.families.components import latent_cache
from trainer.families.components.latent_cache import CHUNK, build_latent_cache


def _encoder(calls: list | None = None, dtype=torch.bfloat16):
    """Row i of "mean" is filled with i/7, of "hidden" with -i/3, in `dtype` (as a bf16 VAE / T5 would give)."""

    def encode(indices):
        if calls is not None:
            calls.append(list(indices))
        rows = torch.tensor(indices, dtype=torch.float32)
        return {"mean": (rows / 7).view(-1, 1, 1, 1).expand(-1, 4, 2, 3).to(dtype),
                "hidden": (-rows / 3).view(-1, 1, 1).expand(-1, 5, 6).to(dtype)}

    return encode


def _dtypes(path: Path) -> dict[str, str]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_rows_come_back_as_encoded_across_chunks_stored_in_the_encoders_precision(tmp_path):
    count, calls = 2 * CHUNK + 3, []
    table = build_latent_cache(tmp_path / "c", count, _encoder(calls), rank=0, world_size=1, barrier=lambda: None)
    assert calls == [list(range(c * CHUNK, min(count, (c + 1) * CHUNK))) for c in range(3)]
    assert sorted(table) == ["hidden", "mean"] and len(table["mean"]) == count
    expected = _encoder()(list(range(count)))
    for i in range(count):
        assert torch.equal(table["mean"][i], expected["mean"][i].float())  # bf16 on disk, float32 to the maths
        assert torch.equal(table["hidden"][i], expected["hidden"][i].float())
    files = sorted((tmp_path / "c").glob("chunk-*.safetensors"))
    assert len(files) == 3 and all(_dtypes(f) == {"mean": "BF16", "hidden": "BF16"} for f in files)
    with pytest.raises(IndexError):
        table["mean"][count]

    again = build_latent_cache(tmp_path / "c", count, lambda idx: pytest.fail("encoded again"), rank=0,
                               world_size=1, barrier=lambda: None)
    assert torch.equal(again["hidden"][count - 1], table["hidden"][count - 1])


def _rank(rank: int, world: int, port: int, folders: list[str], local_ranks: list[int], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    writes: list[str] = []
    original = latent_cache._write
    latent_cache._write = lambda path, tensors: (writes.append(path.name), original(path, tensors))
    count = 3 * CHUNK + 1
    table = build_latent_cache(Path(folders[rank]), count, _encoder(), rank=rank, world_size=world,
                               barrier=dist.barrier, local_rank=local_ranks[rank])
    rows = [float(table["mean"][i][0, 0, 0]) for i in range(count)]
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"writes": writes, "rows": rows}))
    dist.destroy_process_group()


def test_each_node_writes_its_cache_once_and_every_rank_reads_every_row(tmp_path):
    # Two "nodes" on this machine: ranks 0 and 1 share node A's folder, rank 2 is node B with its own disk.
    node_a, node_b = str(tmp_path / "a"), str(tmp_path / "b")
    folders, local_ranks = [node_a, node_a, node_b], [0, 1, 0]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children have torch imported already (spawn would import it three times over)
    mp.start_processes(_rank, args=(3, port, folders, local_ranks, str(tmp_path)), nprocs=3, join=True,
                       start_method="fork")
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    chunks = [f"chunk-{c:06d}.safetensors" for c in range(4)]
    assert sorted(results[0]["writes"]) == chunks and results[1]["writes"] == []  # node A: its first process only
    assert sorted(results[2]["writes"]) == chunks  # node B's disk gets its own copy, sent through the group
    expected = [float(torch.tensor(i / 7).to(torch.bfloat16)) for i in range(3 * CHUNK + 1)]
    assert all(r["rows"] == expected for r in results)
    for name in chunks:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
