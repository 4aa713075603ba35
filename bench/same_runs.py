"""Are two runs the same? For refactors that must not change training: run the same preset (same seed) at the code
before and after, then compare the two run folders.

    python bench/same_runs.py RUN_BEFORE RUN_AFTER

Compared: every progress / sample / checkpoint / done event (step and loss), every checkpoint tensor, every sample's
pixels, every output tensor and its safetensors metadata, and every other output file byte for byte. Timestamps
are ignored, and so is the runs folder's own path where a file records it (a full fine-tune's diffusers configs
name the base model's folder). Exit status 0 when identical, 1 otherwise, with what differs.

The flow-matching core (FlowFamily) was checked this way: demo-flux and demo-sd3, LoRA and full, 3 steps each, at
the commit before and after it: identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

EVENTS = ("progress", "sample", "checkpoint", "done")
VOLATILE = ("created", "date", "finished_at")  # metadata keys that hold the time of writing


def events(run: Path) -> list[tuple]:
    rows = (json.loads(line) for line in (run / "events.jsonl").read_text().splitlines())
    return [(e["type"], e.get("step"), e.get("loss")) for e in rows if e["type"] in EVENTS]


def metadata(path: Path, root: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata() or {})
    return {k: v.replace(str(root), "<runs>") for k, v in meta.items() if not any(w in k for w in VOLATILE)}


def same_tensors(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def compare(a: Path, b: Path) -> list[str]:
    """What differs between run folders `a` and `b` (empty: identical)."""
    roots = (a.parent, b.parent)
    out = [] if events(a) == events(b) else ["events (steps or losses)"]
    for path in sorted(a.rglob("*")):
        rel = path.relative_to(a)
        other = b / rel
        if not path.is_file() or rel.parts[0] not in ("checkpoints", "samples", "output"):
            continue
        if not other.is_file():
            out.append(f"{rel}: missing in the second run")
        elif path.suffix == ".safetensors":
            if not same_tensors(path, other) or metadata(path, roots[0]) != metadata(other, roots[1]):
                out.append(f"{rel}: tensors or metadata")
        elif path.suffix == ".png":
            if not np.array_equal(np.asarray(Image.open(path)), np.asarray(Image.open(other))):
                out.append(f"{rel}: pixels")
        elif rel.parts[0] == "output":
            text_a = path.read_bytes().replace(str(roots[0]).encode(), b"<runs>")
            if text_a != other.read_bytes().replace(str(roots[1]).encode(), b"<runs>"):
                out.append(f"{rel}: bytes")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    args = p.parse_args(argv)
    differences = compare(args.before, args.after)
    for line in differences:
        print("differs:", line)
    print("identical" if not differences else f"{len(differences)} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
