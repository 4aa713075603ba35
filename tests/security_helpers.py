"""Run folders and datasets for tests/test_security.py: a tiny captioned image folder, a resumable (stopped) run
folder built from a real config, and the six malformed run folders that once broke the Runs page."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

PLAN_EVENT = {"type": "plan", "line": "1 process", "total": 2, "steps": 4, "notes": []}


def image_folder(path: Path, count: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(path / f"img{i}.png")
        (path / f"img{i}.txt").write_text(f"a photo {i}")
    return path


def lora_config(data: Path, model: Path | None = None, **extra):
    """A small SD LoRA config on `data`, its model an empty folder beside it unless given (nothing is loaded by
    these tests)."""
    from trainer.core.config import load_config

    if model is None:
        model = Path(data).parent / "model"
        model.mkdir(parents=True, exist_ok=True)
    preset = {"name": "victim", "model": {"path": str(model)}, "data": {"path": str(data), "resolution": 64},
              "devices": "cpu:1", "batch": {"total": 2, "per_device": 2}, "train": {"steps": 4}}
    for key, value in extra.items():
        node = preset
        *head, last = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return load_config(preset)


def stopped_run(runs_dir: Path, data: Path, name: str = "victim", model: Path | None = None) -> Path:
    """A run folder that stopped at step 1 with a complete checkpoint: what Resume continues."""
    from trainer.core.config import to_yaml

    run = runs_dir / name
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "checkpoints" / "step-000001" / "COMPLETE").write_text(json.dumps({"step": 1}))
    (run / "config.yaml").write_text(to_yaml(lora_config(data, model, name=name)))
    (run / "plan.json").write_text(json.dumps({"total": 2}))
    events = [PLAN_EVENT, {"type": "stopped", "step": 1, "checkpoint": "checkpoints/step-000001"}]
    (run / "events.jsonl").write_text("".join(json.dumps({"time": 1.7e9 + i, **e}) + "\n" for i, e in enumerate(events)))
    return run


# name -> (config.yaml bytes, events.jsonl bytes)
MALFORMED = {
    "config-is-a-string": (b"just a string\n", b""),
    "steps-auto": (b"train: {steps: auto}\n", b""),
    "event-is-a-list": (b"{}\n", b'["plan", 1]\n{"type": "progress", "step": [1]}\n'),
    "loss-not-a-number": (b"{}\n", json.dumps({"type": "progress", "step": 1, "loss": "NaNish"}).encode() + b"\n"),
    "invalid-utf8": (b"name: \xff\xfe\n", b'{"type": "plan", "line": "\xff"}\n'),
    "sample-path-not-a-string": (b"{}\n", json.dumps({"type": "sample", "step": 1, "path": {"a": 1}}).encode() + b"\n"),
}


def malformed_runs(runs_dir: Path) -> list[str]:
    for name, (config, events) in MALFORMED.items():
        run = runs_dir / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_bytes(config)
        (run / "events.jsonl").write_bytes(events)
    return list(MALFORMED)
