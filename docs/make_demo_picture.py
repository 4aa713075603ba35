"""The README's demo picture: a run's samples at its first and last sample step, one row per prompt, labelled
with the step and the run's concept/control scores.

    python launch.py --preset presets/demo.yaml --runs-dir /tmp/runs
    python docs/make_demo_picture.py /tmp/runs/demo docs/demo-samples.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.core.events import read_events  # noqa: E402

SCALE = 2  # 64 px samples, shown at 128 px


def picture(run_dir: Path) -> Image.Image:
    events = read_events(run_dir)
    samples = [e for e in events if e["type"] == "sample"]
    scores = {e["step"]: e for e in events if e["type"] == "eval" and "concept" in e}
    first, last = samples[0]["step"], samples[-1]["step"]
    prompts = list(dict.fromkeys(e["prompt"] for e in samples))
    rows = []
    for prompt in prompts:
        pair = []
        for step in (first, last):
            path = next(run_dir / e["path"] for e in samples if e["step"] == step and e["prompt"] == prompt)
            image = Image.open(path).convert("RGB")
            pair.append(image.resize((image.width * SCALE, image.height * SCALE), Image.Resampling.NEAREST))
        rows.append((prompt, pair))
    width = max(sum(im.width for im in pair) for _, pair in rows) + 40
    label, gap = 22, 14
    height = 30 + sum(label + pair[0].height + gap for _, pair in rows)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    half = rows[0][1][0].width + 40
    for x, step in ((0, first), (half, last)):
        score = scores.get(step, {})
        text = f"step {step}" + "".join(f"   {k} {score[k]:.2f}" for k in ("concept", "control") if k in score)
        draw.text((x + 4, 8), text, fill="black")
    y = 30
    for prompt, (before, after) in rows:
        draw.text((4, y + 4), f'"{prompt}"', fill=(60, 60, 60))
        canvas.paste(before, (0, y + label))
        canvas.paste(after, (half, y + label))
        y += label + before.height + gap
    return canvas


if __name__ == "__main__":
    picture(Path(sys.argv[1])).save(sys.argv[2])
