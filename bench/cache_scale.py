#!/usr/bin/env python
"""Do the caches scale with the dataset, not with RAM x ranks? Build time, disk size and peak memory per rank of
the latent and text caches for 1k / 10k / 100k synthetic images, and the scan time of a 100k-file folder.

    python bench/cache_scale.py                     # every case below (~25 GB of disk at its largest, deleted)
    python bench/cache_scale.py --cases sd15:1000 flux-text:1000 --json out.json
    python bench/cache_scale.py --scan 100000       # only the folder scan

Each case runs in a fresh process (its peak RSS is its own, `ru_maxrss`), through the product's code:
`build_latent_cache` (trainer.families.components.latent_cache) with an encoder that returns tensors of the
real models' shapes in bf16 (what a bf16 VAE / T5 gives on a GPU; no model runs: the cache's cost is what is
measured), then one pass reading every row as training does (`table[name][i]`), then, where it fits in this machine's
RAM (`IN_MEMORY_LIMIT_MB`), the old in-memory layout for comparison (every chunk loaded and stacked in float32, what `build_latent_cache`
returned before the caches moved to disk). One process stands for one rank: every rank of a node reads the same
files, and with one writer per node only the first builds them.

Shapes (per image or caption; mean and std are both cached, flips would double the latent rows):
  sd15       SD 1.5 at 512 px: latents 4x64x64
  sdxl       SDXL at 1024 px: latents 4x128x128
  flux       FLUX at 1024 px: latents 16x128x128
  sdxl-text  SDXL's two CLIP encoders: hidden 77x2048 + pooled 1280
  flux-text  FLUX's T5 (512 tokens x 4096) + CLIP pooled 768
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SHAPES = {
    "sd15": {"mean": (4, 64, 64), "std": (4, 64, 64)},
    "sdxl": {"mean": (4, 128, 128), "std": (4, 128, 128)},
    "flux": {"mean": (16, 128, 128), "std": (16, 128, 128)},
    "sdxl-text": {"hidden": (77, 2048), "pooled": (1280,)},
    "flux-text": {"hidden": (512, 4096), "pooled": (768,)},
}
DEFAULT_CASES = ["sd15:1000", "sd15:10000", "sd15:100000", "sdxl:1000", "sdxl:10000", "flux:1000", "flux:10000",
                 "sdxl-text:1000", "sdxl-text:10000", "flux-text:1000"]
IN_MEMORY_LIMIT_MB = 6000
"""The old in-memory layout is measured only where its float32 tables stay under this: FLUX at 10k images needs
20 GB of them (the first attempt was OOM-killed at 22 GB on the 24 GB development machine)."""


def run_case(shape: str, count: int, folder: Path) -> dict:
    """In this process: build, read every row, and (small enough) the old in-memory layout."""
    import resource

    import torch
    from safetensors.torch import load_file

    from trainer.families.components.latent_cache import build_latent_cache

    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    shapes = SHAPES[shape]

    def encode(indices):
        # Distinct, cheap values (a random generator would dominate the build time at 100k images).
        return {name: torch.full((len(indices), *dims), float(indices[0]), dtype=torch.bfloat16)
                for name, dims in shapes.items()}

    base = peak_mb()
    began = time.perf_counter()
    table = build_latent_cache(folder, count, encode, rank=0, world_size=1, barrier=lambda: None)
    build_s = time.perf_counter() - began
    after_build = peak_mb()
    disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    began = time.perf_counter()
    for i in range(count):
        for name in shapes:
            table[name][i]
    read_s = time.perf_counter() - began
    result = {"shape": shape, "images": count, "build_s": round(build_s, 2), "disk_mb": round(disk / 2**20, 1),
              "peak_rss_build_mb": round(after_build, 1), "peak_rss_read_mb": round(peak_mb(), 1),
              "rss_before_mb": round(base, 1), "read_ms_per_row": round(1000 * read_s / count, 3)}
    result["in_memory_mb"] = round(2 * disk / 2**20, 1)  # bf16 on disk, float32 in the old tables
    if result["in_memory_mb"] <= IN_MEMORY_LIMIT_MB:
        began = time.perf_counter()
        chunks = [load_file(str(p)) for p in sorted(folder.glob("chunk-*.safetensors"))]
        stacked = {k: torch.cat([c[k].float() for c in chunks]) for k in chunks[0]}
        del chunks
        result["in_memory_load_s"] = round(time.perf_counter() - began, 2)
        result["in_memory_peak_rss_mb"] = round(peak_mb(), 1)
        assert abs(sum(t.numel() * 4 for t in stacked.values()) / 2**20 - result["in_memory_mb"]) < 1
    return result


def scan_case(files: int, folder: Path) -> dict:
    """Scan time of a folder of `files` small PNGs with captions (the scan decodes every image once)."""
    from PIL import Image

    from trainer.core.data.scan import scan_dataset

    folder.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    image = Image.new("RGB", (64, 48), (200, 80, 40))
    template = folder / "template.png"
    image.save(template)
    data = template.read_bytes()
    template.unlink()
    for i in range(files):
        (folder / f"img{i:06d}.png").write_bytes(data)
        (folder / f"img{i:06d}.txt").write_text(f"a photo number {i}")
    made_s = time.perf_counter() - began
    began = time.perf_counter()
    scan = scan_dataset(folder)
    scan_s = time.perf_counter() - began
    assert len(scan.items) == files, scan.problems or scan.warnings[:3]
    import resource

    return {"scan_files": files, "scan_s": round(scan_s, 2), "ms_per_file": round(1000 * scan_s / files, 3),
            "make_s": round(made_s, 1), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def in_subprocess(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    from bench._common import markdown_table

    rows = [[r["shape"], r["images"], r["build_s"], r["disk_mb"], r["peak_rss_build_mb"], r["peak_rss_read_mb"],
             r["read_ms_per_row"], r.get("in_memory_mb", "-"), r.get("in_memory_peak_rss_mb", "-")] for r in results]
    return markdown_table(["shape", "images", "build s", "disk MB (bf16)", "peak RSS build MB", "peak RSS after a "
                           "read of every row MB", "read ms/row", "old: float32 in RAM MB",
                           "old: peak RSS MB"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="SHAPE:IMAGES ...")
    parser.add_argument("--scan", type=int, default=100_000, help="files in the scanned folder (0: skip)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--role", choices=["case", "scan"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "case":
        shape, count = args.cases[0].split(":")
        print(json.dumps(run_case(shape, int(count), args.folder)))
        return 0
    if args.role == "scan":
        print(json.dumps(scan_case(args.scan, args.folder)))
        return 0
    results, scan = [], None
    for case in args.cases:
        work = Path(tempfile.mkdtemp(prefix="cache-scale-"))
        try:
            results.append(in_subprocess(["--role", "case", "--cases", case, "--folder", str(work / "cache")]))
            print(json.dumps(results[-1]), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.scan:
        work = Path(tempfile.mkdtemp(prefix="scan-scale-"))
        try:
            scan = in_subprocess(["--role", "scan", "--scan", str(args.scan), "--folder", str(work / "data")])
            print(json.dumps(scan), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    if scan:
        print(f"\nscan of {scan['scan_files']} files: {scan['scan_s']} s ({scan['ms_per_file']} ms per file), "
              f"peak RSS {scan['peak_rss_mb']} MB")
    if args.json:
        args.json.write_text(json.dumps({"cases": results, "scan": scan}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
