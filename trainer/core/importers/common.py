"""What every importer shares: the preset being built, the keys it could not map (with why), and writing it.

An importer reads another trainer's config into an `Imported`: `set(key, value, source)` for each imagetune key
it fills, `skip(source, why)` for each key of theirs it cannot carry over. Settings at their own default in the
other trainer are skipped silently (a kohya_ss GUI file lists all ~200 of its fields): only a key the user set
to something that changes training is reported.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.core.data.confine import escapes
from trainer.core.data.scan import IMAGE_EXTENSIONS

_REPEATS = re.compile(r"^(\d+)_(.+)$")


@dataclass
class Imported:
    source: str  # the file read, for messages
    preset: dict = field(default_factory=dict)  # nested, sparse: what a preset YAML holds
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (their key = value, why)
    notes: list[str] = field(default_factory=list)  # choices made on the user's behalf

    def set(self, key: str, value: Any) -> None:
        node = self.preset
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.preset
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def skip(self, key: str, value: Any, why: str) -> None:
        self.unmapped.append((f"{key} = {value!r}", why))


def is_set(value: Any) -> bool:
    """Whether a value in their file means something (their GUIs write "" / 0 / false for "not used")."""
    return value not in (None, "", 0, 0.0, False, [], {}, "0", "none", "None")


def number(value: Any) -> float | None:
    """Their numbers sometimes come as strings ("1", "1e-4"); "" means unset."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def integer(value: Any) -> int | None:
    found = number(value)
    return None if found is None else int(found)


def square_resolution(value: Any, imported: Imported, key: str) -> int | None:
    """"1024,1024", [1024, 1024], 1024 or [512, 768, 1024] (ai-toolkit's several sizes) -> one side in pixels."""
    if isinstance(value, str):
        parts = [p for p in re.split(r"[,x ]+", value.strip()) if p]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = [value]
    sides = [integer(p) for p in parts]
    if not sides or any(s is None or s <= 0 for s in sides):
        imported.skip(key, value, "not a resolution in pixels")
        return None
    known = [s for s in sides if s is not None]
    if len(known) == 2 and known[0] != known[1]:
        side = int(math.sqrt(known[0] * known[1])) // 64 * 64  # the same pixel count as a square
        imported.notes.append(f"{key} {value!r}: not square; data.resolution {side} has about its pixel count "
                              "(with data.bucketing, images keep their aspect ratio)")
        return side
    if len(known) > 2:
        imported.notes.append(f"{key} {value!r}: several sizes; imagetune trains one, the largest ({max(known)})")
    return max(known)


def count_images(folder: Path) -> int | None:
    """Images one epoch sees in a folder, kohya `N_name` sub-folders counted N times; None if it is not there."""
    if not folder.is_dir() or escapes(folder):  # an exposed UI's import looks inside the workspace only
        return None
    total = 0
    for child in folder.iterdir():
        match = _REPEATS.match(child.name)
        if child.is_dir() and match:
            total += int(match.group(1)) * _images_in(child)
    return total or _images_in(folder)


def _images_in(folder: Path) -> int:
    return sum(1 for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)


def steps_from_epochs(imported: Imported, epochs: int, images: int | None, batch: int) -> None:
    """kohya / ai-toolkit count epochs where imagetune counts optimizer steps: steps = epochs x images / batch."""
    if images is None:
        imported.notes.append(f"training length was {epochs} epochs; the images could not be counted (their folder "
                              "is not on this machine): set train.steps")
        return
    steps = max(1, epochs * math.ceil(images / max(1, batch)))
    imported.set("train.steps", steps)
    imported.notes.append(f"train.steps {steps}: {epochs} epochs of {images} images (repeats counted) at batch {batch}")


def render(imported: Imported, problems: list[str], command: str) -> str:
    """The preset as YAML, headed by comments: where it came from, the keys left behind and why, what is missing."""
    import yaml

    lines = [f"# Imported from {imported.source} by `{command}`."]
    if imported.notes:
        lines.append("# Choices made while importing:")
        lines += [f"#   - {note}" for note in imported.notes]
    if imported.unmapped:
        lines.append("# Not imported (no imagetune equivalent, or imagetune decides it itself):")
        lines += [f"#   - {key}: {why}" for key, why in imported.unmapped]
    if problems:
        lines.append("# Still to set before it runs (launch.py --dry-run lists these too):")
        lines += [f"#   - {problem}" for problem in problems]
    body = yaml.safe_dump(imported.preset, sort_keys=False, allow_unicode=True, width=120)
    return "\n".join(lines) + "\n" + body
