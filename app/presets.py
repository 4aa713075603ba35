"""Presets: the shipped ones (presets/*.yaml, read-only) and the user's own (saved in a user folder).

The user folder is `<home>/presets`, home being main()'s `home` argument, else IMAGETUNE_HOME, else
~/.imagetune (in the Docker image IMAGETUNE_HOME lies under /workspace, so presets survive a pod restart).
A preset is identified as "shipped/<name>" or "user/<name>"; saving never writes into the shipped folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from app import forms
from trainer.core.config.load import interpolation_problems, read_preset
from trainer.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DIR = REPO_ROOT / "presets"
HOME_ENV = "IMAGETUNE_HOME"
DEFAULT_PRESET = "shipped/demo"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # always fullmatch: `$` matches before a final newline


def default_home(home: str | Path | None = None, environ=os.environ) -> Path:
    return Path(home or environ.get(HOME_ENV) or Path.home() / ".imagetune").expanduser().resolve()


@dataclass
class Presets:
    user_dir: Path
    shipped_dir: Path = SHIPPED_DIR

    def _files(self, folder: Path) -> list[Path]:
        return sorted(folder.glob("*.yaml")) if folder.is_dir() else []

    def choices(self) -> list[tuple[str, str]]:
        """(label, id) pairs for the preset list: the demo first, then the shipped ones, then the user's."""
        shipped = sorted(self._files(self.shipped_dir), key=lambda p: (p.stem != "demo", p.stem))
        out = [(f"{p.stem}  ·  built-in", f"shipped/{p.stem}") for p in shipped]
        out += [(f"{p.stem}  ·  yours", f"user/{p.stem}") for p in self._files(self.user_dir)]
        return out

    def path(self, preset_id: str) -> Path:
        kind, _, name = (preset_id or "").partition("/")
        folder = {"shipped": self.shipped_dir, "user": self.user_dir}.get(kind)
        if folder is None or not _NAME.fullmatch(name):
            raise UserError(f"Unknown preset {preset_id!r}; pick one from the list.")
        return folder / f"{name}.yaml"

    def values(self, preset_id: str) -> dict:
        """The preset over the schema defaults (see app.forms)."""
        return forms.values_from_preset(read_preset(self.path(preset_id)))

    def description(self, preset_id: str) -> str:
        """The comment block at the top of the preset file, as one paragraph."""
        try:
            lines = self.path(preset_id).read_text(encoding="utf-8").splitlines()
        except (OSError, UserError):
            return ""
        text = []
        for line in lines:
            if not line.startswith("#"):
                break
            text.append(line.lstrip("#").strip())
        return " ".join(t for t in text if t)

    def save(self, name: str, values: dict, workspace=None) -> str:
        """Write `values` (only schema keys, only what differs from the defaults) as the user preset `name`; return
        its id. Refuses ${...} values and, for an exposed UI (`workspace`), paths outside the workspace: a saved
        preset is a file in the user's folder that a later run (or a data.path) may read."""
        name = (name or "").strip().removesuffix(".yaml")
        if not _NAME.fullmatch(name):
            raise UserError(
                "A preset name uses letters, digits, '.', '_' and '-' (starting with a letter or digit), "
                "for example my-dog-lora."
            )
        # Unknown keys are dropped: a preset file saved with `train:`/`val:` folders would double as a YOLO data.yaml.
        values = {k: v for k, v in values.items() if k in forms.SPEC or k == "version"}
        problems = interpolation_problems(forms.nested(values))
        problems += workspace.config_problems(values) if workspace is not None else []
        if problems:
            raise UserError("Not saved: " + "; ".join(problems) + ".")
        self.user_dir.mkdir(parents=True, exist_ok=True)
        path = self.user_dir / f"{name}.yaml"
        header = f"# {name}: saved from the imagetune web UI. Only settings that differ from the defaults are listed.\n"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(header + forms.to_yaml(values, full=False), encoding="utf-8")
        os.replace(tmp, path)
        return f"user/{name}"
